"""The report's shape, declared: every field that ``show``, ``gate``, ``diff``, ``merge`` and
``summary`` read, with its type, checked before any of them reads it; and every upgrade of
what older versions wrote (:func:`validate_report` applies them when a report or a journal is
read, so that the readers assume this version's shape).  A file that fails is a
usage error (exit 2) naming the path to the bad field (``cases[3].out.max_abs``), what it held
and what is expected, never a ``KeyError`` traceback (exit 1 would mean "check failed").

A spec is a type (or tuple of types), a dict ``{key: spec}`` (keys required, extra keys
allowed: reports grow), :class:`Opt` (the value may be None or absent), :class:`Each` (every
value of a dict, or every item of a list, follows one spec) or :class:`When` (a spec that
applies only when another field has a given value)."""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Any

from audits.kernels import KERNELS, arch_of_capability
from audits.report.records import FAILING, LATER_VERDICTS, OUT_OF_DOMAIN_KINDS, VERDICTS
from audits.suites.case import identity_of
from audits.suites.cases import Case, case_from_dict
from audits.suites.domain import Domain, DomainError
from audits.verdict.coverage import basis_of_coverage, coverage_from_basis
from audits.verdict.separators import cause_groups, separators

__all__ = [
    "Opt",
    "Each",
    "When",
    "check",
    "REPORT",
    "CASE",
    "VERDICTS",
    "LATER_VERDICTS",
    "FAILING",
    "OUT_OF_DOMAIN_KINDS",
    "upgrade_case",
    "upgrade_report",
    "upgrade",
    "upgrade_thresholds",
    "coverage_basis",
    "journal_basis",
    "COVERAGE",
    "DIAGNOSIS",
    "KNOWN",
    "SCHEMA",
    "READABLE",
    "ReportError",
    "validate_report",
]

NUM = (int, float)
SCHEMA = "fa4-audit/report/2"
#: schemas ``validate_report`` reads: 2 adds the gradients of ``run --backward`` (a case's
#: ``backward``, the summary's ``backward``); a version-1 report is a version-2 report without them
READABLE = (SCHEMA, "fa4-audit/report/1")


class ReportError(ValueError):
    """A file that is not a valid fa4-audit report; the message names the field."""


@dataclass(frozen=True)
class Opt:
    spec: Any


@dataclass(frozen=True)
class Each:
    spec: Any
    #: of a dict: keys whose values follow a spec of their own instead (``diagnosis.causes``)
    keys: dict | None = None


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
        own = spec.keys or {}
        return next((e for k, v in items if (e := check(v, own.get(k, spec.spec), fmt.format(path, k)))), None)
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


#: an error record (``numerics.metrics.output_errors``); ``checked`` absent before 2026-12-04
_ERRORS = {"max_abs": NUM, "nonfinite_where_ref_finite": int, "nan_swallowed": int, "checked": Opt(int)}
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
            # the backward's poisoned re-runs of gradients the checks accepted (audits.engine.evaluate._judged_written)
            "written": Opt({"memory_like": int, "unwritten": int, "read": int}),
        },
    ),
]
#: a failing case's diagnosis per tensor (``audits.verdict.diagnosis``; docs/diagnosis.md)
_DIAGNOSIS = Each({
    "violations": int, "elements": int, "criteria": Each(int), "summary": str,
    "axes": Each({"values": Each((int, str)), "share_of_violations": NUM, "share_of_elements": NUM, "of": int}),
}, keys={
    "causes": Each({"cause": str, "detail": str, "evidence": str, "score": NUM}),
    "causes_error": str,  # why the cause analysis broke (the verdict stands)
    "poisoned": Each(str),  # what the poisoned re-runs showed when no cause came of them
})  # fmt: skip
#: one case record (the Case fields of ``config`` are checked by ``audits.suites.cases.case_from_dict``)
CASE = [
    {
        "case": str,
        "case_id": Opt(str),
        "config": dict,
        "verdict": str,
        "reasons": Each(str),
        "status": str,
        # a returned tensor of another shape or dtype than the contract's (audits.report.records.ContractRecord)
        "contract": Opt(Each({"tensor": str, "fault": str, "reason": str})),
        # a varlen case's (audits.engine.evaluate, docs/varlen.md)
        "varlen": Opt({"sequences": int, "total_q": int, "total_k": int, "per_sequence": bool, "entry": Opt(str)}),
        # a failing case's: where its violations concentrate, and its error map's file (maps/<case>.npz)
        "diagnosis": Opt(_DIAGNOSIS),
        "error_map": Opt(str),
        # the kernel call's seconds, a second call's too with --time-calls (audits.engine.evaluate._timed_call)
        "call_seconds": Opt(Each(NUM)),
        "second_call_identical": Opt(bool),
        "second_call_differing": Opt(int),
    },
    # a failing case a --known entry describes (audits.verdict.known): which entry, and the verdict it had
    When("verdict", ("known",), {"known_id": str, "known_from": str}),
    When(
        "status",
        ("ran",),
        {
            "out": _ERRORS,
            "lse": Opt({**_ERRORS, "mismatched_nonfinite": int}),
            "bound": Opt({"kind": str, "violations": int, "lse_violations": int}),
            "fa_criterion": Opt({"max_abs": NUM, "lowprec_max_abs": NUM, "rounding": NUM}),
            "model_check": Opt({"numerics": str, "violations": int, "lse_violations": int}),
            # the signed bias of out and LSE (numerics.metrics.bias_record; docs/diagnosis.md, "Rounding bias")
            "bias": Opt(dict),
            # the poisoned re-runs of a case the checks accepted on memory-like values
            # (audits.engine.evaluate._judged_written; the gate's "unwritten" and "memory-read")
            "written": Opt({"memory_like": int, "unwritten": int, "read": int}),
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
    # the contract's breaches by tensor and fault (audits.verdict.separators.fault_groups)
    "faults": Opt(Each({"tensor": str, "fault": str, "cases": int, "first": str})),
    # the tested causes over the failing and warning cases (audits.verdict.separators.cause_groups)
    "causes": Opt({"failing": int, "warning": int, "unexplained": int, "untested": int,
                   "groups": Each({"cause": str, "cases": int, "best": int, "first": str, "detail": str,
                                   "detail_cases": int})}),
}  # fmt: skip
#: a report's ``known`` (``audits.verdict.known.apply_known``): the --known file applied, per entry its status
KNOWN = {
    "file": str, "strict": bool, "not_reproducing": Each(str),
    "entries": Each({"id": str, "reason": str, "rule": str, "status": str, "matched": int, "exercised": int}),
}  # fmt: skip
#: the report's top level and summary (its cases: :data:`CASE`, each)
REPORT = {
    "schema": str, "kernel": str, "suite": str, "seed": int, "device": str, "environment": dict, "command": str,
    "created": str, "thresholds": dict, "cases": list, "coverage": COVERAGE, "diagnosis": Opt(DIAGNOSIS),
    "known": Opt(KNOWN),
    "summary": {
        "cases": int,
        "verdicts": {v: int for v in VERDICTS},
        "worst": Each(Opt({"value": NUM, "case": str})),
    },
}  # fmt: skip


# ---- reading a report: every upgrade of what older versions wrote, in this one place ---------


#: Case fields younger than the report schema (the varlen ones, docs/varlen.md; the mods,
#: docs/mods.md, which ``Case.as_dict`` leaves out when unset): a report written before them holds
#: fixed-length cases without mods only, for which they take their defaults
_LATER_FIELDS = ("seqlens", "seqused_k", "page_size", "num_splits", "pack_gqa", "score_mod", "mask_mod", "block_sparse")
_CASE_FIELDS = [f.name for f in fields(Case)]


def validate_report(rep, where: str) -> dict:
    """``rep`` if it is a report of a ``READABLE`` schema, upgraded to this version's shape
    (:func:`upgrade`) and checked field by field (top level, summary, every case and its config),
    else :class:`ReportError` naming ``where``, the path to the field and what was expected."""
    if not isinstance(rep, dict):
        raise ReportError(f"{where}: not a report (a JSON {type(rep).__name__}, expected an object)")
    if rep.get("schema") not in READABLE:
        raise ReportError(f"{where}: schema {rep.get('schema')!r} is not one of {', '.join(READABLE)}")
    upgrade_report(rep)  # fields younger than the file, from what it holds
    if err := check(rep, REPORT, "report"):
        raise ReportError(f"{where}: {err}")
    for i, c in enumerate(rep["cases"]):
        if err := check(c, CASE, f"cases[{i}]"):
            raise ReportError(f"{where}: {err}")
        if c["verdict"] not in VERDICTS:
            raise ReportError(f"{where}: case {c['case']} has verdict {c['verdict']!r}; known: {', '.join(VERDICTS)}")
        missing = [k for k in _CASE_FIELDS if k not in c["config"] and k not in _LATER_FIELDS]
        if missing:
            lacks = ", ".join(missing)
            raise ReportError(f"{where}: cases[{i}].config lacks {lacks} (a report holds every Case field)")
        try:
            case_from_dict(c["config"], where=f"cases[{i}].config")
        except ValueError as exc:
            raise ReportError(f"{where}: {exc}") from exc
    return upgrade(rep)


def upgrade(rep: dict) -> dict:
    """A checked report (or one built from a journal) as this version writes it, in place: the
    fields of :func:`upgrade_report`, and a report written before separators gets its
    ``diagnosis`` computed from its cases (``audits.verdict.separators``), one written before the
    causes were tallied (2026-12-05) its ``causes`` (``cause_groups``).  Idempotent."""
    upgrade_report(rep)
    if "diagnosis" not in rep:
        rep["diagnosis"] = separators(rep["cases"], arch=(rep["coverage"] or {}).get("arch"))
    elif isinstance(rep["diagnosis"], dict) and "causes" not in rep["diagnosis"]:
        if causes := cause_groups(rep["cases"]):
            rep["diagnosis"]["causes"] = causes
    return rep


def upgrade_case(rec: dict) -> dict:
    """A case record as this version writes it, in place (and returned): the one place that
    reads what older versions wrote only as message text.  ``out_of_domain_kind`` (absent before
    2026-12-01) from the ``out_of_domain`` message; ``audit_error`` (absent in the first
    journals) from the reason of an OOM in the audit's own FP64 work.  Idempotent; a record
    that is not a dict is left for the schema check to name.  A failing record written before
    diagnoses (2026-12-01) gets an empty ``diagnosis``: nothing localized, as for a crash.  A
    record written before case identities (2026-12-04) gets its ``case_id`` from its config
    (``audits.suites.case.identity_of``; a config that is not a case is left for the check to
    name).  Its error records written before ``checked`` keep their counts without it (the views
    then print "N non-finite" without "of M", ``audits.report.html.max_text``)."""
    if not isinstance(rec, dict):
        return rec
    if "case_id" not in rec and isinstance(rec.get("config"), dict):
        try:
            rec["case_id"] = identity_of(rec["config"])
        except ValueError:
            pass  # the schema check names the bad config field
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
    """A report (or a partial one) as this version writes it, in place, before its check: its
    summary counts the verdicts younger than it (:data:`LATER_VERDICTS`: 0, there were none) and,
    written before partial reports, says it ran what it selected; every case record is upgraded
    (:func:`upgrade_case`), and a report written before coverage gets its ``coverage`` computed
    from its cases (:func:`_legacy_basis`: the domain it recorded, the
    architecture of a built-in kernel by name or of the GPU it ran on; its notes say so).  Any
    other count missing stays missing, for the schema check to name."""
    if not isinstance(rep, dict):
        return rep
    summary = rep.get("summary") if isinstance(rep.get("summary"), dict) else {}
    counts = summary.get("verdicts")
    if isinstance(counts, dict):
        for v in LATER_VERDICTS:
            counts.setdefault(v, 0)
    if isinstance(summary.get("cases"), int) and "run" not in summary:
        summary["run"] = summary["cases"]
    if "run" in summary and "selected" not in summary:
        summary["selected"] = summary["run"]
    cases = rep.get("cases") if isinstance(rep.get("cases"), list) else []
    for c in cases:
        upgrade_case(c)
    if "coverage" not in rep and isinstance(rep.get("cases"), list):
        rep["coverage"] = _legacy_coverage(rep, cases)
    return rep


def upgrade_thresholds(th: dict) -> dict:
    """The thresholds a report records (``report["thresholds"]``) with the keys added since in
    the values that reproduce how it was judged: ``[lse] rel`` 0 (the ceiling was ``max_abs``
    alone) and ``[policy] lse_missing`` "warn" (its records of then carry no ``lse_returned``,
    which the policy reads).  A copy; ``th`` is left as recorded."""
    out = {**th}
    if isinstance(th.get("lse"), dict):
        out["lse"] = {"rel": 0.0, **th["lse"]}
    if isinstance(th.get("policy"), dict):
        out["policy"] = {"lse_missing": "warn", **th["policy"]}
    return out


def coverage_basis(rep: dict) -> dict:
    """The basis a read report's coverage was computed on (``audits.verdict.coverage``), to
    recompute it over other records (a re-judged or merged report); for a coverage that cannot be
    read, the one a report written before coverage has (:func:`_legacy_basis`)."""
    return basis_of_coverage(rep.get("coverage")) or _legacy_basis(rep)


def journal_basis(head: dict) -> dict:
    """The coverage basis of a run's journal (``audits.engine.journal``: its header line): the
    domain and architecture the run kept in it (``coverage``, per kernel), or for a journal written
    before coverage the one an old report has, from what it holds (:func:`_legacy_basis`)."""
    kept = (head.get("coverage") or {}).get(head["kernel"])
    if kept and (basis := basis_of_coverage({"domain": kept.get("domain"), "arch": kept.get("arch")})):
        return basis
    extra = head.get("report") or {}
    return _legacy_basis({"kernel": head["kernel"], "environment": extra.get("environment") or {}})


def _legacy_coverage(rep: dict, cases: list) -> dict:
    """The coverage of a report written before coverage, from its cases; ``{"absent": why}``
    when it holds none, or they cannot be read (the schema check then names the bad field)."""
    if not cases:
        return {"absent": "the report predates coverage and holds no case"}
    try:
        return coverage_from_basis(_legacy_basis(rep), records=cases)
    except Exception as exc:  # noqa: BLE001 - a malformed old report: its fields are named by the schema check
        return {
            "absent": f"the report predates coverage, and its cases could not be read ({type(exc).__name__}: {exc})"
        }


def _legacy_basis(rep: dict) -> dict:
    """The basis of a report (or journal) written before coverage existed, read from what it
    holds, no kernel loaded: the domain it recorded (``rep["domain"]``: the kernel's own, else
    the one its suite was built in; else unrestricted), the architecture of a built-in model by
    name, production's from the compute capability in its environment (the GPU it ran on).
    ``"legacy"`` says how, for the coverage's notes."""
    info = rep.get("domain") if isinstance(rep.get("domain"), dict) else {}
    kern = rep.get("kernel")
    d = ((info.get("kernels") or {}).get(kern) or {}).get("domain") or info.get("domain")
    how = ["computed when read: the report predates coverage"]
    try:
        domain = Domain.from_dict(d, where="the report's domain") if isinstance(d, dict) else Domain()
    except DomainError:
        domain = Domain()
        d = None
    how.append("domain as the report recorded it" if isinstance(d, dict) else "no domain recorded: unrestricted")
    arch = None
    if kern == "fa4":  # audits.common records "sm_{major}{minor}"
        cc = re.fullmatch(r"sm_(\d+)\d", str((rep.get("environment") or {}).get("compute_capability", "")))
        arch = arch_of_capability(int(cc.group(1))) if cc else None
    elif kern in KERNELS:
        arch = getattr(KERNELS[kern], "fa4_audit_arch", None)
    return {"domain": domain, "arch": arch if isinstance(arch, str) else None, "legacy": "; ".join(how)}
