"""Where a failing case's violations lie (``case["diagnosis"]``, docs/diagnosis.md): per tensor
(out, lse, dq, dk, dv, dsink) the elements that break a criterion gating the case, their counts
per criterion, and the axes along which they concentrate, in one sentence a kernel author reads
("all 32,886 out violations in batch 1 (of 2); batch 0 within bound"); plus the error-map data
(``maps/<case>.npz``) that ``audits.report.maps`` draws.

Computed in the run, from the tensors the engine keeps until the verdict (:class:`CaseTensors`);
never recomputed from a report (the report holds no tensors).

A violating element is one that breaks any criterion that gates the case under the thresholds
(``audits.verdict.gate`` states each rule once; this module asks it):

* ``bound``: |err| past the per-element bound (forward ``[policy] bound`` for FA4 kernels,
  ``peer_bound`` for the others; backward ``[backward] bound`` / ``peer_bound``), checked where
  the reference and the bound are finite (a NaN or inf there is past it);
* ``nonfinite``: NaN/inf where the FP64 reference is finite;
* ``semantics``: a different value where non-finite inputs make the reference NaN/inf, only when
  ``[policy] nan_swallowed`` is "fail";
* ``fa_criterion``: |err| above FA's allowed maximum (``gate.fa_allowed`` / ``grad_fa_allowed``;
  FA's test passes or fails on the maximum, so an element above it is one that fails it);
* ``lse``: |lse err| above the [lse] ceiling (``gate.lse_allowed``), and rows with no visible
  key whose LSE is not -inf;
* ``zeros``: dK / dV of keys no query sees, dQ of rows that see no key, not exactly zero.

The axes (``AXES``): ``batch`` (the sequence, varlen), ``head`` (query head), ``kv_head`` (its
GQA group), ``row`` (query row within its sequence), ``row_tile`` (row // tile_m), ``col`` (key,
dK/dV), ``col_tile`` (key // tile_n), ``dim`` (head-dim column), ``mask_region`` (labels
``MASK_REGIONS``: row-level for out/lse/dq, key-level for dk/dv).  Tiles: the kernel's
FA4Numerics' for an FA4 kernel, else the SM90 choice of ``fa4.code_paths`` for the case.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from audits.report.records import CaseRecord
from audits.suites.cases import Case
from audits.verdict.gate import bound_gated, fa_allowed, grad_fa_allowed, lse_allowed
from fa4.code_paths import sm90_bwd_tile, sm90_fwd_tile
from fa4.model_bwd import bwd_plan
from numerics.reference import visible_mask

__all__ = [
    "AXES",
    "index_ranges",
    "MASK_REGIONS",
    "TENSORS",
    "CRITERIA",
    "MIN_SHARE_OF_VIOLATIONS",
    "MAX_SHARE_OF_ELEMENTS",
    "MAX_CHANCE",
    "MAX_PANELS",
    "MAX_PANEL_SIDE",
    "Concentration",
    "concentration",
    "Layout",
    "layout_of",
    "canonical",
    "localize",
    "CaseTensors",
    "ErrorMap",
    "diagnose",
    "save_map",
    "load_map",
    "forward_tiles",
    "backward_tiles",
]

AXES = ("batch", "head", "kv_head", "row", "row_tile", "col", "col_tile", "dim", "mask_region")
#: ``mask_region`` labels: a row that sees no key; the last row tile when the rows do not fill it;
#: the last key tile when the keys do not fill it; a key no query sees; everything else
MASK_REGIONS = ("no visible key", "last partial row tile", "last partial key tile", "unseen key", "full tiles")
TENSORS = ("out", "lse", "dq", "dk", "dv", "dsink")
CRITERIA = ("bound", "nonfinite", "semantics", "fa_criterion", "lse", "zeros")

# ---- the concentration test ------------------------------------------------------------------
#
# An axis' violations concentrate on a set S of its values when
#   (1) S holds >= MIN_SHARE_OF_VIOLATIONS of the tensor's violations,
#   (2) S holds <= MAX_SHARE_OF_ELEMENTS of its elements, and
#   (3) violations falling on the elements independently and uniformly would put that share on
#       some set of |S| values with probability < MAX_CHANCE.
# S is, of these candidates, the first that passes: every value holding a violation (then the
# sentence says "all"); else the fewest values, in decreasing violation density (violations /
# elements), that reach (1), on an ordered axis (rows, keys, dims, tiles) with the violating
# values inside its span added ("rows 36..199", not eight runs with one-row gaps of rows just
# under the 99% cut), else without them.  (3) is a union bound, over the sets of S's shape, of
# the Chernoff tail of Binomial(V, p), p = S's share of the elements: P[X >= a V] <=
# exp(-V KL(a || p)) (exact when a = 1: p**V).  Sets of S's shape: C(n, |S|) of its size among
# the axis' n values; on an ordered axis at most C(n + 1, 2r) with its r runs (a run of 44 rows
# of 256 is one of 32,896 intervals, not one of C(256, 44) = 6.8e49 sets); times n**2 for the
# shapes (size, runs) the test may land on.  The union bound pays for choosing S after seeing
# the data: sparse noise (20 violations in 20 of 128 rows) has p**V = 7.5e-17 for its own rows,
# times C(128, 20) = 1.2e23 sets: not concentrated.  Every set of S's shape is taken at S's own
# p (equal when the values hold equal elements, as rows, heads and dims do): a stated rule, not
# an exact p-value.

#: (1): a real bug's violations plus a few marginal ones elsewhere (an imprecise kernel's
#: rounding just past the bound) still read as one place; 1% leaves room for those
MIN_SHARE_OF_VIOLATIONS = 0.99
#: (2): a concentration leaves at least a tenth of the axis' elements clean; "every column but
#: the first 16 of 80" (80%) is a finding, "all but one row of 128" is a spread
MAX_SHARE_OF_ELEMENTS = 0.9
#: (3): a run judges ~10**3 cases x 6 tensors x 9 axes = 5 x 10**4 tests; at 1e-6 each (3e-6
#: with the three candidates), uniform violations make a false concentration somewhere in a run
#: with probability <= 0.15.  Twenty violations all in batch 1 of 2 (2**-20 x C(2, 1) x 2**2 =
#: 7.6e-6) are not yet a finding; thirty (7.5e-9) are
MAX_CHANCE = 1e-6


@dataclass(frozen=True)
class Concentration:
    """The set S of an axis' values (their indices) that holds its violations (module doc)."""

    index: tuple[int, ...]
    share_of_violations: float
    share_of_elements: float
    #: log10 of the union-bound probability that uniform violations concentrate so
    log10_chance: float


def _log_comb(n: int, k: int) -> float:
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


def _log_tail(v: float, a: float, p: float) -> float:
    """ln of the Chernoff bound exp(-v KL(a || p)) on P[Binomial(v, p) >= a v] (0 when a <= p)."""
    if a <= p:
        return 0.0
    kl = a * math.log(a / p) + ((1 - a) * math.log((1 - a) / (1 - p)) if a < 1 else 0.0)
    return -v * kl


def _log_sets(chosen: list[int], live: list[int], ordered: bool) -> float:
    """ln of how many sets of the axis' values have ``chosen``'s shape (module doc, (3)): C(n, k)
    of its size k; on an ordered axis at most C(n + 1, 2r) of its r runs (2r boundaries); times
    n**2 for the shapes (k, r) the test may land on."""
    n, k = len(live), len(chosen)
    sets = _log_comb(n, k)
    if ordered:
        at = {v: j for j, v in enumerate(live)}
        js = sorted(at[i] for i in chosen)
        runs = 1 + sum(b != a + 1 for a, b in zip(js, js[1:]))
        sets = min(sets, _log_comb(n + 1, min(2 * runs, n + 1)))
    return sets + 2 * math.log(n)


def _judge_set(chosen: list[int], live: list[int], violations: list, elements: list, ordered: bool):
    """``chosen`` as a :class:`Concentration` if it passes (1), (2) and (3), else None."""
    total_v, total_e = float(sum(violations[i] for i in live)), float(sum(elements[i] for i in live))
    a = sum(violations[i] for i in chosen) / total_v
    p = sum(elements[i] for i in chosen) / total_e
    if p > MAX_SHARE_OF_ELEMENTS or a < MIN_SHARE_OF_VIOLATIONS:
        return None
    log_chance = _log_sets(chosen, live, ordered) + _log_tail(total_v, a, p)
    if log_chance >= math.log(MAX_CHANCE):
        return None
    return Concentration(tuple(sorted(chosen)), a, p, log_chance / math.log(10))


def concentration(*, violations: list[float], elements: list[float], ordered: bool = False) -> Concentration | None:
    """The concentration of one axis (module doc: the test, its candidates and thresholds), or
    None.  ``violations[i]`` / ``elements[i]``: the violating / checked elements at the axis'
    value i; values without elements take no part (a sequence with no query, say); ``ordered``:
    the values are positions (rows, keys, dims, tiles), where a span reads better than a list.
    Why a test and not a list of the values that hold violations: uniform noise touches some
    values only by chance, and a report that names them points an author at nothing."""
    live = [i for i, e in enumerate(elements) if e > 0]
    total_v = float(sum(violations[i] for i in live))
    if total_v <= 0 or len(live) < 2:
        return None
    every = [i for i in live if violations[i] > 0]
    found = _judge_set(every, live, violations, elements, ordered)
    if found is not None:
        return found
    order = sorted(live, key=lambda i: (-violations[i] / elements[i], i))
    chosen, held = [], 0.0
    for i in order:
        if held >= MIN_SHARE_OF_VIOLATIONS * total_v:
            break
        chosen.append(i)
        held += violations[i]
    if ordered:
        lo, hi = min(chosen), max(chosen)
        spanned = sorted(set(chosen) | {i for i in every if lo < i < hi})
        found = _judge_set(spanned, live, violations, elements, True) if len(spanned) > len(chosen) else None
        if found is not None:
            return found
    return _judge_set(chosen, live, violations, elements, ordered)


# ---- where each element lies -------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """How one tensor's elements map onto the axes.  The tensor is seen as (B, L, H, D):
    out/dq (batch, rows, heads, dims), lse (batch, rows, heads, 1), dk/dv (batch, keys, kv heads,
    dims), dsink (1, 1, heads, 1); a varlen tensor has B = 1 and L = the packed tokens.
    ``batch`` / ``pos`` (B, L) int64: each token's batch (sequence) and row or key within it;
    ``region`` (B, L) int64: its ``MASK_REGIONS`` index; ``tile``: tile_m (rows) or tile_n (keys);
    ``group``: query heads per kv head; ``level``: "row", "key" or "head" (dsink: no position)."""

    level: str
    batch: torch.Tensor
    pos: torch.Tensor
    region: torch.Tensor
    tile: int
    group: int
    sequences: bool = False  # batch values are varlen sequences (the summary says "sequence")


def _regions(vis: torch.Tensor, tile: int, *, level: str) -> torch.Tensor:
    """``MASK_REGIONS`` indices of one sequence's rows (``level`` "row") or keys ("key"), from its
    visible mask ``vis`` (rows x keys): the last partial tile, then tokens the mask leaves alone
    (a row with no visible key, a key no row sees), the rest "full tiles"."""
    n, seen = (vis.shape[0], vis.any(1)) if level == "row" else (vis.shape[1], vis.any(0))
    reg = torch.full((n,), MASK_REGIONS.index("full tiles"), dtype=torch.long)
    if n % tile:
        reg[(n // tile) * tile :] = MASK_REGIONS.index(f"last partial {level} tile")
    reg[~seen] = MASK_REGIONS.index("no visible key" if level == "row" else "unseen key")
    return reg


def layout_of(*, case: Case, level: str, tile: int) -> Layout:
    """The :class:`Layout` of ``case``'s tensors at ``level``: "row" (out, lse, dq: ``tile`` =
    tile_m), "key" (dk, dv: tile_n; fixed-length cases only, varlen cases have no backward) or
    "head" (dsink).  Varlen rows: batch = the sequence (``cu_seqlens_q``), row within it, the
    mask regions of its own (rows, used keys) visible mask."""
    group = case.heads_q // case.heads_kv
    window = tuple(case.window)
    if level == "head":
        z = torch.zeros(1, 1, dtype=torch.long)
        return Layout("head", z, z, z, tile, group)
    if case.varlen and level == "row":
        bs, ps, rs = [], [], []
        for i, (sq, sk) in enumerate(case.seqlens):
            used = case.seqused_k[i] if case.seqused_k else sk
            vis = visible_mask(sq, used, causal=case.causal, window_size=window)
            bs.append(torch.full((sq,), i, dtype=torch.long))
            ps.append(torch.arange(sq))
            rs.append(_regions(vis, tile, level="row"))
        cat = lambda ts: torch.cat(ts)[None] if ts else torch.zeros(1, 0, dtype=torch.long)
        return Layout("row", cat(bs), cat(ps), cat(rs), tile, group, sequences=True)
    if case.varlen:
        raise ValueError("varlen cases have row-level tensors only (no backward through the varlen entry)")
    vis = visible_mask(case.seqlen_q, case.seqlen_k, causal=case.causal, window_size=window)
    n = case.seqlen_q if level == "row" else case.seqlen_k
    reg = _regions(vis, tile, level=level)
    batch = torch.arange(case.batch)[:, None].expand(case.batch, n)
    return Layout(
        level, batch, torch.arange(n)[None].expand(case.batch, n), reg[None].expand(case.batch, n), tile, group
    )


def canonical(name: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` as (B, L, H, D) (:class:`Layout`): lse (B, H, L) -> (B, L, H, 1), dsink (H,) ->
    (1, 1, H, 1); the others as they are."""
    if name == "lse":
        return t.permute(0, 2, 1).unsqueeze(-1)
    if name == "dsink":
        return t.reshape(1, 1, -1, 1)
    return t


def _axis_counts(mask: torch.Tensor, lay: Layout) -> dict[str, tuple[list, list, list]]:
    """Per axis: (values, violations per value, elements per value) of a canonical mask."""
    b, n, h, d = mask.shape
    m = mask.to(torch.int64)
    pos = m.sum((2, 3)).cpu().reshape(-1)
    heads = m.sum((0, 1, 3)).cpu().tolist()
    dims = m.sum((0, 1, 2)).cpu().tolist()
    out = {}

    def by(index: torch.Tensor, labels=None) -> tuple[list, list, list]:
        idx = index.reshape(-1)
        k = int(idx.max()) + 1 if idx.numel() else 0
        viol = torch.zeros(k, dtype=torch.float64).index_add_(0, idx, pos.double()).tolist()
        elem = torch.zeros(k, dtype=torch.float64).index_add_(0, idx, torch.full_like(pos, h * d).double()).tolist()
        vals = list(range(k)) if labels is None else [labels[i] for i in range(k)]
        return vals, viol, elem

    if lay.level != "head":
        out["batch"] = by(lay.batch)
        name, tname = ("row", "row_tile") if lay.level == "row" else ("col", "col_tile")
        out[name] = by(lay.pos)
        out[tname] = by(lay.pos // lay.tile)
        out["mask_region"] = by(lay.region, MASK_REGIONS)
    per_head = float(b * n * d)
    if lay.level == "key":
        out["kv_head"] = (list(range(h)), heads, [per_head] * h)
    else:
        kv = [0.0] * (h // lay.group)
        for i, c in enumerate(heads):
            kv[i // lay.group] += c
        out["head"] = (list(range(h)), heads, [per_head] * h)
        out["kv_head"] = (list(range(len(kv))), kv, [per_head * lay.group] * len(kv))
    if lay.level != "head":
        out["dim"] = (list(range(d)), dims, [float(b * n * h)] * d)
    return out


def index_ranges(values: list[int], *, limit: int = 4) -> str:
    """``[0, 1, 2, 5]`` -> "0..2, 5"; more than ``limit`` runs: the first ones and how many."""
    runs = []
    for v in sorted(values):
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    text = [f"{a:,}" if a == b else f"{a:,}..{b:,}" for a, b in runs]
    if len(text) > limit:
        return ", ".join(text[: limit - 1]) + f", ... ({len(runs)} runs)"
    return ", ".join(text)


#: the summary's words per axis: (singular, plural)
_NOUNS = {
    "batch": ("batch", "batches"), "head": ("head", "heads"), "kv_head": ("kv head", "kv heads"),
    "row": ("row", "rows"), "row_tile": ("row tile", "row tiles"), "col": ("key", "keys"),
    "col_tile": ("key tile", "key tiles"), "dim": ("dim", "dims"), "mask_region": ("mask region", "mask regions"),
}  # fmt: skip
_REGION_WORDS = {"no visible key": "rows with no visible key", "last partial row tile": "the last partial row tile",
                 "last partial key tile": "the last partial key tile", "unseen key": "unseen keys",
                 "full tiles": "full tiles"}  # fmt: skip


def _phrase(axis: str, values: list, live: list, lay: Layout, *, of: bool = True, extra: str | None = None) -> str:
    """An axis' values in words: "batch 1 (of 2)", "dim 16..79 (of 0..79)", "the last partial row
    tile (rows 128..199)"; ``extra``: words put first in the parentheses (a twin axis' values, :func:`_summary`)."""
    if axis == "mask_region":
        text = " and ".join(_REGION_WORDS[v] for v in values)
        others = set(live) - set(values)
        if len(others) == 1 and len(values) > 1 and others <= {"unseen key", "no visible key"}:
            text = "keys some query sees" if others == {"unseen key"} else "rows that see a key"
        return f"{text} ({extra})" if extra else text
    one, many = _NOUNS[axis]
    if axis == "batch" and lay.sequences:
        one, many = "sequence", "sequences"
    text = f"{one if len(values) == 1 else many} {index_ranges(values)}"
    notes = [extra] if extra else []
    if of and axis in ("row", "col", "dim"):
        notes.append(f"of {index_ranges(live)}")
    elif of:
        tile = {"row_tile": f", tile_m {lay.tile}", "col_tile": f", tile_n {lay.tile}"}.get(axis, "")
        notes.append(f"of {len(live)}{tile}")
    return f"{text} ({'; '.join(notes)})" if notes else text


#: which of two axes covering the same elements the summary keeps (a named region, then the coarser)
_PRECEDENCE = ("batch", "mask_region", "kv_head", "row_tile", "col_tile", "head", "row", "col", "dim")
#: axes that place an element by its token (batch, row or key): equal coverage among them is one fact
_TOKEN_AXES = ("batch", "mask_region", "row_tile", "row", "col_tile", "col")
#: at most this many axes in a summary sentence (the report's JSON has them all)
_SUMMARY_AXES = 3


def _covered(axis: str, values: list, lay: Layout, h: int) -> torch.Tensor:
    """The tokens (token axes: (B, L) bool) or the heads (head, kv_head: (H,)) an axis' values cover."""
    if axis in _TOKEN_AXES:
        src = {"batch": lay.batch, "mask_region": lay.region}.get(axis, lay.pos)
        if axis in ("row_tile", "col_tile"):
            src = lay.pos // lay.tile
        vals = [MASK_REGIONS.index(v) for v in values] if axis == "mask_region" else values
        return torch.isin(src, torch.tensor(vals, dtype=torch.long))
    heads = torch.arange(h)
    if axis == "kv_head" and lay.level != "key":
        heads = heads // lay.group
    return torch.isin(heads, torch.tensor(values, dtype=torch.long))


def _rank(axis: str, axes: dict) -> int:
    """:data:`_PRECEDENCE`, but "full tiles" alone (a region that says little) yields to a tile axis
    that covers the same rows or keys: "row tile 0 (rows 0..127)", not "full tiles (rows 0..127)"."""
    if axis == "mask_region" and axes[axis]["values"] == ["full tiles"]:
        return _PRECEDENCE.index("col_tile") + 1
    return _PRECEDENCE.index(axis)


def _twins(a: str, ca: torch.Tensor | None, b: str, cb: torch.Tensor) -> bool:
    """Whether axes ``a`` and ``b`` (their :func:`_covered` sets) cover the same tokens or heads."""
    same_space = ca is not None and (a in _TOKEN_AXES) == (b in _TOKEN_AXES) and ca.shape == cb.shape
    return same_space and torch.equal(ca, cb)


def _join(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} and {parts[-1]}"


def _summary(
    tensor: str, total: int, elements: int, axes: dict, counts: dict, lay: Layout, h: int, words: tuple[str, str]
) -> str:
    """One sentence: the concentrated axes, most specific first; of two that cover the same
    elements (rows that are whole row tiles, heads that are whole GQA groups) only one, the
    other's values in its parentheses; the first axis' clean rest when it is short.  Without a
    concentrated axis: that the violations spread over every axis that has several values.
    ``words``: what an element of the mask is, and what the rest is ("violation", "within bound")."""
    noun, clean_rest = words
    n = f"{total:,} {tensor} {noun}{'s' if total != 1 else ''}"
    live = {a: [v for v, e in zip(counts[a][0], counts[a][2]) if e > 0] for a in counts}
    if not axes:
        spread = [_NOUNS[a][0] for a in AXES if a in counts and a != "mask_region" and len(live[a]) > 1]
        share = f" ({100 * total / elements:.3g}% of {elements:,} elements)" if elements else ""
        return f"{n}{share}, spread over every {_join(spread)}" if spread else f"{n}{share}"
    kept, covs, twins = [], {}, {}
    for a in sorted(axes, key=lambda a: _rank(a, axes)):
        cov = None if a == "dim" else _covered(a, axes[a]["values"], lay, h)  # dims: a space of their own
        twin = None if cov is None else next((k for k in kept if _twins(k, covs[k], a, cov)), None)
        if twin is None:
            kept.append(a)
            covs[a] = cov
        else:
            twins[twin] = a  # the finest twin (precedence runs coarse to fine) is the one shown
    kept = sorted(kept, key=lambda a: (axes[a]["share_of_elements"], _PRECEDENCE.index(a)))[:_SUMMARY_AXES]
    parts = []
    for a in kept:
        extra = None
        if a in twins:
            extra = _phrase(twins[a], axes[twins[a]]["values"], live[twins[a]], lay, of=False)
        parts.append(_phrase(a, axes[a]["values"], live[a], lay, extra=extra))
    shares = [axes[a]["share_of_violations"] for a in kept]
    if all(s >= 1 for s in shares):
        text = f"all {n} in {_join(parts)}"
    else:
        text = f"{n}: " + _join([f"{'all' if s >= 1 else f'{100 * s:.3g}%'} in {p}" for s, p in zip(shares, parts)])
    first = kept[0]
    vals, viol, _ = counts[first]
    chosen = set(axes[first]["values"])
    rest = [v for v in live[first] if v not in chosen]
    clean = all(c == 0 for v, c in zip(vals, viol) if v not in chosen)
    if rest and clean and (first == "mask_region" or index_ranges(rest, limit=3).count(",") < 2):
        text += f"; {_phrase(first, rest, live[first], lay, of=False)} {clean_rest}"
    return text


def localize(
    *, tensor: str, mask: torch.Tensor, layout: Layout, words: tuple[str, str] = ("violation", "within bound")
) -> dict:
    """Where the violations of one tensor lie: ``{"violations", "elements", "axes", "summary"}``
    (docs/diagnosis.md); ``mask``: the violating elements, (B, L, H, D) as :class:`Layout` says
    (``TENSORS``' shapes in that form); ``axes`` holds the concentrated axes only (module doc:
    :func:`concentration`), each ``{"values", "share_of_violations", "share_of_elements", "of"}``;
    ``words``: what the summary calls a masked element and the rest (``fa4-audit compare`` locates
    differing elements with it: "element", "identical")."""
    counts = _axis_counts(mask, layout)
    total = int(mask.sum())
    axes = {}
    for a in AXES:
        if a not in counts:
            continue
        vals, viol, elem = counts[a]
        c = concentration(violations=viol, elements=elem, ordered=a not in ("batch", "head", "kv_head", "mask_region"))
        if c is None:
            continue
        axes[a] = {
            "values": [vals[i] for i in c.index],
            "share_of_violations": round(c.share_of_violations, 6),
            "share_of_elements": round(c.share_of_elements, 6),
            "of": sum(e > 0 for e in elem),
        }
    summary = _summary(tensor, total, mask.numel(), axes, counts, layout, mask.shape[2], words)
    return {"violations": total, "elements": mask.numel(), "axes": axes, "summary": summary}


# ---- the criteria, per element ------------------------------------------------------------------


def forward_tiles(*, case: Case, numerics, kind: str) -> tuple[int, int]:
    """(tile_m, tile_n) the forward's row and key tiles are read with: an FA4 kernel's own
    (``numerics``, its FA4Numerics), else production's SM90 choice for the case
    (``fa4.code_paths.sm90_fwd_tile``), the tiles a flash-attention kernel most likely has."""
    if kind == "fa4" and numerics is not None:
        return numerics.tile_m, numerics.tile_n
    return sm90_fwd_tile(d=case.d, dv=case.dv, causal=case.causal, local=case.local)


def backward_tiles(*, case: Case, numerics, kind: str) -> tuple[int, int]:
    """(tile_m, tile_n) of the backward: an FA4 kernel's backward plan (``fa4.model_bwd.bwd_plan``
    of its numerics), else SM90's (``fa4.code_paths.sm90_bwd_tile``)."""
    if kind == "fa4" and numerics is not None:
        try:
            plan = bwd_plan(numerics, case.d, case.dv, case.causal, case.local)
            return plan.tile_m, plan.tile_n
        except NotImplementedError:  # a head dim the backward model does not take: the forward's tiles
            return numerics.tile_m, numerics.tile_n
    t = sm90_bwd_tile(d=case.d, dv=case.dv, causal=case.causal, local=case.local)
    return t.tile_m, t.tile_n


@dataclass
class CaseTensors:
    """What the engine keeps of one case until its verdict, for :func:`diagnose`: the kernel's
    result, the FP64 references and the per-element bounds, as measured (varlen: packed, batch 1).
    ``kind`` / ``numerics``: the bound's kind ("fa4" | "peer") and the FA4Numerics it used (the
    tiles come from them); the same for the backward (``bwd_kind``, ``bwd_numerics``);
    ``inputs``: the call's inputs (``audits.suites.inputs.make_inputs``: q, k, v, kw), which the
    cause hypotheses recompute references from (``audits.verdict.causes``)."""

    case: Case
    kind: str | None = None
    numerics: object = None
    out: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    ref: torch.Tensor | None = None
    ref_lse: torch.Tensor | None = None
    out_bound: torch.Tensor | None = None
    lse_bound: torch.Tensor | None = None
    grads: dict = field(default_factory=dict)
    grad_refs: dict = field(default_factory=dict)
    grad_bounds: dict | None = None
    grad_output: torch.Tensor | None = None
    bwd_kind: str | None = None
    bwd_numerics: object = None
    inputs: dict | None = None


@dataclass
class _Part:
    """One tensor's violations, canonical (B, L, H, D): the union mask, the count per criterion,
    |err| / the gated allowance per element (the error map's values)."""

    name: str
    mask: torch.Tensor
    criteria: dict
    ratio: torch.Tensor
    layout: Layout
    tiles: tuple[int, int]


def _same(g: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    return (g == r) | (torch.isnan(g) & torch.isnan(r))


def _past(err: torch.Tensor, ref: torch.Tensor, allowed) -> torch.Tensor:
    """Elements past ``allowed`` (a tensor or a number) where the reference and it are finite; a
    NaN or inf error there is past it (``numerics.metrics.bound_check``, FA's criterion alike)."""
    checked = torch.isfinite(ref)
    if isinstance(allowed, torch.Tensor):
        checked = checked & torch.isfinite(allowed)
    return checked & ~(err <= allowed)


def _ratio(err, g, r, den, viol) -> torch.Tensor:
    """|err| / ``den`` (None: no gated allowance), float32: inf where the kernel is non-finite and
    the reference finite, and where a violation has no finite ratio; 0 elsewhere without one."""
    inf, zero = torch.tensor(math.inf, device=err.device), torch.tensor(0.0, device=err.device)
    if den is None:
        return torch.where(viol, inf, zero).float()
    q = torch.where(err == 0, zero.double(), err / den)
    q = torch.where(torch.isfinite(r) & ~torch.isfinite(g), inf.double(), q)
    q = torch.where(torch.isfinite(r), q, torch.where(viol, inf, zero).double())
    return torch.where(torch.isnan(q), torch.where(viol, inf, zero).double(), q).float()


def _part(name, got, ref, crit: dict, den, err, lay: Layout, tiles) -> _Part:
    """The :class:`_Part` of one tensor from its criterion masks (all the tensor's shape)."""
    mask = torch.zeros(got.shape, dtype=torch.bool, device=got.device)
    counts = {}
    for k in CRITERIA:
        if k in crit:
            mask |= crit[k]
            counts[k] = int(crit[k].sum())
    g, r = got.double(), ref.double()
    ratio = _ratio(err, g, r, den, mask)
    c = lambda t: canonical(name, t)
    return _Part(name, c(mask), {k: v for k, v in counts.items() if v}, c(ratio), lay, tiles)


def _forward_parts(rec: CaseRecord, th: dict, t: CaseTensors) -> list[_Part]:
    """out and lse: the forward's gating criteria per element (module doc)."""
    case, fail_sem = t.case, th["policy"]["nan_swallowed"] == "fail"
    tiles = forward_tiles(case=case, numerics=t.numerics, kind=t.kind)
    lay = layout_of(case=case, level="row", tile=tiles[0])
    gated = bound_gated(m=rec, th=th)
    parts = []
    g, r = t.out.double(), t.ref.double()
    err = (g - r).abs()
    crit = {"nonfinite": torch.isfinite(r) & ~torch.isfinite(g)}
    if gated:
        crit["bound"] = _past(err, r, t.out_bound)
    if fail_sem:
        crit["semantics"] = ~torch.isfinite(r) & ~_same(g, r)
    fa = fa_allowed(m=rec, th=th)
    if fa is not None:
        crit["fa_criterion"] = _past(err, r, fa)
    parts.append(_part("out", t.out, t.ref, crit, t.out_bound if gated else fa, err, lay, tiles))
    if t.lse is not None and t.ref_lse is not None and rec.get("lse") is not None:
        a, rl = t.lse.double(), t.ref_lse.double()
        lerr = torch.where(torch.isinf(rl) & (a == rl), torch.zeros_like(a), (a - rl).abs())
        same = _same(a, rl)
        crit = {"nonfinite": torch.isfinite(rl) & ~torch.isfinite(a)}
        if gated:
            crit["bound"] = _past(lerr, rl, t.lse_bound)
        if fail_sem:
            crit["semantics"] = (torch.isnan(rl) | (rl == math.inf)) & ~same
        allowed = lse_allowed(m=rec, th=th)
        both = torch.isfinite(a) & torch.isfinite(rl)
        crit["lse"] = (both & (lerr > allowed)) | ((rl == -math.inf) & ~same)
        parts.append(_part("lse", t.lse, t.ref_lse, crit, t.lse_bound if gated else allowed, lerr, lay, tiles))
    return parts


def _backward_parts(rec: CaseRecord, th: dict, t: CaseTensors) -> list[_Part]:
    """dq, dk, dv, dsink: the backward's gating criteria per element, when its half gates."""
    b = rec.get("backward") or {}
    out_of_domain = b.get("out_of_domain") and not th["policy"]["claim_float32_overflow"]
    if b.get("status") != "ran" or not t.grads or out_of_domain:
        return []
    case, fail_sem = t.case, th["policy"]["nan_swallowed"] == "fail"
    tiles = backward_tiles(case=case, numerics=t.bwd_numerics, kind=t.bwd_kind)
    gated = bound_gated(m=rec, th=th, backward=True)
    vis = visible_mask(case.seqlen_q, case.seqlen_k, causal=case.causal, window_size=tuple(case.window))
    parts = []
    for n in ("dq", "dk", "dv", "dsink"):
        got = t.grads.get(n)
        if got is None or n not in b.get("grads", {}):
            continue
        g, r = got.double(), t.grad_refs[n].double()
        err = (g - r).abs()
        crit = {"nonfinite": torch.isfinite(r) & ~torch.isfinite(g)}
        bound = (t.grad_bounds or {}).get(n) if gated else None
        if bound is not None:
            crit["bound"] = _past(err, r, bound)
        if fail_sem:
            crit["semantics"] = ~torch.isfinite(r) & ~_same(g, r)
        fa = grad_fa_allowed(m=rec, grad=n, th=th)
        if isinstance(fa, list):
            fa = torch.tensor(fa, dtype=torch.float64, device=g.device)
        if fa is not None:
            crit["fa_criterion"] = _past(err, r, fa)
        nonzero = (g != 0) | torch.isnan(g)
        if n in ("dk", "dv"):
            crit["zeros"] = nonzero & (~vis.any(0)).to(g.device)[None, :, None, None]
        elif n == "dq":
            crit["zeros"] = nonzero & (~vis.any(1)).to(g.device)[None, :, None, None]
        level = {"dq": "row", "dk": "key", "dv": "key", "dsink": "head"}[n]
        lay = layout_of(case=case, level=level, tile=tiles[0] if level != "key" else tiles[1])
        parts.append(_part(n, got, t.grad_refs[n], crit, bound if bound is not None else fa, err, lay, tiles))
    return parts


# ---- the error map (maps/<case>.npz) -------------------------------------------------------------

#: panels kept per case (the worst by max |err| / bound): a report shows a few, not every head
MAX_PANELS = 8
#: a panel's largest side after max-pooling: 256 pixels show a tile grid of 128 rows at 2 px a row
MAX_PANEL_SIDE = 256


@dataclass
class ErrorMap:
    """One case's error-map data: ``meta`` (the npz's "meta" JSON, docs/diagnosis.md) and the
    panels' float32 arrays by key."""

    meta: dict
    arrays: dict


def _pool(x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """Max-pool a 2-D array by integer steps so that no side exceeds :data:`MAX_PANEL_SIDE`."""
    rs, cs = -(-x.shape[0] // MAX_PANEL_SIDE), -(-x.shape[1] // MAX_PANEL_SIDE)
    pr, pc = (-x.shape[0]) % rs, (-x.shape[1]) % cs
    x = torch.nn.functional.pad(x, (0, pc, 0, pr))
    return x.reshape(x.shape[0] // rs, rs, x.shape[1] // cs, cs).amax((1, 3)), rs, cs


def _panels(parts: list[_Part], case: Case, fwd_tiles: tuple[int, int]) -> ErrorMap | None:
    """The worst :data:`MAX_PANELS` (batch, head) panels of the row- and key-level tensors."""
    cands = []
    for k, p in enumerate(parts):
        if p.layout.level == "head":
            continue
        if p.layout.sequences:
            starts = [0]
            for sq, _ in case.seqlens:
                starts.append(starts[-1] + sq)
            spans = [(0, slice(starts[i], starts[i + 1]), i) for i in range(len(case.seqlens))]
        else:
            spans = [(b, slice(None), b) for b in range(p.mask.shape[0])]
        for bi, rows, label in spans:
            m, q = p.mask[bi, rows], p.ratio[bi, rows]
            if not m.numel():
                continue
            viol, worst = m.sum((0, 2)).cpu().tolist(), q.amax((0, 2)).cpu().tolist()
            cands += [(-worst[h], -viol[h], k, bi, rows, label, h) for h in range(m.shape[1]) if viol[h]]
    if not cands:
        return None
    cands.sort(key=lambda c: (c[0], c[1], c[2], c[5], c[6]))
    panels, arrays = [], {}
    for neg_worst, neg_viol, k, bi, rows, label, h in cands[:MAX_PANELS]:
        p = parts[k]
        full = p.ratio[bi, rows, h, :].float().cpu()
        pooled, rs, cs = _pool(full)
        key = f"{p.name}_b{label}_h{h}"
        arrays[key] = pooled.numpy()
        tm, tn = p.tiles
        panels.append(
            {
                "key": key,
                "tensor": p.name,
                "batch": label,
                "head": h,
                "rows": pooled.shape[0],
                "cols": pooled.shape[1],
                "row_step": rs,
                "col_step": cs,
                "row_axis": "col" if p.layout.level == "key" else "row",
                "n_rows": full.shape[0],
                "n_cols": full.shape[1],
                "max_ratio": -neg_worst,
                "violations": int(-neg_viol),
                "tile_m": tm,
                "tile_n": tn,
            }
        )
    meta = {
        "case": case.name,
        "config": case.as_dict(),
        "tile_m": fwd_tiles[0],
        "tile_n": fwd_tiles[1],
        "panels": panels,
        "omitted_panels": len(cands) - len(panels),
    }
    return ErrorMap(meta, arrays)


def save_map(path: str | Path, *, error_map: ErrorMap) -> Path:
    """Write ``error_map`` as ``numpy.savez_compressed`` (docs/diagnosis.md: key "meta", a 0-d str
    array of JSON, and one float32 array per panel), creating the folder; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays = {k: np.asarray(v, dtype=np.float32) for k, v in error_map.arrays.items()}
    with open(path, "wb") as f:  # a file object: savez would append ".npz" to a name without it
        np.savez_compressed(f, meta=np.array(json.dumps(error_map.meta)), **arrays)
    return path


def load_map(path: str | Path) -> ErrorMap:
    """An error map :func:`save_map` wrote (no pickles: the file may come from anywhere)."""
    with np.load(path, allow_pickle=False) as z:
        meta = json.loads(str(z["meta"][()]))
        return ErrorMap(meta, {k: z[k] for k in z.files if k != "meta"})


# ---- the entry point ------------------------------------------------------------------------------


def diagnose(*, rec: CaseRecord, th: dict, tensors: CaseTensors | None) -> tuple[dict, ErrorMap | None]:
    """(``rec["diagnosis"]``, its error map or None) of a judged case record ``rec`` and its kept
    ``tensors``: per tensor with violating elements ``{"violations", "elements", "criteria",
    "axes", "summary"}`` (docs/diagnosis.md); ``{}`` when the case did not run or nothing
    element-wise fails (a crash, an uncertified reference, a missing gradient)."""
    if rec.get("status") != "ran" or tensors is None or tensors.out is None or rec.get("out") is None:
        return {}, None
    parts = [p for p in _forward_parts(rec, th, tensors) + _backward_parts(rec, th, tensors) if bool(p.mask.any())]
    diag = {}
    for p in parts:
        loc = localize(tensor=p.name, mask=p.mask, layout=p.layout)
        diag[p.name] = {
            "violations": loc["violations"],
            "elements": loc["elements"],
            "criteria": p.criteria,
            "axes": loc["axes"],
            "summary": loc["summary"],
        }
    fwd = forward_tiles(case=tensors.case, numerics=tensors.numerics, kind=tensors.kind)
    return diag, _panels(parts, tensors.case, fwd)
