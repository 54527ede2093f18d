"""The release generator's axes and how a suite is placed inside a domain: :data:`RELEASE_AXES`,
the pairwise covering array (:func:`pairwise`), the case of a row (:func:`release_case`), the axes
a domain supports (:func:`axes_within`), a row placed in a domain (:func:`case_within`) and a
case moved into one (:func:`fit`)."""

from __future__ import annotations

import dataclasses
import itertools
import random

from audits.suites.case import Case
from audits.suites.domain import Domain, seqlens_within

__all__ = [
    "SEQLEN_PAIRS",
    "RELEASE_AXES",
    "pairwise",
    "release_case",
    "axes_within",
    "case_within",
    "pairs_covered",
    "fit",
    "inside",
]

#: (seqlen_q, seqlen_k) pairs of FA's own tests (flash-attention/tests/cute/test_flash_attn.py) and more
SEQLEN_PAIRS = [
    (1, 239),
    (3, 799),
    (127, 512),
    (127, 513),
    (113, 203),
    (128, 217),
    (113, 211),
    (108, 256),
    (256, 512),
    (384, 256),
    (640, 128),
    (512, 256),
    (1024, 1024),
    (1023, 1024),
    (1024, 1023),
    (200, 2048),
    (2048, 2048),
    (4096, 4096),
    (8192, 8192),
    (1, 8192),
    (4224, 4224),
    (1000, 3000),
]
RELEASE_AXES = {
    "dtype": ["bfloat16", "float16", "float8_e4m3fn"],
    "d": [64, 96, 128, 192, 256],
    "mask": ["none", "causal", "local"],
    "softcap": [0.0, 15.0],
    "sink": [False, True],
    "heads": [(4, 4), (8, 2), (4, 1)],
    "seqlens": SEQLEN_PAIRS,
    "layout": ["contiguous", "strided"],
}


def pairwise(axes: dict[str, list], seed: int = 0, candidates: int = 40) -> list[dict]:
    """A covering array of strength 2: rows (one value per axis) such that every pair of values
    of every two axes appears in some row.  Greedy (AETG-style): each new row is the best of
    ``candidates`` random rows seeded by an uncovered pair; deterministic from ``seed``."""
    names = list(axes)
    rng = random.Random(seed)
    uncovered = {
        (a, i, b, j)
        for a, b in itertools.combinations(range(len(names)), 2)
        for i in range(len(axes[names[a]]))
        for j in range(len(axes[names[b]]))
    }
    rows = []
    while uncovered:
        a, i, b, j = min(uncovered)
        best, gain = None, -1
        for _ in range(candidates):
            row = [rng.randrange(len(axes[n])) for n in names]
            row[a], row[b] = i, j
            g = sum((x, row[x], y, row[y]) in uncovered for x, y in itertools.combinations(range(len(names)), 2))
            if g > gain:
                best, gain = row, g
        for x, y in itertools.combinations(range(len(names)), 2):
            uncovered.discard((x, best[x], y, best[y]))
        rows.append({n: axes[n][best[k]] for k, n in enumerate(names)})
    return rows


def release_case(row: dict, family: str, seed: int) -> Case:
    """The case of a covering-array row (one value per axis of ``RELEASE_AXES``; the mask axis
    also takes a window, a (left, right) pair: local with that window) for ``family``.  Public:
    :func:`case_within` places a domain's rows with it."""
    sq, sk = row["seqlens"]
    hq, hk = row["heads"]
    mask = row["mask"]
    window = (128, 32) if mask == "local" else tuple(mask) if isinstance(mask, (tuple, list)) else (None, None)
    if family == "nan_inf_masked":  # needs keys that no query sees: a left window short of them
        window, sq = (64, 0), min(sq, max(1, sk - 80))
        if sk - sq - 64 <= 0:
            sk = sq + 80
    d = row["d"]
    return Case(
        row["dtype"],
        d,
        d,
        1 if sq * sk > 4096 * 4096 else 2,
        hq,
        hk,
        sq,
        sk,
        causal=mask == "causal" and family != "nan_inf_masked",
        window=window,
        softcap=row["softcap"],
        sink=row["sink"],
        layout=row["layout"],
        family=family,
        seed=seed,
    )


#: a domain listing more (d, dv) pairs than this (a range written out, as production's SM100
#: head dims 8..128) has its head-dim axis sampled at the suite's own head dims
_HEAD_DIM_AXIS_MAX = 16


def _head_dim_axis(d: Domain, base_ds: list[int]) -> list[tuple[int, int]]:
    """The head-dim axis: the accepted pairs, or for a long list, per head dim of the suite
    ``(d, d)`` if listed, else the first listed pair with that d (production's (192, 128) for
    the (192, 192) it refuses)."""
    pairs = d.head_dim_pairs()
    if pairs is None:
        return [(x, x) for x in base_ds]
    if len(pairs) <= _HEAD_DIM_AXIS_MAX:
        return list(pairs)
    picked = []
    for x in base_ds:
        same = [p for p in pairs if p[0] == x]
        if same:
            picked.append((x, x) if (x, x) in same else same[0])
    return picked or list(pairs[:_HEAD_DIM_AXIS_MAX])


def axes_within(d: Domain, base: dict | None = None) -> dict[str, list]:
    """The release axes (:data:`RELEASE_AXES`) restricted to what the domain supports;
    head dims as (d, dv) pairs."""
    base = base or RELEASE_AXES
    return {
        "dtype": list(d.dtypes) if d.dtypes else list(base["dtype"]),
        "d": _head_dim_axis(d, list(base["d"])),
        "mask": ["none"] + ["causal"] * d.causal + ["local"] * d.local,
        "softcap": [0.0] + [15.0] * d.softcap,
        "sink": [False] + [True] * d.sink,
        "heads": [h for h in base["heads"] if d.gqa or h[0] == h[1]],
        "seqlens": seqlens_within(d, list(base["seqlens"])),
        "layout": list(d.layouts) if d.layouts else list(base["layout"]),
    }


def case_within(d: Domain, row: dict, family: str, seed: int) -> tuple[Case | None, str | None]:
    """The release case of ``row`` for ``family`` (:func:`release_case`, head dims from
    the row's pair), or why the family cannot be placed in the domain.  Public: suite files
    (``audits.suites.suite_file``) place their rows with it, as the named suites do."""
    dd, dv = row["d"]
    case = dataclasses.replace(release_case({**row, "d": dd}, family, seed), dv=dv)
    why = d.refusal(case)
    return (case, None) if why is None else (None, why)


def pairs_covered(axes: dict) -> int:
    """How many pairs of values of two different axes a covering array over ``axes`` covers."""
    names = list(axes)
    return sum(len(axes[a]) * len(axes[b]) for i, a in enumerate(names) for b in names[i + 1 :])


def inside(d: Domain, cases: list[Case]) -> list[Case]:
    """The ``cases`` that lie inside the domain, as they are (a suite's varlen cases: their
    sequences' lengths are the serving mix, not axis values)."""
    return [c for c in cases if d.refusal(c) is None]


def fit(d: Domain, case: Case) -> tuple[Case | None, str | None]:
    """``case`` moved into ``d`` along the axes it does not sweep (lengths to the domain's own,
    equal heads without GQA, a declared layout), or why it still lies outside."""
    if d.refusal(case) is None:
        return case, None
    if case.varlen:  # a varlen case's lengths are the serving mix, not an axis value (:func:`inside`)
        return None, d.refusal(case)
    sq, sk = next(iter(seqlens_within(d, [(case.seqlen_q, case.seqlen_k)])), (case.seqlen_q, case.seqlen_k))
    layout = case.layout if d.layouts is None or case.layout in d.layouts else d.layouts[0]
    moved = dataclasses.replace(
        case, seqlen_q=sq, seqlen_k=sk, layout=layout, heads_kv=case.heads_kv if d.gqa else case.heads_q
    )
    why = d.refusal(moved)
    return (moved, None) if why is None else (None, why)
