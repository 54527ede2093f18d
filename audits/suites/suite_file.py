"""Suite files: ``fa4-audit run --suite FILE.toml`` (format in docs/runner.md, "Suite files";
example: examples/suite.toml).

A suite file names its suite (``name``, default the file's stem) and gives its cases as explicit
``[[case]]`` tables (``Case`` fields, absent = defaults, checked by ``audits.suites.case.case_from_dict``)
and/or an ``[axes]`` table of values per axis of the release generator (absent axis: the Case
default), plus ``families`` (default all) and ``seeds`` (default [0]).  The axes' cases are
release's: the pairwise covering array of the values (``audits.suites.axes.pairwise``), each row made
a case per family and seed by ``audits.suites.axes.case_within`` (``audits.suites.axes.release_case``),
within the kernels' declared domain.  :func:`load` checks every key and value (``ValueError``
naming the file, the key, the value and what is accepted); :func:`build` makes the cases.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from audits.common import read_toml
from audits.suites.axes import axes_within, case_within, pairs_covered, pairwise
from audits.suites.case import DTYPES, LAYOUTS, Case, case_from_dict
from audits.suites.cases import SUITES
from audits.suites.domain import Domain, seqlens_within
from audits.suites.inputs import FAMILIES

__all__ = ["SuiteFile", "load", "build", "is_suite_file", "AXES"]

_C = Case()
#: the axes a file may give, each absent one at the Case default
DEFAULT_AXES = {
    "dtype": (_C.dtype,),
    "head_dims": ((_C.d, _C.dv),),
    "mask": ("none",),
    "softcap": (_C.softcap,),
    "sink": (_C.sink,),
    "heads": ((_C.heads_q, _C.heads_kv),),
    "seqlens": ((_C.seqlen_q, _C.seqlen_k),),
    "layout": (_C.layout,),
}
AXES = tuple(DEFAULT_AXES)
#: a file's axis name -> the generator's row key (``audits.suites.axes.axes_within``)
_ROW_KEY = {"head_dims": "d"}
#: the Domain fields that judge each axis (the others left unrestricted when probing one value)
_JUDGED_BY = {
    "dtype": ("dtypes",), "head_dims": ("head_dims",), "mask": ("causal", "local"), "softcap": ("softcap",),
    "sink": ("sink",), "heads": ("gqa",), "layout": ("layouts",),
    "seqlens": ("seqlen_q_multiple", "seqlen_k_multiple", "equal_seqlens", "min_seqlen", "max_seqlen"),
}  # fmt: skip
_TOP_KEYS = ("name", "case", "axes")
_AXES_KEYS = (*AXES, "families", "seeds")


@dataclass(frozen=True)
class SuiteFile:
    """A checked suite file: its name, explicit cases, axes (None: no ``[axes]``; axis -> values,
    pairs as tuples), families and seeds."""

    path: Path
    name: str
    cases: tuple[Case, ...]
    axes: dict | None
    families: tuple[str, ...]
    seeds: tuple[int, ...]


def is_suite_file(suite: str) -> bool:
    """Whether ``--suite`` names a file (``.toml``, or an existing file) rather than a named suite."""
    return suite not in SUITES and (suite.endswith(".toml") or Path(suite).is_file())


def _pair(v) -> tuple[int, int] | None:
    ok = isinstance(v, list) and len(v) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
    return tuple(v) if ok and v[0] >= 1 and v[1] >= 1 else None


def _check_value(key: str, v):
    """One value of ``[axes]`` key ``key``, normalised; None when not accepted."""
    if key in ("head_dims", "seqlens"):
        return _pair(v)
    if key == "heads":
        p = _pair(v)
        return p if p and p[0] % p[1] == 0 else None
    if key == "mask":
        if v in ("none", "causal", "local"):
            return v
        ok = isinstance(v, list) and len(v) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
        return tuple(v) if ok and min(v) >= 0 else None
    if key == "softcap":
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 else None
    if key == "sink":
        return v if isinstance(v, bool) else None
    if key == "seeds":
        return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None
    accepted = {"dtype": DTYPES, "layout": LAYOUTS, "families": tuple(FAMILIES)}[key]
    return v if v in accepted else None


def _accepted(key: str) -> str:
    return {
        "dtype": ", ".join(DTYPES),
        "layout": ", ".join(LAYOUTS),
        "families": ", ".join(FAMILIES),
        "head_dims": "[d, dv] pairs of positive integers",
        "seqlens": "[seqlen_q, seqlen_k] pairs of positive integers",
        "heads": "[heads_q, heads_kv] pairs of positive integers, heads_q a multiple of heads_kv",
        "mask": '"none", "causal", "local" (window [128, 32]) or a window [left, right] of integers >= 0',
        "softcap": "numbers >= 0 (0: off)",
        "sink": "true, false",
        "seeds": "integers >= 0",
    }[key]


def _axes(table, where: str) -> tuple[dict, tuple[str, ...], tuple[int, ...]]:
    """The ``[axes]`` table checked: (axes, families, seeds)."""
    if not isinstance(table, dict):
        raise ValueError(f"{where}: axes = {table!r}: expected an [axes] table")
    unknown = sorted(set(table) - set(_AXES_KEYS))
    if unknown:
        raise ValueError(f"{where}: [axes] unknown key(s) {', '.join(unknown)}; accepted: {', '.join(_AXES_KEYS)}")
    got = {}
    for key, values in table.items():
        if not isinstance(values, list) or not values:
            raise ValueError(f"{where}: [axes] {key} = {values!r}: expected a non-empty list of {_accepted(key)}")
        checked = [_check_value(key, v) for v in values]
        bad = next((v for v, c in zip(values, checked) if c is None), None)
        if any(c is None for c in checked):
            raise ValueError(f"{where}: [axes] {key} value {bad!r} is not accepted; accepted: {_accepted(key)}")
        got[key] = tuple(dict.fromkeys(checked))
    families = got.pop("families", tuple(FAMILIES))
    seeds = got.pop("seeds", (0,))
    return {k: got.get(k, DEFAULT_AXES[k]) for k in AXES}, families, seeds


def load(path: str | Path) -> SuiteFile:
    """The suite file at ``path``, every key and value checked (``ValueError`` naming the file,
    the key, the value and what is accepted)."""
    p = Path(path)
    where = f"suite file {p}"
    doc = read_toml(p, what="suite", error=ValueError)
    unknown = sorted(set(doc) - set(_TOP_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)}; accepted: name, [[case]], [axes]")
    name = doc.get("name", p.stem)
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"{where}: name = {name!r}: expected a non-empty string (default: the file's stem)")
    raw = doc.get("case", [])
    if not isinstance(raw, list):
        raise ValueError(f"{where}: case = {raw!r}: expected [[case]] tables of Case fields")
    cases = tuple(case_from_dict(c, where=f"{where}, [[case]] #{i + 1}") for i, c in enumerate(raw))
    axes, families, seeds = (None, (), ()) if "axes" not in doc else _axes(doc["axes"], where)
    if not cases and axes is None:
        raise ValueError(f"{where}: no [[case]] tables and no [axes] table: it defines no case")
    return SuiteFile(p, name, cases, axes, families, seeds)


def _within(d: Domain, key: str, values: tuple) -> tuple[list, dict]:
    """The values of axis ``key`` that the domain admits, and why each other one is not."""
    judge = Domain(**{f: getattr(d, f) for f in _JUDGED_BY[key]})  # only this axis's restriction
    neutral = {_ROW_KEY.get(k, k): v[0] for k, v in DEFAULT_AXES.items()}
    kept, refused = [], {}
    for v in values:
        case, why = case_within(judge, {**neutral, _ROW_KEY.get(key, key): v}, "normal", 0)
        if case is None:
            refused[v] = why
        else:
            kept.append(v)
    return kept, refused


def _domain_values(d: Domain, key: str, values: tuple) -> list:
    """For an axis none of whose values the domain admits: the domain's own (``axes_within``);
    lengths made from its block no longer than the file's longest (or one block), if any."""
    if key == "seqlens":
        longest = max(max(p) for p in values)
        hi = min(d.max_seqlen or longest, max(longest, d.seqlen_multiple))
        made = seqlens_within(dataclasses.replace(d, max_seqlen=hi), [])
        if made:
            return made
    return axes_within(d)[_ROW_KEY.get(key, key)]


def build(sf: SuiteFile, d: Domain | None = None, *, cases_in: Domain | None = None) -> dict:
    """The suite file's cases: its ``[[case]]`` s that ``cases_in`` (default ``d``) admits, then
    release's generator over its axes within the domain ``d`` (None: unrestricted) — each axis
    restricted to the values ``d`` admits (one with none takes the domain's own, as release
    builds them: ``audits.suites.axes.axes_within``), the pairwise covering array of them, a case per
    row, family and seed that fits.  Returns ``{"cases", "axes", "pairs_covered", "not_applicable": {family:
    reason}, "skipped": [{"case", "reason"}], "restricted": {axis: what was dropped, why}}``."""
    d = d or Domain()
    refused = {c: (cases_in or d).refusal(c) for c in sf.cases}
    skipped = [{"case": c.name, "reason": why} for c, why in refused.items() if why]
    cases = [c for c, why in refused.items() if not why]
    built = {"axes": None, "pairs_covered": None, "not_applicable": {}, "skipped": skipped, "restricted": {}}
    if sf.axes is not None:
        axes = {}
        for key, values in sf.axes.items():
            kept, out = _within(d, key, values)
            why = "; ".join(f"{json.dumps(v)}: {w}" for v, w in out.items())
            if not kept:
                kept = _domain_values(d, key, values)
                built["restricted"][key] = f"no value in the kernels' domain ({why}); took {json.dumps(kept)}"
            elif out:
                built["restricted"][key] = f"dropped, outside the kernels' domain: {why}"
            axes[_ROW_KEY.get(key, key)] = kept
        rows = pairwise(axes)
        for f in sf.families:
            placed = [case_within(d, r, f, s) for s in sf.seeds for r in rows]
            ok = [c for c, _ in placed if c is not None]
            if not ok:
                built["not_applicable"][f] = f"no case of family {f} fits the domain; e.g. {placed[0][1]}"
            cases += ok
        built["axes"] = {("head_dims" if k == "d" else k): v for k, v in axes.items()}
        built["pairs_covered"] = pairs_covered(axes)
    return {"cases": list(dict.fromkeys(cases)), **built}
