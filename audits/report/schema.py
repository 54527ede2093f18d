"""The report's shape, declared: every field that ``show``, ``gate``, ``diff``, ``merge`` and
``summary`` read, with its type, checked before any of them reads it.  A file that fails is a
usage error (exit 2) naming the path to the bad field (``cases[3].out.max_abs``), what it held
and what is expected, never a ``KeyError`` traceback (exit 1 would mean "check failed").

A spec is a type (or tuple of types), a dict ``{key: spec}`` (keys required, extra keys
allowed: reports grow), :class:`Opt` (the value may be None or absent), :class:`Each` (every
value of a dict, or every item of a list, follows one spec) or :class:`When` (a spec that
applies only when another field has a given value)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = [
    "Opt", "Each", "When", "check", "REPORT", "CASE", "VERDICTS", "LATER_VERDICTS", "FAILING", "OUT_OF_DOMAIN_KINDS",
    "upgrade_case", "upgrade_report", "COVERAGE", "DIAGNOSIS",
]  # fmt: skip

NUM = (int, float)

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


@dataclass(frozen=True)
class Opt:
    spec: Any


@dataclass(frozen=True)
class Each:
    spec: Any


@dataclass(frozen=True)
class When:
    """``spec`` applies to the enclosing dict when its field ``key`` is one of ``values``."""

    key: str
    values: tuple
    spec: dict


def _name(spec) -> str:
    if isinstance(spec, tuple):
        return " or ".join(t.__name__ for t in spec)
    return spec.__name__ if isinstance(spec, type) else type(spec).__name__


def check(value, spec, path: str) -> str | None:
    """The first violation of ``spec`` by ``value`` (``"path: expected T, got U"``), or None."""
    if isinstance(spec, Opt):
        return None if value is None else check(value, spec.spec, path)
    if isinstance(spec, Each):
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else None
        if items is None:
            return f"{path}: expected an object or a list, got {type(value).__name__}"
        fmt = "{}.{}" if isinstance(value, dict) else "{}[{}]"
        return next((e for k, v in items if (e := check(v, spec.spec, fmt.format(path, k)))), None)
    if isinstance(spec, list):  # several specs on one value (a dict spec and its When parts)
        return next((e for s in spec if (e := check(value, s, path))), None)
    if isinstance(spec, When):
        return check(value, spec.spec, path) if value.get(spec.key) in spec.values else None
    if isinstance(spec, dict):
        if not isinstance(value, dict):
            return f"{path}: expected an object, got {type(value).__name__}"
        for key, sub in spec.items():
            if key not in value and not isinstance(sub, Opt):
                return f"{path}.{key}: missing (expected {_name(sub) if not isinstance(sub, dict) else 'an object'})"
            if err := check(value.get(key), sub, f"{path}.{key}"):
                return err
        return None
    if isinstance(value, bool) and bool not in (spec if isinstance(spec, tuple) else (spec,)):
        return f"{path}: expected {_name(spec)}, got bool"  # True is an int to Python, not to a report
    return None if isinstance(value, spec) else f"{path}: expected {_name(spec)}, got {type(value).__name__}"


_ERRORS = {"max_abs": NUM, "nonfinite_where_ref_finite": int, "nan_swallowed": int}
_BACKWARD = [
    {"status": str},
    When(
        "status",
        ("ran",),
        {
            "grads": Each({**_ERRORS, "bound": Opt({"violations": int}), "fa_criterion": Opt({"max_abs": NUM})}),
            "missing": Each(str),
            "zeros": {"dq_empty_nonzero": int, "dk_unseen_nonzero": int, "dv_unseen_nonzero": int},
            "spread": Opt(Each({"differing": int})),
            "certified": Opt(Each(NUM)),
        },
    ),
]
#: a failing case's diagnosis per tensor (``audits.verdict.diagnosis``; docs/diagnosis.md)
_DIAGNOSIS = Each({
    "violations": int, "elements": int, "criteria": Each(int), "summary": str,
    "axes": Each({"values": Each((int, str)), "share_of_violations": NUM, "share_of_elements": NUM, "of": int}),
})  # fmt: skip
#: one case record (the Case fields of ``config`` are checked by ``audits.suites.cases.case_from_dict``)
CASE = [
    {
        "case": str,
        "config": dict,
        "verdict": str,
        "reasons": Each(str),
        "status": str,
        # a varlen case's (audits.engine.evaluate, docs/varlen.md)
        "varlen": Opt({"sequences": int, "total_q": int, "total_k": int, "per_sequence": bool, "entry": Opt(str)}),
        # a failing case's: where its violations concentrate, and its error map's file (maps/<case>.npz)
        "diagnosis": Opt(_DIAGNOSIS),
        "error_map": Opt(str),
    },
    When(
        "status",
        ("ran",),
        {
            "out": _ERRORS,
            "lse": Opt({**_ERRORS, "mismatched_nonfinite": int}),
            "bound": Opt({"kind": str, "violations": int, "lse_violations": int}),
            "fa_criterion": Opt({"max_abs": NUM, "lowprec_max_abs": NUM, "rounding": NUM}),
            "backward": Opt(_BACKWARD),
        },
    ),
]
_PAIRS = Each(Each(int))
#: a report's ``coverage`` (``audits.verdict.coverage.coverage``), or ``{"absent": why}``
COVERAGE = [
    {"absent": Opt(str)},
    When(
        "absent",
        (None,),
        {
            "arch": Opt(str), "domain": dict, "directions": Each(str), "notes": Each(str),
            "head_dims": {"accepted": Opt(_PAIRS), "forward": _PAIRS, "backward": _PAIRS,
                          "missed_forward": Opt(_PAIRS), "missed_backward": Opt(_PAIRS),
                          "values": {"forward": {"d": Each(int), "dv": Each(int)}}},
            "classes": Opt(Each({"description": str, "source": str, "directions": Each(str), "forward": Opt(str),
                                 "backward": Opt(str)})),
        },
    ),
]  # fmt: skip
#: a report's ``diagnosis`` (``audits.verdict.separators``): which case fields tell failing cases from passing
DIAGNOSIS = {
    "failing": int, "passing": int, "note": Opt(str),
    "separators": Each({"field": str, "rule": str, "failing": int, "passing": int, "exact": bool, "score": NUM}),
}  # fmt: skip
#: the report's top level and summary (its cases: :data:`CASE`, each)
REPORT = {
    "schema": str, "kernel": str, "suite": str, "seed": int, "device": str, "environment": dict, "command": str,
    "created": str, "thresholds": dict, "cases": list, "coverage": COVERAGE, "diagnosis": Opt(DIAGNOSIS),
    "summary": {
        "cases": int,
        "verdicts": {v: int for v in VERDICTS},
        "worst": Each(Opt({"value": NUM, "case": str})),
    },
}  # fmt: skip


# ---- records written before a field existed, upgraded where they are read ------------------


def upgrade_case(rec: dict) -> dict:
    """A case record as this version writes it, in place (and returned): the one place that
    reads what older versions wrote only as message text.  ``out_of_domain_kind`` (absent before
    2026-12-01) from the ``out_of_domain`` message; ``audit_error`` (absent in the first
    journals) from the reason of an OOM in the audit's own FP64 work.  Idempotent; a record
    that is not a dict is left for the schema check to name.  A failing record written before
    diagnoses (2026-12-01) gets an empty ``diagnosis``: nothing localized, as for a crash."""
    if not isinstance(rec, dict):
        return rec
    if rec.get("verdict") in FAILING and "diagnosis" not in rec:
        rec["diagnosis"] = {}
    ood = rec.get("out_of_domain")
    if isinstance(ood, str) and ood and "out_of_domain_kind" not in rec:
        rec["out_of_domain_kind"] = OUT_OF_DOMAIN_KINDS[1] if "claims no semantics" in ood else OUT_OF_DOMAIN_KINDS[0]
    if "audit_error" not in rec:
        bwd = rec.get("backward") if isinstance(rec.get("backward"), dict) else {}
        reasons = rec.get("reasons") if isinstance(rec.get("reasons"), list) else []
        why = " ".join(str(r) for r in reasons) + str(bwd.get("reason", ""))
        if "the audit's FP64" in why and "ran out of GPU memory" in why:
            rec["audit_error"] = True
    return rec


def upgrade_report(rep: dict) -> dict:
    """A report (or a partial one) as this version writes it, in place: its summary counts the
    verdicts younger than it (:data:`LATER_VERDICTS`: 0, there were none), every case record
    is upgraded (:func:`upgrade_case`), and a report written before coverage gets its
    ``coverage`` computed from its cases (``audits.verdict.coverage.legacy_basis``: the domain it recorded,
    the architecture of a built-in kernel by name or of the GPU it ran on; its notes say so).
    Any other count missing stays missing, for the schema check to name."""
    if not isinstance(rep, dict):
        return rep
    counts = (rep.get("summary") or {}).get("verdicts") if isinstance(rep.get("summary"), dict) else None
    if isinstance(counts, dict):
        for v in LATER_VERDICTS:
            counts.setdefault(v, 0)
    cases = rep.get("cases") if isinstance(rep.get("cases"), list) else []
    for c in cases:
        upgrade_case(c)
    if "coverage" not in rep and isinstance(rep.get("cases"), list):
        rep["coverage"] = _legacy_coverage(rep, cases)
    return rep


def _legacy_coverage(rep: dict, cases: list) -> dict:
    """The coverage of a report written before coverage, from its cases; ``{"absent": why}``
    when it holds none, or they cannot be read (the schema check then names the bad field)."""
    from audits.verdict.coverage import coverage_from_basis, legacy_basis

    if not cases:
        return {"absent": "the report predates coverage and holds no case"}
    try:
        return coverage_from_basis(legacy_basis(rep), records=cases)
    except Exception as exc:  # noqa: BLE001 - a malformed old report: its fields are named by the schema check
        return {
            "absent": f"the report predates coverage, and its cases could not be read ({type(exc).__name__}: {exc})"
        }
