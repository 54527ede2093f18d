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

__all__ = ["Opt", "Each", "When", "check", "REPORT", "CASE"]

NUM = (int, float)


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
#: one case record (the Case fields of ``config`` are checked by ``audits.cases.case_from_dict``)
CASE = [
    {
        "case": str,
        "config": dict,
        "verdict": str,
        "reasons": Each(str),
        "status": str,
        # a varlen case's (audits.runner.engine, docs/varlen.md)
        "varlen": Opt({"sequences": int, "total_q": int, "total_k": int, "per_sequence": bool, "entry": Opt(str)}),
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
#: the report's top level and summary (its cases: :data:`CASE`, each)
REPORT = {
    "schema": str, "kernel": str, "suite": str, "seed": int, "device": str, "environment": dict, "command": str,
    "created": str, "thresholds": dict, "cases": list,
    "summary": {
        "cases": int,
        "verdicts": {v: int for v in ("pass", "warn", "fail", "error", "crash", "skipped", "out-of-domain")},
        "worst": Each(Opt({"value": NUM, "case": str})),
    },
}  # fmt: skip
