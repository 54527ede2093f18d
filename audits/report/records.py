"""A case record: what ``run`` writes for one case (``audits.engine.evaluate``), what the gate
judges (``audits.verdict.gate``), the diagnosis localizes (``audits.verdict.diagnosis``) and the
reports render (``audits.report``).  Its fields are documented here, once; ``audits.report.schema``
checks them when a report is read, and upgrades the records older versions wrote."""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict

__all__ = ["CaseRecord", "VERDICTS", "LATER_VERDICTS", "FAILING", "OUT_OF_DOMAIN_KINDS"]

#: a case's verdicts (``audits.verdict.gate``), in the order reports count them
VERDICTS = ("pass", "warn", "fail", "error", "crash", "timeout", "skipped", "out-of-domain")
#: verdicts younger than the first reports: a report without their counts had none of them
LATER_VERDICTS = ("timeout",)
#: the verdicts that fail a run (and get their inputs saved for reproduction)
FAILING = ("fail", "error", "crash", "timeout")
#: a case record's ``out_of_domain_kind``, beside its ``out_of_domain`` message: the inputs pass
#: float32's range by the kernel design's headroom analysis, or hold NaN/inf that the kernel
#: claims no semantics for (``audits.kernels.claims_nonfinite_inputs``)
OUT_OF_DOMAIN_KINDS = ("float32-range", "nonfinite-inputs")


class CaseRecord(TypedDict):
    """One case of a report (JSON object; ``audits.report.schema.CASE`` checks it when read).

    - ``case``: the case's name; ``config``: its ``Case`` fields (``audits.suites.cases.Case.as_dict``),
      ``family`` and ``seed`` its input family and seed
    - ``status``: how the call went ("ran", "error", "skipped", "crash", "timeout"), ``reason``
      why when it did not run
    - ``verdict`` (one of :data:`VERDICTS`) and ``reasons`` (a sentence per finding of the gate)
    - ``out`` / ``lse``: the errors against the FP64 reference (``numerics.metrics``; ``lse`` None
      when the kernel returned none, ``lse_returned`` False then)
    - ``bound``: the per-element forward bound (``kind`` "fa4" or a peer's, ``violations``,
      ``lse_violations``, ``tightness``); ``fa_criterion``: FlashAttention's test criterion
    - ``mpmath_max_abs``: how far the FP64 reference is from the exact row
    - ``out_of_domain`` / ``out_of_domain_kind`` (one of :data:`OUT_OF_DOMAIN_KINDS`): inputs the
      kernel does not claim; ``audit_error``: the failure was the audit's own (FP64 out of memory)
    - ``backward``: the gradients' record under ``run --backward`` (``audits.engine.backward``)
    - ``varlen``: a varlen case's sequences; ``diagnosis`` / ``error_map``: a failing case's
      localization (``audits.verdict.diagnosis``, docs/diagnosis.md)
    - ``seconds``, ``repro`` / ``repro_inputs``: its time and how to reproduce it
    """

    case: str
    config: dict[str, Any]
    family: NotRequired[str]
    seed: NotRequired[int]
    status: str
    verdict: str
    reasons: list[str]
    reason: NotRequired[str]
    seconds: NotRequired[float]
    out: NotRequired[dict[str, Any]]
    lse: NotRequired[dict[str, Any] | None]
    lse_returned: NotRequired[bool]
    bound: NotRequired[dict[str, Any] | None]
    fa_criterion: NotRequired[dict[str, Any] | None]
    mpmath_max_abs: NotRequired[float | None]
    out_of_domain: NotRequired[str | None]
    out_of_domain_kind: NotRequired[str | None]
    audit_error: NotRequired[bool]
    backward: NotRequired[dict[str, Any] | None]
    varlen: NotRequired[dict[str, Any] | None]
    diagnosis: NotRequired[dict[str, Any]]
    error_map: NotRequired[str | None]
    repro: NotRequired[str]
    repro_inputs: NotRequired[str]
