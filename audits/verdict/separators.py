"""Separators across cases: which case fields tell a run's failing cases from its passing ones
(issue 25; docs/diagnosis.md, "Separators across cases"), and the text every view prints of a
report's diagnosis (report.md, report.html, ``fa4-audit show``, ``fa4-audit summary``).

A kernel author reading "20 of 21 cases fail" wants the pattern: "every failing case is causal
with seqlen_k % 128 != 0; no passing case is" points at the last partial key tile of the causal
path.  :func:`separators` finds it from the case configurations alone (the report's
``diagnosis``); it needs no tensor, so it is recomputed whenever a report's cases change (a
merge of shards, a re-judged report, an old report read back).

Cases counted: failing (a verdict in ``FAILING``) and passing (``pass``, ``warn``).  ``skipped``
and ``out-of-domain`` cases were not compared with the reference, so they are neither.

Predicates over a case's configuration, in order of simplicity (:data:`KINDS`):

0. booleans and their negations: ``causal``, ``local`` (a window, not causal), ``softcap > 0``,
   ``sink``, ``heads_q != heads_kv`` (GQA), ``d != dv``, ``seqlen_q < / == / > seqlen_k``,
   ``varlen``, ``page_size > 0``, ``num_splits > 1``, ``seqused_k``;
1. equality: ``field == v`` for a value failing cases hold, ``field != v`` for a value passing
   cases hold (a field of three values or more: with two, ``!=`` is the other ``==``);
2. residues of d, dv, seqlen_q, seqlen_k modulo 128, 64, 32, 16, 8 (``== 0`` and ``!= 0``),
   the largest modulus first: where two moduli split the cases alike, the larger is the tile or
   padding granularity a bug is likelier to follow;
3. thresholds ``x >= v`` and ``x <= v`` of a numeric field at a value failing cases hold;
4. code-path classes ``class NAME`` / ``not class NAME`` (``fa4.code_paths.classes_of`` on
   the report's architecture, the forward's for every case and the backward's for a case whose
   backward ran; none without an architecture, and none for a varlen case run per sequence,
   which ran no varlen code path, as ``audits.verdict.coverage`` counts them);
5. membership ``field in {v1, v2, ...}`` of the failing cases' values, at most :data:`SET_MAX`
   of them (a longer list is a listing, not a rule).

Predicates true on the same counted cases are one: the simplest is kept.  A rule is *exact* when
every failing case and no passing case satisfies it.  The result is the simplest exact single
predicate (all exact ones hold the same cases, so they are one); else the exact conjunctions of
two (``causal and seqlen_k % 128 != 0``; ranked by the less simple kind, then the sum of kinds);
else the best by **Youden's J** = (share of the failing cases that satisfy the rule) - (share of
the passing cases that do): single predicates, and conjunctions that beat both their parts by
:data:`MIN_GAIN`; J > 0 only, ties to the simpler.  At most :data:`MAX_RULES` rules, one per set
of fields (three thresholds on d say one thing) and per set of cases satisfied.  The search is
over vectors of the counted cases (numpy), and conjunctions only over the predicates true on
every failing case (exact) or the :data:`POOL` likeliest (by score): a nightly report's 8,662
cases take 0.2 to 0.6 s on a loaded 2-core machine (docs/diagnosis.md).

Contract breaches (a returned out, LSE or gradient of another shape or dtype than the contract's,
``audits.report.records.ContractRecord``) are grouped by tensor and fault, not by the case's sizes:
:func:`fault_groups` (the diagnosis's ``faults``) and :func:`reasons_by_fault` (the key views
group failing cases by, ``audits.report.build.collapse_reasons``).
"""

from __future__ import annotations

import re
from typing import TypedDict

import numpy as np

from audits.report.records import FAILING, CaseRecord
from audits.suites.cases import case_from_dict
from audits.verdict.coverage import classes_ran
from audits.verdict.findings import count_of
from audits.verdict.vocabulary import CAUSES

__all__ = [
    "PASSING",
    "KINDS",
    "MAX_RULES",
    "SET_MAX",
    "POOL",
    "EXACT_POOL",
    "MIN_GAIN",
    "FEW_FAILING",
    "TENSORS",
    "separators",
    "separator_text",
    "where_lines",
    "cause_lines",
    "contract_breaches_of",
    "fault_groups",
    "CauseGroup",
    "CauseTally",
    "cause_groups",
    "cause_text",
    "likely_cause",
    "reasons_by_fault",
]

#: the verdicts counted as passing (the failing ones: ``FAILING``); skipped and out-of-domain
#: cases were not compared with the reference and are counted as neither
PASSING = ("pass", "warn")
#: the kinds of predicate, simplest first (the module docstring says what each holds)
KINDS = ("boolean", "equality", "residue", "threshold", "class", "membership")
#: rules listed: a reader takes in three alternatives at a glance; more are variations
MAX_RULES = 3
#: the most values a membership rule lists: more is a listing of cases, not a pattern
SET_MAX = 6
#: predicates (the likeliest by score) whose pairs the non-exact search scores: 64 x 64 pairs
#: over 8,662 cases is two small matrix products
POOL = 64
#: exact conjunctions are searched among at most this many predicates true on every failing
#: case, the simplest (a handful of failing cases makes hundreds of them; 256^2 pairs over
#: 8,662 cases is one matrix product of about 0.6 Gflop, a tenth of a second)
EXACT_POOL = 256
#: a conjunction is listed by score only when its J beats each of its parts' by this much: a
#: second predicate is a second claim, and a gain under 0.05 (five points of the failing or the
#: passing share) is a handful of cases that the first predicate's noise already spans
MIN_GAIN = 0.05
#: below this many failing cases a value they alone hold separates them: the result says so
FEW_FAILING = 3
#: the order the tensors of a case's diagnosis are printed in
TENSORS = ("out", "lse", "dq", "dk", "dv", "dsink")

#: fields compared by value (equality, membership)
_VALUE_FIELDS = (
    "dtype", "d", "dv", "batch", "heads_q", "heads_kv", "seqlen_q", "seqlen_k", "window", "softcap", "layout",
    "family", "page_size", "num_splits", "pack_gqa",
)  # fmt: skip
#: fields of numbers (thresholds)
_NUMERIC = ("d", "dv", "batch", "heads_q", "heads_kv", "seqlen_q", "seqlen_k", "softcap", "page_size", "num_splits")
#: fields whose residues are taken (head dims and lengths: tile and padding granularity)
_RESIDUE_FIELDS = ("d", "dv", "seqlen_q", "seqlen_k")
_MODULI = (128, 64, 32, 16, 8)


#: (field, rule when true, rule when false, its value over the columns of the counted cases:
#: field -> a float array for numbers and flags, a list for the rest)
_BOOLEANS = (
    ("causal", "causal", "not causal", lambda c: c["causal"] > 0),
    ("window", "local", "not local",
     lambda c: (c["causal"] == 0) & np.array([any(w is not None for w in x) for x in c["window"]], dtype=bool)),
    ("softcap", "softcap > 0", "softcap == 0", lambda c: c["softcap"] > 0),
    ("sink", "sink", "not sink", lambda c: c["sink"] > 0),
    ("heads_q, heads_kv", "heads_q != heads_kv", "heads_q == heads_kv", lambda c: c["heads_q"] != c["heads_kv"]),
    ("d, dv", "d != dv", "d == dv", lambda c: c["d"] != c["dv"]),
    ("seqlen_q, seqlen_k", "seqlen_q < seqlen_k", "seqlen_q >= seqlen_k", lambda c: c["seqlen_q"] < c["seqlen_k"]),
    ("seqlen_q, seqlen_k", "seqlen_q == seqlen_k", "seqlen_q != seqlen_k", lambda c: c["seqlen_q"] == c["seqlen_k"]),
    ("seqlen_q, seqlen_k", "seqlen_q > seqlen_k", "seqlen_q <= seqlen_k", lambda c: c["seqlen_q"] > c["seqlen_k"]),
    ("seqlens", "varlen", "not varlen", lambda c: np.array([bool(x) for x in c["seqlens"]], dtype=bool)),
    ("page_size", "page_size > 0", "page_size == 0", lambda c: c["page_size"] > 0),
    ("num_splits", "num_splits > 1", "num_splits == 1", lambda c: c["num_splits"] > 1),
    ("seqused_k", "seqused_k", "no seqused_k", lambda c: np.array([bool(x) for x in c["seqused_k"]], dtype=bool)),
)  # fmt: skip
#: Case fields a report written before them lacks, with the value they then had
_DEFAULTS = {"seqlens": (), "seqused_k": (), "page_size": 0, "num_splits": 1, "pack_gqa": None}


def _fmt(v) -> str:
    """A value as a rule shows it: numbers plainly (15.0 as 15), tuples with None, strings bare."""
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, tuple):
        return "(" + ", ".join(_fmt(x) for x in v) + ")"
    return str(v)


def _order(v) -> tuple:
    """A sort key over a field's values (numbers by value, before anything else by its text)."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return (0, v, "")
    return (1, 0, _fmt(v))


def _frozen(v):
    """A JSON value hashable (lists as tuples, nested: varlen's per-sequence lengths)."""
    return tuple(_frozen(x) for x in v) if isinstance(v, (list, tuple)) else v


def _column(cfgs: list[dict], field: str) -> list:
    """``field`` of every config, hashable (lists as tuples), a field younger than the report at
    its default (:data:`_DEFAULTS`); a window of None as (None, None)."""
    default = (None, None) if field == "window" else _DEFAULTS.get(field)
    vals = [c.get(field, default) for c in cfgs]
    if field == "window":
        return [default if v is None else tuple(v) for v in vals]
    return [_frozen(v) for v in vals] if field in ("seqlens", "seqused_k") else vals


class _Pool:
    """Predicates as rows of a boolean matrix over the counted cases, with their rule, field,
    kind and a simplicity key; rows true on the same cases kept once (the first, simplest)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.rows: list[np.ndarray] = []
        self.meta: list[tuple[tuple, str, str]] = []  # (simplicity key, field, rule)

    def add(self, kind: str, field: str, rule: str, row: np.ndarray, extra: int = 0) -> None:
        if row.all() or not row.any():  # true or false on every counted case: tells nothing apart
            return
        self.rows.append(row)
        self.meta.append(((KINDS.index(kind), extra, len(self.meta)), field, rule))

    def distinct(self) -> tuple[np.ndarray, list[tuple[tuple, str, str]]]:
        """The matrix and its rows' descriptions, simplest first, one row per truth vector."""
        order = sorted(range(len(self.rows)), key=lambda i: self.meta[i][0])
        seen: set[bytes] = set()
        keep = []
        for i in order:
            key = np.packbits(self.rows[i]).tobytes()
            if key not in seen:
                seen.add(key)
                keep.append(i)
        if not keep:
            return np.zeros((0, self.n), dtype=bool), []
        return np.stack([self.rows[i] for i in keep]), [self.meta[i] for i in keep]


#: the config fields that select production's code path (``Case.call``): cases alike in them
#: fall in the same classes, so classes are computed once per distinct tuple of them
_CALL_FIELDS = (
    "dtype", "d", "dv", "causal", "window", "softcap", "sink", "seqlen_q", "seqlen_k", "heads_q", "heads_kv",
    "seqlens", "page_size", "num_splits", "pack_gqa",
)  # fmt: skip


def _classes(records: list[CaseRecord], cols: dict[str, list], arch: str) -> tuple[list[frozenset[str]], np.ndarray]:
    """The distinct sets of code-path classes the records' cases fall in on ``arch`` (forward;
    backward when it ran; none for a varlen case run per sequence: it ran no varlen code path),
    and each record's index into them."""
    # by the call's fields first: many records share a call, and a Case is built once per distinct one
    names: dict[tuple, tuple[str, ...]] = {}
    calls: dict[tuple, tuple[str, ...]] = {}  # classes_ran's own cache, by call
    sets: dict[frozenset[str], int] = {}
    out = []
    keys = list(zip(*(cols[f] for f in _CALL_FIELDS), strict=True))
    for rec, key in zip(records, keys, strict=True):
        bwd = rec.get("backward") if isinstance(rec.get("backward"), dict) else {}
        per_seq = (rec.get("varlen") or {}).get("entry") == "per-sequence"
        got: set[str] = set()
        for direction in ("forward", "backward") if bwd.get("status") == "ran" else ("forward",):
            k = (key, direction, bool(bwd.get("deterministic")), per_seq)
            if k not in names:
                case = case_from_dict(rec["config"], where=f"case {rec.get('case')}")
                names[k] = classes_ran(rec=rec, case=case, arch=arch, direction=direction, cache=calls)
            got.update(names[k])
        out.append(sets.setdefault(frozenset(got), len(sets)))
    return list(sets), np.array(out, dtype=np.int64)


def _predicates(records: list[CaseRecord], failing: np.ndarray, arch: str | None) -> _Pool:
    """Every predicate of the module docstring over ``records`` (the counted cases)."""
    cfgs = [r["config"] for r in records]
    pool = _Pool(len(records))
    cols = {f: _column(cfgs, f) for f in dict.fromkeys((*_VALUE_FIELDS, *_CALL_FIELDS, "seqused_k"))}
    # numbers and flags as arrays; the rest (window, varlen's lengths: tuples) as the lists they are
    arrays = {f: np.array(v, dtype=float) if f in (*_NUMERIC, "causal", "sink") else v for f, v in cols.items()}
    for field, yes, no, get in _BOOLEANS:
        row = np.asarray(get(arrays), dtype=bool)
        pool.add("boolean", field, yes, row)
        pool.add("boolean", field, no, ~row)
    for field in _VALUE_FIELDS:
        vals = cols[field]
        if field in _NUMERIC:  # numbers: numpy's sort and codes
            uniq, codes = np.unique(arrays[field], return_inverse=True)
            distinct = [int(v) if v == int(v) and field != "softcap" else float(v) for v in uniq.tolist()]
        else:
            distinct = sorted(set(vals), key=_order)
            index = {v: j for j, v in enumerate(distinct)}
            codes = np.array([index[v] for v in vals], dtype=np.int64)
        if len(distinct) < 2:
            continue
        onehot = codes[None, :] == np.arange(len(distinct))[:, None]
        in_failing = onehot[:, failing].any(axis=1)
        in_passing = onehot[:, ~failing].any(axis=1)
        for j, v in enumerate(distinct):
            if in_failing[j]:
                pool.add("equality", field, f"{field} == {_fmt(v)}", onehot[j])
            if in_passing[j] and len(distinct) > 2:
                pool.add("equality", field, f"{field} != {_fmt(v)}", ~onehot[j])
        fail_vals = [v for j, v in enumerate(distinct) if in_failing[j]]
        if 2 <= len(fail_vals) <= SET_MAX and len(fail_vals) < len(distinct):
            row = onehot[in_failing].any(axis=0)
            text = "{" + ", ".join(_fmt(v) for v in fail_vals) + "}"
            pool.add("membership", field, f"{field} in {text}", row, extra=len(fail_vals))
        if field in _NUMERIC and len(distinct) > 2:
            x = arrays[field]
            for v in fail_vals:
                pool.add("threshold", field, f"{field} >= {_fmt(v)}", x >= float(v))
                pool.add("threshold", field, f"{field} <= {_fmt(v)}", x <= float(v))
        if field in _RESIDUE_FIELDS:
            x = np.array(distinct, dtype=np.int64)[codes]
            for m in _MODULI:
                zero = x % m == 0
                pool.add("residue", field, f"{field} % {m} == 0", zero)
                pool.add("residue", field, f"{field} % {m} != 0", ~zero)
    if arch is not None:
        sets, which = _classes(records, cols, arch)
        for name in sorted(set().union(*sets)):
            row = np.array([name in s for s in sets], dtype=bool)[which]
            pool.add("class", "class", f"class {name}", row)
            pool.add("class", "class", f"not class {name}", ~row)
    return pool


def _entry(field: str, rule: str, nf: int, np_: int, of_f: int, of_p: int) -> dict:
    return {
        "field": field,
        "rule": rule,
        "failing": nf,
        "passing": np_,
        "exact": nf == of_f and np_ == 0,
        "score": round(nf / of_f - np_ / of_p, 6),
    }


def _pick(candidates: list[tuple], limit: int) -> list[tuple]:
    """The first ``limit`` candidates (already ranked) whose sets of fields differ."""
    seen: set[str] = set()
    out = []
    for c in candidates:
        if c[0] not in seen:
            seen.add(c[0])
            out.append(c)
            if len(out) == limit:
                break
    return out


def _fields(*fields: str) -> str:
    return ", ".join(dict.fromkeys(f.strip() for x in fields for f in x.split(",")))


def separators(cases: list[CaseRecord], *, arch: str | None) -> dict:
    """The value of ``report["diagnosis"]``: ``{"separators": [...], "failing": n, "passing":
    m}`` (and ``"note"`` when there is nothing to separate or little to go on).  Each separator
    ``{"field", "rule", "failing", "passing", "exact", "score"}`` (the module docstring says how
    they are found and ranked; ``score`` is Youden's J).  ``cases``: a report's case records
    (``config`` and ``verdict`` each); ``arch``: the kernel's architecture ("sm90", "sm100") for
    code-path classes, None for none.  Deterministic: the same cases give the same result."""
    records = [r for r in cases if r.get("verdict") in FAILING or r.get("verdict") in PASSING]
    failing = np.array([r["verdict"] in FAILING for r in records], dtype=bool)
    nf, np_ = int(failing.sum()), int((~failing).sum())
    out: dict = {"separators": [], "failing": nf, "passing": np_}
    if faults := fault_groups(records):
        out["faults"] = faults
    if causes := cause_groups(records):
        out["causes"] = causes
    if not nf or not np_:
        out["note"] = (
            "no failing case and no passing one: nothing to separate"
            if not nf and not np_
            else f"every counted case {'fails' if nf else 'passes'}: nothing to separate"
        )
        return out
    mat, meta = _predicates(records, failing, arch).distinct()
    F, P = mat[:, failing], mat[:, ~failing]
    tf, tp = F.sum(axis=1), P.sum(axis=1)
    J = tf / nf - tp / np_
    if nf < FEW_FAILING:
        out["note"] = (
            f"only {nf} failing case{'s' if nf > 1 else ''}: any value they alone hold separates them; "
            "a clue to check, not a pattern"
        )
    exact = [i for i in range(len(meta)) if tf[i] == nf and tp[i] == 0]
    if exact:
        picked = _pick([(meta[i][1], meta[i][2], i) for i in exact], MAX_RULES)
        out["separators"] = [_entry(f, r, nf, 0, nf, np_) for f, r, _ in picked]
        return out
    full = [i for i in range(len(meta)) if tf[i] == nf][:EXACT_POOL]  # already simplest first
    if len(full) >= 2:
        Pa = P[full].astype(np.float32)
        both = Pa @ Pa.T  # passing cases satisfying both
        a, b = np.nonzero(np.triu(both == 0, k=1))
        if len(a):
            key = lambda t: (
                max(meta[full[t[0]]][0][0], meta[full[t[1]]][0][0]),
                meta[full[t[0]]][0][0] + meta[full[t[1]]][0][0],
                t[0],
                t[1],
            )
            pairs = sorted(zip(a.tolist(), b.tolist()), key=key)
            cands = [
                (_fields(meta[full[i]][1], meta[full[j]][1]), f"{meta[full[i]][2]} and {meta[full[j]][2]}")
                for i, j in pairs
            ]
            out["separators"] = [_entry(f, r, nf, 0, nf, np_) for f, r in _pick(cands, MAX_RULES)]
            return out
    out["separators"] = _best(meta, F, P, J, nf, np_)
    if not out["separators"]:
        out["note"] = "no case field separates failing from passing cases better than chance (Youden's J <= 0)"
    return out


def _best(meta: list, F: np.ndarray, P: np.ndarray, J: np.ndarray, nf: int, np_: int) -> list[dict]:
    """The best rules by Youden's J when none is exact: single predicates and conjunctions of two
    of the :data:`POOL` likeliest (by J, then by the failing cases they hold) that beat both parts."""
    tf, tp = F.sum(axis=1), P.sum(axis=1)
    rank = lambda i: (-round(float(J[i]), 9), meta[i][0])
    by_j = sorted(range(len(meta)), key=rank)[: POOL // 2]
    by_cover = sorted(range(len(meta)), key=lambda i: (-int(tf[i]), int(tp[i]), meta[i][0]))[: POOL // 2]
    pool = sorted(set(by_j) | set(by_cover), key=rank)
    cands = [(-round(float(J[i]), 9), 1, meta[i][0][0], 0, i, -1) for i in range(len(meta)) if J[i] > 0]
    if len(pool) >= 2:
        Fp, Pp = F[pool].astype(np.float32), P[pool].astype(np.float32)
        J2 = (Fp @ Fp.T).astype(np.float64) / nf - (Pp @ Pp.T).astype(np.float64) / np_  # counts: exact in float32
        parts = np.maximum.outer(J[pool], J[pool])
        a, b = np.nonzero(np.triu(J2 > parts + MIN_GAIN, k=1))
        for x, y in zip(a.tolist(), b.tolist()):
            i, j = pool[x], pool[y]
            if J2[x, y] > 0:
                kinds = (meta[i][0][0], meta[j][0][0])
                cands.append((-round(float(J2[x, y]), 9), 2, max(kinds), sum(kinds), min(i, j), max(i, j)))
    cands.sort()
    out: list[dict] = []
    fields_seen: set[str] = set()
    vectors_seen: set[bytes] = set()
    for *_, i, j in cands:  # the first of each set of fields, and of each truth vector (a pair
        # equivalent to a single predicate, or to a pair listed, says nothing new)
        f_row, p_row = (F[i], P[i]) if j < 0 else (F[i] & F[j], P[i] & P[j])
        vec = np.packbits(np.concatenate([f_row, p_row])).tobytes()
        field = meta[i][1] if j < 0 else _fields(meta[i][1], meta[j][1])
        new = field not in fields_seen and vec not in vectors_seen
        fields_seen.add(field)
        vectors_seen.add(vec)
        if new:
            rule = meta[i][2] if j < 0 else f"{meta[i][2]} and {meta[j][2]}"
            out.append(_entry(field, rule, int(f_row.sum()), int(p_row.sum()), nf, np_))
            if len(out) == MAX_RULES:
                break
    return out


# ---- text: the same words in every view ------------------------------------------------------


def separator_text(diag: dict | None) -> tuple[str, list[tuple[str, str]]]:
    """A report's separators as a headline and per rule (rule, detail) (detail "" for an exact
    rule; else its counts and score), for every view to format alike (report.md, report.html,
    ``show``, ``summary``); ("", []) for a report without a diagnosis."""
    if not isinstance(diag, dict):
        return "", []
    nf, np_ = diag.get("failing", 0), diag.get("passing", 0)
    seps = diag.get("separators") or []
    counted = f"{nf} failing, {np_} passing cases (skipped and out-of-domain not counted)"
    note = [diag["note"][0].upper() + diag["note"][1:]] if diag.get("note") else []
    if diag.get("faults"):  # the contract's breaches, one per tensor and fault (fault_groups)
        each = [f"{g['tensor']}: {g['fault']} ({count_of(g['cases'], ('case', 'cases'))})" for g in diag["faults"]]
        note.append("Contract breaches by fault: " + "; ".join(each))
    if text := cause_text(diag.get("causes")):
        note.append(text)
    if not seps:
        return ". ".join([counted, *note]), []
    if all(s["exact"] for s in seps):
        how = "Every failing case and no passing one satisfies" + (" each of" if len(seps) > 1 else "")
        return ". ".join([counted, *note, how]), [(s["rule"], "") for s in seps]
    how = (
        "No exact rule of one or two predicates; the best by Youden's J (share of failing cases "
        "satisfying it - share of passing)"
    )
    rules = [
        (s["rule"], f"{s['failing']} of {nf} failing, {s['passing']} of {np_} passing (J {s['score']:.2f})")
        for s in seps
    ]
    return ". ".join([counted, *note, how]), rules


# ---- contract breaches: one fault per tensor -------------------------------------------------


def contract_breaches_of(rec: CaseRecord) -> list[dict]:
    """The case's contract breaches (``audits.report.records.ContractRecord``): its out's and
    LSE's (``contract``), then its gradients' (``backward.contract``); a report written before
    they were typed (a gradient's breach as a string) has none."""
    bwd = rec.get("backward") if isinstance(rec.get("backward"), dict) else {}
    return [c for c in [*(rec.get("contract") or []), *(bwd.get("contract") or [])] if isinstance(c, dict)]


def reasons_by_fault(rec: CaseRecord) -> tuple[str, ...]:
    """The case's ``reasons`` with each contract breach's reason (its sizes) replaced by its tensor
    and fault ("out: seqlen_q and heads_q swapped"): equal for every case a kernel breaks alike,
    whatever their sizes, so that views grouping cases by reasons (``audits.report.build.collapse_reasons``)
    show one group per fault."""
    breaches = contract_breaches_of(rec)
    out = []
    for text in rec.get("reasons") or []:
        for c in breaches:
            text = text.replace(c["reason"], f"{c['tensor']}: {c['fault']}")
        out.append(text)
    return tuple(out)


def fault_groups(records: list[CaseRecord]) -> list[dict]:
    """The failing cases' contract breaches grouped by fault: ``[{"tensor", "fault", "cases",
    "first"}]`` (``cases``: how many failing cases break it; ``first``: the first's name), tensors
    in the order of :data:`TENSORS`, then by first appearance; empty when no case breaks the contract."""
    groups: dict[tuple[str, str], dict] = {}
    for rec in records:
        if rec.get("verdict") not in FAILING:
            continue
        for c in contract_breaches_of(rec):
            g = groups.setdefault((c["tensor"], c["fault"]), {**{k: c[k] for k in ("tensor", "fault")}, "cases": 0})
            g["cases"] += 1
            g.setdefault("first", rec.get("case", ""))
    order = {t: i for i, t in enumerate(TENSORS)}
    return sorted(groups.values(), key=lambda g: order.get(g["tensor"], len(TENSORS)))


class CauseGroup(TypedDict):
    """One cause over a report's cases (:func:`cause_groups`): ``cases`` name it, ``best`` name
    it first, ``first`` is the first such case; ``detail`` is the detail most of them give, and
    ``detail_cases`` how many do."""

    cause: str
    cases: int
    best: int
    first: str
    detail: str
    detail_cases: int


class CauseTally(TypedDict):
    """A report's ``diagnosis["causes"]`` (:func:`cause_groups`)."""

    failing: int
    warning: int
    unexplained: int
    untested: int
    groups: list[CauseGroup]


def cause_groups(records: list[CaseRecord]) -> CauseTally | None:
    """The tested causes over the failing and warning cases (``diagnosis["causes"]`` of each,
    best first, ``audits.verdict.causes``): ``{"failing": n, "warning": m, "unexplained": k,
    "groups": [{"cause", "cases", "best", "first", "detail", "detail_cases"}]}``.  Per cause:
    on how many cases it is named (``cases``, a case once however many tensors it names) and
    named first (``best``), the first such case, and the detail most of them share with how many
    do (a mapping, an edge, rows: one detail on every case is one defect, many are a pattern).
    ``unexplained``: the failing cases (verdict ``fail``) no tested cause fits; ``untested``: those
    that errored, crashed or timed out without one (no result to test causes on).  Groups ordered
    by ``best``, then ``cases``, then the vocabulary's order; None when no case has a cause and
    none fails (nothing to say)."""
    failing = [r for r in records if r.get("verdict") in FAILING]
    warning = [r for r in records if r.get("verdict") == "warn"]
    groups: dict[str, CauseGroup] = {}
    details: dict[str, dict[str, int]] = {}
    unexplained = untested = 0
    for rec in (*failing, *warning):
        diag = rec.get("diagnosis")
        found = [c for c in (diag.get("causes") or []) if isinstance(c, dict)] if isinstance(diag, dict) else []
        if not found:
            unexplained += rec.get("verdict") == "fail"
            untested += rec.get("verdict") in FAILING and rec.get("verdict") != "fail"
            continue
        named: dict[str, str] = {}  # a cause once per case (forward and backward may both name it), its first detail
        for c in found:
            named.setdefault(c["cause"], c["detail"])
        for name, detail in named.items():
            g = groups.setdefault(
                name,
                CauseGroup(cause=name, cases=0, best=0, first=rec.get("case", ""), detail=detail, detail_cases=0),
            )
            g["cases"] += 1
            g["best"] += name == found[0]["cause"]
            details.setdefault(name, {})
            details[name][detail] = details[name].get(detail, 0) + 1
    if not groups and not failing:
        return None
    order = {c: i for i, c in enumerate(CAUSES)}
    for name, g in groups.items():
        g["detail"], g["detail_cases"] = max(details[name].items(), key=lambda kv: kv[1])  # ties: the first seen
    out = sorted(
        groups.values(), key=lambda g: (-g["best"], -g["cases"], order.get(g["cause"], len(order)), g["cause"])
    )
    return CauseTally(
        failing=len(failing), warning=len(warning), unexplained=unexplained, untested=untested, groups=out
    )


def cause_text(causes: CauseTally | None, *, lead: str = "Likely causes over the") -> str:
    """:func:`cause_groups` as one sentence for every view ("Likely causes over the 22 failing
    cases: misplaced_rows first on 20 and named on 21 (all 21: ...); ...; every failing
    case has one");
    "" for none.  ``lead``: the words before the cases counted (``compare``: the worse verdicts')."""
    if not causes or not (causes["groups"] or causes["failing"]):
        return ""
    n_f, n_w = causes["failing"], causes["warning"]
    over = " and ".join(
        count_of(n, noun)
        for n, noun in ((n_f, ("failing case", "failing cases")), (n_w, ("warning case", "warning cases")))
        if n
    )
    parts = []
    for g in causes["groups"]:
        share = f"all {g['cases']}" if g["detail_cases"] == g["cases"] else f"{g['detail_cases']} of {g['cases']}"
        parts.append(f"{g['cause']} first on {g['best']} and named on {g['cases']} ({share}: {g['detail']})")
    fits, untested = causes["unexplained"], causes.get("untested", 0)
    if fits:
        parts.append(f"no tested cause fits {count_of(fits, ('failing case', 'failing cases'))}")
    elif n_f > untested:
        parts.append("every failing case has one")
    if untested:
        parts.append(f"{count_of(untested, ('case', 'cases'))} errored, crashed or timed out: no result to test")
    return f"{lead} {over}: " + "; ".join(parts)


def likely_cause(rec: CaseRecord) -> str:
    """The case's best tested cause in a few words, for one-line views (``gate``, ``compare``'s
    regressions): "likely cause: mask_edge (causal mask ignored)"; "" when none was named
    (:func:`cause_lines` gives the evidence too)."""
    diag = rec.get("diagnosis")
    found = diag.get("causes") if isinstance(diag, dict) else None
    if not found or not isinstance(found[0], dict):
        return ""
    return f"likely cause: {found[0]['cause']} ({found[0]['detail']})"


def cause_lines(rec: CaseRecord) -> list[str]:
    """A case's tested causes (``rec["diagnosis"]["causes"]``, ``audits.verdict.causes``) as lines,
    best first: "likely cause: mask_edge (window_left admits one key too many): <evidence>", then
    "also: ..." for the others; empty when no hypothesis fitted (or none was tested)."""
    found = (rec.get("diagnosis") or {}).get("causes") if isinstance(rec.get("diagnosis"), dict) else None
    out = []
    for i, c in enumerate(found or []):
        head = "likely cause" if i == 0 else "also"
        out.append(f"{head}: {c['cause']} ({c['detail']}): {c['evidence']}")
    if isinstance(rec.get("diagnosis"), dict) and rec["diagnosis"].get("causes_error"):
        out.append(f"causes not fully tested: {rec['diagnosis']['causes_error']}")
    for part, text in ((rec.get("diagnosis") or {}).get("poisoned") or {}).items():
        out.append(f"poisoned ({part}): {text}")
    return out


def where_lines(rec: CaseRecord) -> list[str]:
    """A failing case's diagnosis as lines, one per tensor with violations, in the order of
    :data:`TENSORS`: its summary, after "out: " unless the summary names its tensor itself ("all
    18,733 out violations in rows 156..199 (of 0..199); rows 0..155 within bound"); empty when the
    case has none (not failing, or nothing localizable)."""
    diag = rec.get("diagnosis")
    if not isinstance(diag, dict):
        return []
    names = [t for t in TENSORS if t in diag] + sorted(t for t in diag if t not in TENSORS)
    out = []
    for t in names:
        text = diag[t].get("summary") if isinstance(diag[t], dict) else None
        if text:
            out.append(text if re.search(rf"\b{re.escape(t)}\b", text) else f"{t}: {text}")
    return out
