"""A case record: what ``run`` writes for one case (``audits.engine.evaluate``), what the gate
judges (``audits.verdict.gate``), the diagnosis localizes (``audits.verdict.diagnosis``) and the
reports render (``audits.report``).  Its fields are documented here, once; ``audits.report.schema``
checks them when a report is read, and upgrades the records older versions wrote."""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict

__all__ = [
    "CaseRecord", "ContractRecord", "VERDICTS", "LATER_VERDICTS", "FAILING", "OUT_OF_DOMAIN_KINDS", "TIMING_FIELDS",
    "without_timing",
]  # fmt: skip

#: a case's verdicts (``audits.verdict.gate``), in the order reports count them
#: (``known``: a failing case that an entry of a ``--known`` file describes, ``audits.verdict.known``)
VERDICTS = ("pass", "warn", "known", "fail", "error", "crash", "timeout", "skipped", "out-of-domain")
#: verdicts younger than the first reports: a report without their counts had none of them
LATER_VERDICTS = ("timeout", "known")
#: the verdicts that fail a run (and get their inputs saved for reproduction)
FAILING = ("fail", "error", "crash", "timeout")
#: a case record's wall-clock fields (the case's seconds, its kernel calls'; its backward's
#: ``seconds`` too): they differ between two runs that measured the same
TIMING_FIELDS = ("seconds", "call_seconds")


def without_timing(rec: dict) -> dict:
    """``rec`` without its wall-clock fields (:data:`TIMING_FIELDS`, and its backward's ``seconds``):
    what two runs of the same code on the same case must agree on."""
    out = {k: v for k, v in rec.items() if k not in TIMING_FIELDS}
    if isinstance(out.get("backward"), dict) and "seconds" in out["backward"]:
        out["backward"] = {k: v for k, v in out["backward"].items() if k != "seconds"}
    return out


#: a case record's ``out_of_domain_kind``, beside its ``out_of_domain`` message: the inputs pass
#: float32's range by the kernel design's headroom analysis, or hold NaN/inf that the kernel
#: claims no semantics for (``audits.kernels.claims_nonfinite_inputs``)
OUT_OF_DOMAIN_KINDS = ("float32-range", "nonfinite-inputs")


class ContractRecord(TypedDict):
    """A returned tensor that breaks the audited callable's contract (``audits.contract.ContractBreach``,
    its ``as_record``): a case record's ``contract`` (out, LSE) and its backward's (gradients).

    - ``tensor``: "out", "lse", "dq", "dk", "dv" or "dsink"
    - ``axes``: the expected shape's axes, named by the Case fields that size them
      (``["batch", "seqlen_q", "heads_q", "dv"]``); ``expected``: that shape, ``expected_dtype``
      its dtype ("bfloat16") and ``dtype_rule`` the rule it follows ("the input dtype, bfloat16
      for fp8 inputs")
    - ``got`` / ``got_dtype``: the shape and dtype returned (None both when no tensor was);
      ``got_type``: the type's name ("Tensor", "tuple")
    - ``fault``: the breach without the case's sizes ("seqlen_q and heads_q swapped", "wrong dv"):
      the same for every case a kernel breaks alike, what failing cases are grouped by
      (``audits.verdict.separators.fault_groups``); ``reason``: the breach with the case's sizes
    """

    tensor: str
    axes: list[str]
    expected: list[int]
    expected_dtype: str
    dtype_rule: str
    got: list[int] | None
    got_dtype: str | None
    got_type: str
    fault: str
    reason: str


class CaseRecord(TypedDict):
    """One case of a report (JSON object; ``audits.report.schema.CASE`` checks it when read).

    - ``case``: the case's name; ``config``: its ``Case`` fields (``audits.suites.cases.Case.as_dict``),
      ``family`` and ``seed`` its input family and seed; ``case_id``: its identity, from the config
      alone (``audits.suites.case.canonical_identity``), what comparisons of reports match by
    - ``status``: how the call went ("ran", "error", "skipped", "crash", "timeout"), ``reason``
      why when it did not run; ``contract``: when the kernel returned an out or LSE of another
      shape or dtype than the contract's (status "error"), one :class:`ContractRecord` per tensor
    - ``verdict`` (one of :data:`VERDICTS`) and ``reasons`` (a sentence per finding of the gate);
      a ``known`` case's ``known_id`` (the entry of the ``--known`` file) and ``known_from`` (the
      failing verdict it had, ``audits.verdict.known``)
    - ``out`` / ``lse``: the errors against the FP64 reference (``numerics.metrics``; ``lse`` None
      when the kernel returned none, ``lse_returned`` False then)
    - ``bound``: the per-element forward bound (``kind`` "fa4" or a peer's, ``violations``,
      ``lse_violations``, ``tightness``, ``lse_tightness``; ``nonfinite`` / ``lse_nonfinite``:
      the violations that are NaN/inf results); ``fa_criterion``: FlashAttention's test criterion
    - ``model_check``: beside finite bound violations of a kernel other than the models, the FA4
      model of the analysed arithmetic on the same inputs against the same bound (``numerics``
      "fa4" or "peer", ``violations``, ``tightness``, ``lse_violations``, ``lse_tightness``): the
      gate's evidence of whether the kernel or the analysis is at fault
    - ``mpmath_max_abs``: how far the FP64 reference is from the exact row; ``mpmath_scale``: that
      row's scale (its outputs' sum_j P_ij |V_jc| and its |LSE|), at which the gate allows it
    - ``bias``: whether out's and the LSE's errors lean one way (``{"out": ..., "lse": ...}``, each
      ``numerics.metrics.signed_bias``: the mean signed error, raw and in ULPs, its z, clustered;
      ``lse`` None without an LSE); the gate's ``rounding-bias`` warning reads it
    - ``written``: a case the checks accepted on values fresh memory could have held (NaN, inf or
      0 in the result, or a non-finite reference), re-run with poisoned memory
      (``audits.engine.evaluate._judged_written``): ``memory_like`` (how many such values),
      ``unwritten`` / ``read`` (elements never written, or reading memory never written; either
      fails: the gate's ``unwritten`` and ``memory-read``) and their ``unwritten_where`` /
      ``read_where``, or ``note`` when no poisoned run ran
    - ``out_of_domain`` / ``out_of_domain_kind`` (one of :data:`OUT_OF_DOMAIN_KINDS`): inputs the
      kernel does not claim; ``audit_error``: the failure was the audit's own (FP64 out of memory)
    - ``backward``: the gradients' record under ``run --backward`` (``audits.engine.backward``;
      its ``contract``: a :class:`ContractRecord` per gradient that breaks the contract; its
      ``written``: as the case's, for dq, dk, dv the checks accepted on memory-like values)
    - ``varlen``: a varlen case's sequences; ``diagnosis`` / ``error_map``: a failing case's
      localization (``audits.verdict.diagnosis``, docs/diagnosis.md)
    - ``seconds``, ``repro`` / ``repro_inputs``: its time and how to reproduce it
    """

    case: str
    case_id: NotRequired[str]
    config: dict[str, Any]
    family: NotRequired[str]
    seed: NotRequired[int]
    status: str
    verdict: str
    reasons: list[str]
    known_id: NotRequired[str]
    known_from: NotRequired[str]
    reason: NotRequired[str]
    contract: NotRequired[list[ContractRecord]]
    seconds: NotRequired[float]
    out: NotRequired[dict[str, Any]]
    lse: NotRequired[dict[str, Any] | None]
    lse_returned: NotRequired[bool]
    bound: NotRequired[dict[str, Any] | None]
    fa_criterion: NotRequired[dict[str, Any] | None]
    mpmath_max_abs: NotRequired[float | None]
    mpmath_scale: NotRequired[float]
    model_check: NotRequired[dict[str, Any]]
    bias: NotRequired[dict[str, Any]]
    written: NotRequired[dict[str, Any]]
    out_of_domain: NotRequired[str | None]
    out_of_domain_kind: NotRequired[str | None]
    audit_error: NotRequired[bool]
    backward: NotRequired[dict[str, Any] | None]
    varlen: NotRequired[dict[str, Any] | None]
    diagnosis: NotRequired[dict[str, Any]]
    error_map: NotRequired[str | None]
    repro: NotRequired[str]
    repro_inputs: NotRequired[str]
