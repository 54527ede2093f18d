"""Why a failing backward fails: cause hypotheses on the gradients, each tested against the data
(docs/diagnosis.md, "Causes of a failing backward"), ranked with the forward's
(``audits.verdict.causes``) in ``case["diagnosis"]["causes"]``.

Scored as the forward's hypotheses are (``audits.verdict.causes``, module comment), per element
of dq, dk, dv and dsink: *violating*, the kernel is past the element's tolerance from the FP64
gradient (its backward bound where finite, else :data:`FALLBACK_ULPS` ULPs of the element's scale,
the sum of its terms' magnitudes, ``numerics.grad_reference``); *predicted*, the hypothesis'
gradient is past it too; *explained*, violating, predicted, and the kernel within tolerance of the
hypothesis rounded to the gradient's dtype (or NaN where it is NaN; past the dtype's range, its
infinity: a backward that overflows fp16 where the hypothesis does is met).
Score = (explained / violating) x (explained / predicted), over every gradient: a hypothesis
about dq alone explains none of dk's violations.

- ``grad_scale``: one gradient is the FP64 one times a constant c (least squares over its
  violating elements), named when c is a usual factor: 1/softmax_scale (the scale missing, as
  TransformerEngine #3216's dQ), softmax_scale (applied twice), -1 (the sign lost, as a sink
  gradient without d lse / d sink's minus), 0 (never computed).
- ``mask_edge``: the backward's mask differs from the forward's: the gradients recomputed with the
  forward's out and LSE (the FP64 ones) but P taken over a moved mask, the variants of
  ``audits.verdict.causes.edge_variants`` (an edge off by one key, a mask or edge ignored).  The
  recomputation is FA's backward in float64 (``P = exp(s - lse)`` over the backward's visible keys,
  ``D = rowsum(O * dO)``, ``dS = P (dP - D)`` times the softcap's chain factor, ``dq = scale dS K``,
  ``dk = scale dS^T Q``, ``dv = P^T dO`` summed over each kv head's query heads); with the
  forward's own mask it reproduces ``numerics.grad_reference.attention_grad_reference``
  (tests/test_grad_causes.py).
- ``head_mapping``: under GQA, dk and dv taken from one query head of each group instead of
  summed over it (the same recomputation, the group's first head kept).
- ``softcap_chain``: with a softcap, dS without its chain factor (the same recomputation;
  flash-attention #2402).
- ``accum_stride``: a gradient read back from its fp32 accumulator at another row-tile stride
  than it was written at (module comment at :func:`accumulator_read`): production's SM90
  backward at the head dims where ``_flash_attn_bwd`` rounds its accumulators to 32 columns and
  ``FlashAttentionBackwardSm90`` pads its tile to 16 (``fa4.code_paths.sm90_accum_wider``;
  flash-attention PR #2896).
- ``dropped_tile``: a gradient's head-dim columns from some column on never computed (zero),
  as a reduction width the head dim is not a multiple of (flash-attention #2552); or runs of its
  rows (dq's query rows, dk's and dv's keys) zero in every batch and head, as a row tile never
  accumulated or read back from where nothing was written.

``grad_scale``, ``dropped_tile`` and ``accum_stride`` read the gradients alone and are tested on
every case whose backward ran (mods, any size; varlen cases audit the forward only).  The three
that recompute the backward (``mask_edge``, ``head_mapping``, ``softcap_chain``) take
fixed-length cases without mods, of at most :data:`MAX_SCORES` scores; the others get none of
those three (the poisoned re-runs still run)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from audits.verdict.causes import FALLBACK_ULPS, MAX_SCORES, MIN_SCORE, edge_variants, explained, score_of
from audits.verdict.diagnosis import CaseTensors, index_ranges
from audits.verdict.vocabulary import Cause
from fa4.code_paths import pad_to
from numerics.call import AttentionCall
from numerics.metrics import rounded_overflow
from numerics.reference import call_visibility

__all__ = ["grad_causes", "backward_with_mask", "accumulator_read", "GRADS", "ACCUM_TILES", "ACCUM_PADS"]

#: the gradients the hypotheses score, in the order they are named
GRADS = ("dq", "dk", "dv", "dsink")
#: |log c| below this is no constant factor (the gradient is right to rounding, c = 1)
MIN_LOG_FACTOR = 0.005
#: a fitted constant within this relative distance of a named factor is scored as that factor
NAMED_WITHIN = 0.01


@dataclass
class _Scope:
    """The gradients a case's hypotheses are scored on: per name, the kernel's and the FP64
    gradient (float64; the FP64 one as the kernel's dtype holds it), the tolerance, the violating
    and checked masks, the dtype's epsilon, and the kernel's gradient as returned."""

    got: dict[str, torch.Tensor]
    ref: dict[str, torch.Tensor]
    tol: dict[str, torch.Tensor]
    viol: dict[str, torch.Tensor]
    checked: dict[str, torch.Tensor]
    eps: dict[str, float]
    kernel: dict[str, torch.Tensor]  # the kernel's gradients as returned (their dtype's range)

    def violating(self) -> int:
        return sum(int(v.sum()) for v in self.viol.values())


def _scope(t: CaseTensors) -> _Scope | None:
    """The gradients with a result and an FP64 reference of the same shape; None when none
    violates its tolerance."""
    sc = _Scope({}, {}, {}, {}, {}, {}, {})
    for n in GRADS:
        g, r = (t.grads or {}).get(n), (t.grad_refs or {}).get(n)
        if g is None or r is None or g.shape != r.shape:
            continue
        # the reference as the gradient's dtype holds it, as the gate compares it: past its range,
        # the infinity it rounds to (numerics.metrics.rounded_overflow)
        kernel, (r, _) = g, rounded_overflow(r, g)
        g = g.double()
        eps = float(torch.finfo(t.grads[n].dtype).eps) if t.grads[n].dtype.is_floating_point else 2.0**-8
        scale = (t.grad_refs or {}).get(f"{n}_scale")
        scale = scale.double().abs() if scale is not None and scale.shape == r.shape else r.abs()
        tol = FALLBACK_ULPS * eps * torch.where(torch.isfinite(scale), scale, torch.zeros_like(scale)) + 1e-300
        bound = (t.grad_bounds or {}).get(n)
        if bound is not None and bound.shape == r.shape:
            b = bound.double()
            tol = torch.where(torch.isfinite(b), torch.maximum(b, tol), tol)
        fin = torch.isfinite(r)
        sc.got[n], sc.ref[n], sc.tol[n], sc.eps[n], sc.checked[n] = g, r, tol, eps, fin
        sc.kernel[n] = kernel
        sc.viol[n] = fin & ~((g - r).abs() <= tol)
    return sc if sc.violating() else None


def _counts(sc: _Scope, hyp: dict[str, torch.Tensor]) -> tuple[int, int, int]:
    """(explained, violating, predicted) over every gradient of the scope; ``hyp``: the
    hypothesis' gradients (a gradient it leaves out is the FP64 one: it predicts no change)."""
    e = v = p = 0
    for n in sc.got:
        v += int(sc.viol[n].sum())
        h = hyp.get(n)
        if h is None:
            continue
        h, _ = rounded_overflow(h, sc.kernel[n])  # as the reference: past the dtype's range, its infinity
        expl, pred = explained(sc.got[n], sc.ref[n], h, sc.tol[n], sc.viol[n], sc.checked[n], sc.eps[n])
        e += int(expl.sum())
        p += int(pred.sum())
    return e, v, p


def _evidence(what: str, counts: tuple[int, int, int]) -> str:
    e, v, p = counts
    return (
        f"the FP64 gradients {what} match {e:,} of the {v:,} violating gradient elements ({e / v:.0%}), "
        f"and the kernel follows them at {e / p:.0%} of the {p:,} elements they move"
    )


# ---- grad_scale ----------------------------------------------------------------------------------


def _named_factors(call: AttentionCall, d: int) -> list[tuple[float, str]]:
    """(factor, words) of the usual constant factors a gradient can be off by."""
    scale = call.scale(d)
    inv, once = (f"sqrt({d})", f"1/sqrt({d})") if call.softmax_scale is None else (f"{1 / scale:.4g}", f"{scale:.4g}")
    return [
        (0.0, "never computed: zero"),
        (-1.0, "the sign flipped"),
        (1.0 / scale, f"1/softmax_scale = {inv}: the softmax scale missing"),
        (scale, f"softmax_scale = {once}: the softmax scale applied twice"),
        (2.0, "doubled"),
        (0.5, "halved"),
    ]


def _grad_scale(sc: _Scope, call: AttentionCall, d: int) -> Cause | None:
    best = None
    for n in sc.got:
        m = sc.viol[n] & torch.isfinite(sc.got[n])
        if not bool(m.any()):
            continue
        g, r = sc.got[n][m], sc.ref[n][m]
        den = float((r * r).sum())
        if not den or not math.isfinite(den):
            continue
        c = float((g * r).sum()) / den
        if not math.isfinite(c):
            continue
        name = ""
        for f, words in _named_factors(call, d):
            if abs(c - f) <= NAMED_WITHIN * max(abs(f), 1e-3):
                c, name = f, words
                break
        if not name and (c == 0 or abs(math.log(abs(c))) < MIN_LOG_FACTOR):
            continue
        counts = _counts(sc, {n: sc.ref[n] * c})
        s = score_of(counts)
        if s > 0 and (best is None or s > best.score):
            detail = f"{n} times {c:.4g}" + (f" ({name})" if name else "")
            if c == 0:
                detail = f"{n} is zero: never computed"
            best = Cause("grad_scale", detail, _evidence(f"with {n} times {c:.4g}", counts), s)
    return best


# ---- mask_edge in the backward -------------------------------------------------------------------


def backward_with_mask(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    call: AttentionCall,
    visible: torch.Tensor,
    group_reduce: str = "sum",
    chain: bool = True,
) -> dict[str, torch.Tensor]:
    """FA's backward in float64 (module doc) from the forward's ``out`` (b, sq, hq, dv) and ``lse``
    (b, hq, sq), with P over the keys ``visible`` ((sq, sk) bool) instead of the call's: dq, dk,
    dv in the inputs' layouts.  A row whose LSE is not finite contributes nothing.
    ``group_reduce``: "sum" (dk, dv summed over each kv head's query heads, as they must be) or
    "first" (taken from the group's first query head alone); ``chain``: dS times the softcap's
    chain factor (False: without it, flash-attention #2402)."""
    q64, k64, v64, do64 = (x.double() for x in (q, k, v, do))
    b, sq, hq, d = q64.shape
    hk = k64.shape[2]
    g = hq // hk
    kx = k64.repeat_interleave(g, dim=2)  # (b, sk, hq, d): query head h reads kv head h // g
    vx = v64.repeat_interleave(g, dim=2)
    scale = call.scale(d)
    r = torch.einsum("bihd,bjhd->bhij", q64, kx) * scale
    factor = None
    if call.softcap:
        s = call.softcap * torch.tanh(r / call.softcap)
        factor = torch.cosh(r / call.softcap) ** -2 if chain else None
    else:
        s = r
    l64 = lse.double()[..., None]
    p = torch.where(visible.to(q.device) & torch.isfinite(l64), torch.exp(s - l64), torch.zeros_like(s))
    delta = torch.einsum("bihc,bihc->bhi", out.double(), do64)[..., None]
    dp = torch.einsum("bihc,bjhc->bhij", do64, vx)
    ds = p * (dp - delta)
    if factor is not None:
        ds = ds * factor
    dq = torch.einsum("bhij,bjhd->bihd", ds, kx) * scale
    dkx = torch.einsum("bhij,bihd->bjhd", ds, q64) * scale
    dvx = torch.einsum("bhij,bihc->bjhc", p, do64)
    sk = k64.shape[1]
    reduce = (lambda z: z.sum(3)) if group_reduce == "sum" else (lambda z: z[:, :, :, 0])
    dk = reduce(dkx.reshape(b, sk, hk, g, d))
    dv = reduce(dvx.reshape(b, sk, hk, g, -1))
    return {"dq": dq, "dk": dk, "dv": dv}


def _vis(t: CaseTensors, call: AttentionCall) -> torch.Tensor:
    case = t.case
    vis = call_visibility(
        batch=1, heads=1, seqlen_q=case.seqlen_q, seqlen_k=case.seqlen_k, call=call, device=t.inputs["q"].device
    )
    return vis.reshape(case.seqlen_q, case.seqlen_k)


def _recomputed(t: CaseTensors, call: AttentionCall, visible: torch.Tensor | None = None, **kw) -> dict | None:
    """:func:`backward_with_mask` on the case's inputs, from the forward's FP64 out and LSE and the
    dO the kernel's backward got, with P over ``visible`` (the call's own mask when None) and
    ``kw`` (``group_reduce``, ``chain``); None without the forward's references."""
    out, lse, do = (t.grad_refs or {}).get("out"), (t.grad_refs or {}).get("lse"), t.grad_output
    if out is None or lse is None or do is None:
        return None
    x = t.inputs
    visible = _vis(t, call) if visible is None else visible
    return backward_with_mask(x["q"], x["k"], x["v"], do, out, lse, call=call, visible=visible, **kw)


def _head_mapping(sc: _Scope, t: CaseTensors, call: AttentionCall) -> Cause | None:
    """GQA: dk and dv from one query head of each group, not summed over the group."""
    g = t.case.heads_q // t.case.heads_kv
    if g < 2 or (hyp := _recomputed(t, call, group_reduce="first")) is None:
        return None
    hyp.pop("dq")  # dq is per query head: this hypothesis leaves it as it is
    counts = _counts(sc, hyp)
    s = score_of(counts)
    if s <= 0:
        return None
    detail = f"in the backward only: dk and dv from the first query head of each group of {g}, not summed over it"
    return Cause(
        "head_mapping", detail, _evidence("with dk and dv taken from each group's first query head", counts), s
    )


def _mask_edge(sc: _Scope, t: CaseTensors, call: AttentionCall) -> Cause | None:
    best = None
    for window, detail in edge_variants(t.case, call):
        hyp = _recomputed(t, call, _vis(t, replace(call, causal=False, window_size=window)))
        if hyp is None:
            return None
        counts = _counts(sc, hyp)
        s = score_of(counts)
        if s > 0 and (best is None or s > best.score):
            what = f"recomputed with the backward's P over the window (left, right) = {window}, the forward's kept"
            best = Cause("mask_edge", f"in the backward only: {detail}", _evidence(what, counts), s)
    return best


def _softcap_chain(sc: _Scope, t: CaseTensors, call: AttentionCall) -> Cause | None:
    """With a softcap: dS not multiplied by the chain factor 1 - tanh^2(r / cap)."""
    if not call.softcap or (hyp := _recomputed(t, call, chain=False)) is None:
        return None
    counts = _counts(sc, hyp)
    s = score_of(counts)
    if s <= 0:
        return None
    detail = f"in the backward only: dS without the softcap's chain factor 1 - tanh^2(r / {call.softcap:g})"
    return Cause("softcap_chain", detail, _evidence("without the softcap's chain factor", counts), s)


def _dropped_columns(sc: _Scope) -> Cause | None:
    """A gradient's trailing head-dim columns never computed: zero where the FP64 gradient is not,
    from a column on (a reduction width the head dim is not a multiple of, flash-attention #2552)."""
    best = None
    for n, g in sc.got.items():
        # (b, s, h, dim) or, packed (varlen), (total, h, dim); dsink (h,) has no head-dim columns
        if n == "dsink" or g.dim() < 3 or not bool(sc.viol[n].any()):
            continue
        zero = ((g == 0) | ~sc.checked[n]).flatten(0, -2).all(0)  # (dim,): the column is zero everywhere
        moved = sc.viol[n].flatten(0, -2).any(0)
        width = g.shape[-1]
        c0 = width
        while c0 > 0 and bool(zero[c0 - 1]):
            c0 -= 1
        if c0 == width or not bool(moved[c0:].any()):
            continue
        hyp = sc.ref[n].clone()
        hyp[..., c0:] = 0.0
        counts = _counts(sc, {n: hyp})
        s = score_of(counts)
        if s > 0 and (best is None or s > best.score):
            detail = f"{n} columns {c0}..{width - 1} (the head dim from {c0} on) never computed: zero"
            best = Cause("dropped_tile", detail, _evidence(f"with {n}'s columns {c0}..{width - 1} zero", counts), s)
    return best


def _dropped_rows(sc: _Scope) -> Cause | None:
    """A gradient's rows (query rows of dq, keys of dk and dv) never computed: zero in every batch,
    head and head-dim column where the FP64 gradient is not, as a row tile whose accumulator was
    never added to or is read back where nothing was written (production's SM90 dq at d = 8, where
    ``_flash_attn_bwd`` reads ``dq_accum`` at the head dim rounded to 32 while the kernel writes it
    padded to 16: ``fa4.code_paths.sm90_accum_wider``)."""
    best = None
    for n, g in sc.got.items():
        if n == "dsink" or g.dim() != 4 or not bool(sc.viol[n].any()):
            continue
        zero = ((g == 0) | ~sc.checked[n]).all(-1).all(-1).all(0)  # (s,): the row is zero everywhere
        hit = zero & sc.viol[n].any(-1).any(-1).any(0)  # zero rows holding a violation
        if not bool(hit.any()):
            continue
        # the maximal runs of zero rows holding a violation, whole: runs numbered from their first row
        run = torch.cumsum(zero & ~torch.cat([zero.new_zeros(1), zero[:-1]]), 0)
        keep = zero & torch.isin(run, run[hit])
        hyp = sc.ref[n].clone()
        hyp[:, keep] = 0.0
        counts = _counts(sc, {n: hyp})
        s = score_of(counts)
        if s > 0 and (best is None or s > best.score):
            what = "rows" if n == "dq" else "keys"
            span = index_ranges(torch.nonzero(keep).flatten().tolist())
            detail = f"{n} {what} {span} (every batch and head) never computed: zero"
            best = Cause("dropped_tile", detail, _evidence(f"with {n}'s {what} {span} zero", counts), s)
    return best


# ---- accum_stride ---------------------------------------------------------------------------------

#: the row tiles (query rows of dq, keys of dk and dv) an accumulator's tiles can hold: SM90's
#: backward tiles (``_tile_size_bwd_sm90``: 64 or 128 query rows, 80 or 128 keys) and 96
ACCUM_TILES = (64, 80, 96, 128)
#: the granularities a tile's columns are padded to: the kernel's tile (16), the accumulator's
#: allocation (32, 64 with dKV_swapAB): ``fa4.code_paths.hdim_multiple`` and ``sm90_accum_wider``
ACCUM_PADS = (8, 16, 32, 64)


def accumulator_read(ref: torch.Tensor, *, tile: int, written: int, read: int) -> torch.Tensor:
    """A gradient (b, s, h, w) as a kernel returns it when it writes row tile t of ``tile`` rows
    into a flat fp32 accumulator per (batch, head) at offset ``t * tile * written``, column-major
    within the tile (element (r, c) at ``c * tile + r``; columns ``w..written-1`` zero padding),
    and reads tile t back at ``t * tile * read``: the element read for (t * tile + r, c) is
    the one written at that flat offset, zero past everything written (the accumulator is
    allocated at the reader's size and zero-filled: ``flash_bwd_preprocess.py``).

    With ``read - written`` = 16 and ``tile`` 64 this is production's dq on SM90 at the head dims
    ``fa4.code_paths.sm90_accum_wider`` names: row tile 1 shifted 16 columns left (column c holds
    the FP64 dq's column c + 16), its last 16 columns zero, and at d = 8 all of it zero (H200,
    2026-12-05, flash-attn-4 4.0.0b40; under GQA dk and dv alike, their accumulators the same
    width).  Column-major and 8-column chunks predict the same shifts (multiples of 8 columns),
    so the data cannot tell them apart; the shift is what is tested."""
    b, s, h, w = ref.shape
    n_tiles = -(-s // tile)
    buf = ref.new_zeros(b, h, n_tiles, written, tile)  # the accumulator as written, per (batch, head)
    padded = ref.new_zeros(b, n_tiles * tile, h, w)
    padded[:, :s] = ref
    buf[..., :w, :] = padded.reshape(b, n_tiles, tile, h, w).permute(0, 3, 1, 4, 2)
    flat = buf.reshape(b, h, -1)
    rows = torch.arange(s, device=ref.device)
    t, r = rows // tile, rows % tile
    cols = torch.arange(w, device=ref.device)
    at = t[:, None] * tile * read + cols[None, :] * tile + r[:, None]  # (s, w): the flat offset read
    inside = at < flat.shape[-1]
    got = flat[:, :, at.clamp(max=flat.shape[-1] - 1)]  # (b, h, s, w)
    got = torch.where(inside, got, torch.zeros_like(got))
    return got.permute(0, 2, 1, 3)


def _finite(t: torch.Tensor) -> torch.Tensor:
    return torch.nan_to_num(t, nan=0.0, posinf=0.0, neginf=0.0)


def _accum_stride(sc: _Scope) -> Cause | None:
    """The gradients (dq, dk, dv: each alone, and together, as GQA's share their widths) read
    back at another row-tile stride than written (:func:`accumulator_read`): over the tiles of
    :data:`ACCUM_TILES`, each gradient's head dim padded to two granularities of
    :data:`ACCUM_PADS` (written at the finer, read at the coarser); gradients of at most
    ``MAX_SCORES`` elements (the accumulator is materialized per hypothesis).  Where several pairs fit
    alike (every tile after the first read from past everything written: all zero), the detail
    says so instead of picking one."""
    names = [
        n
        for n in ("dq", "dk", "dv")
        if n in sc.ref and sc.ref[n].dim() == 4 and sc.ref[n].numel() <= MAX_SCORES and bool(sc.viol[n].any())
    ]
    reads: dict[tuple, torch.Tensor] = {}  # (name, tile, written, read) -> the gradient so read
    fits = {}  # (tile, ((name, written, read), ...)) -> (score, (fine, coarse), counts)
    for tile in ACCUM_TILES:
        for fine in ACCUM_PADS:
            for coarse in ACCUM_PADS:
                if coarse <= fine:
                    continue
                hyps = {}
                for n in names:
                    s, w = sc.ref[n].shape[1], sc.ref[n].shape[-1]
                    if tile < s and pad_to(w, fine) != pad_to(w, coarse):  # one tile: its offset is 0 at any stride
                        hyps[n] = (pad_to(w, fine), pad_to(w, coarse))
                subsets = [[n] for n in hyps] + ([list(hyps)] if len(hyps) > 1 else [])
                for sub in subsets:
                    key = (tile, tuple((n, *hyps[n]) for n in sub))
                    if key in fits:
                        continue  # the same widths from coarser pads: the same hypothesis
                    for n in sub:
                        if (n, tile, *hyps[n]) not in reads:
                            w, r = hyps[n]
                            reads[(n, tile, w, r)] = accumulator_read(_finite(sc.ref[n]), tile=tile, written=w, read=r)
                    pred = {n: reads[(n, tile, *hyps[n])] for n in sub}
                    counts = _counts(sc, pred)
                    fits[key] = (score_of(counts), (fine, coarse), counts)
    fits = {k: v for k, v in fits.items() if v[0] > 0}
    if not fits:
        return None
    top = max(v[0] for v in fits.values())
    # of the best, the most gradients first, then the smallest tile and paddings
    (tile, widths), (score, (fine, coarse), counts) = min(
        ((k, v) for k, v in fits.items() if v[0] >= top - 0.005), key=lambda kv: (-len(kv[0][1]), kv[0][0], kv[1][1])
    )
    which = tuple(n for n, _, _ in widths)
    alike = [k[1] for k, v in fits.items() if v[0] >= top - 0.005 and k[0] == tile and len(k[1]) == len(widths)]
    alike = [a for a in alike if tuple(n for n, _, _ in a) == which]
    grads = " and ".join(which) if len(which) < 3 else "dq, dk and dv"
    its = "its accumulator" if len(which) == 1 else "their accumulators"
    unit = "rows" if which == ("dq",) else "keys" if "dq" not in which else "rows (keys for dk, dv)"
    if len(alike) > 1:
        pairs = ", ".join(sorted({f"{a[0][1]}/{a[0][2]}" for a in alike}, key=lambda t: tuple(map(int, t.split("/")))))
        detail = (
            f"{grads}: every tile of {tile} {unit} after the first read back from past everything written to "
            f"{its} (zero): read at a wider stride than written; widths {pairs} (written/read) "
            "fit alike"
        )
    else:
        shapes = sorted({(sc.ref[n].shape[-1], a, b) for n, a, b in widths})
        if len(shapes) == 1:
            ((w, a, b),) = shapes
            stride = f"{tile} {unit} x {b} columns, written at {tile} x {a} (head dim {w})"
        else:
            dims = "; ".join(f"head dim {w}: {a} written, {b} read" for w, a, b in shapes)
            stride = f"{tile} {unit} x the width read, written at the width written ({dims})"
        shifts = {b - a for _, a, b in widths}
        shift = f"{shifts.pop()} columns" if len(shifts) == 1 else "(the width read - the width written) columns"
        detail = (
            f"{grads} read back from {its} at a stride of {stride}: tile t read t x {shift} past its own, "
            "zero past the last tile written"
        )
    sizes = ", ".join(sorted({f"{a} wide and read {b} wide" for _, a, b in widths}))
    what = f"with {grads} written in tiles of {tile} {unit.split()[0]} {sizes}"
    if len(alike) > 1:
        what += " (or any of the widths alike)"
    return Cause("accum_stride", detail, _evidence(what, counts), score)


# ---- the entry point -----------------------------------------------------------------------------


def grad_causes(*, tensors: CaseTensors, rec: dict) -> list[Cause]:
    """The gradient hypotheses a failing backward's data bears out (module doc), each at least
    ``MIN_SCORE``, unranked (``audits.verdict.causes.rank_causes`` ranks them with the rest); []
    when the backward did not run or nothing is past its tolerance.  The hypotheses that recompute
    the backward are left out where this module does not recompute it (varlen, mods, more than
    ``MAX_SCORES`` scores)."""
    t = tensors
    b = rec.get("backward") or {}
    if b.get("status") != "ran" or t is None or t.inputs is None or not t.grads or not t.grad_refs:
        return []
    case = t.case
    call = AttentionCall.from_kwargs(**t.inputs["kw"])
    recomputes = not (
        case.varlen
        or call.score_mod is not None
        or call.has_mask_mods
        or case.batch * case.heads_q * case.seqlen_q * case.seqlen_k > MAX_SCORES
    )
    with torch.no_grad():
        sc = _scope(t)
        if sc is None:
            return []
        found = [_grad_scale(sc, call, case.d), _dropped_columns(sc), _dropped_rows(sc), _accum_stride(sc)]
        if recomputes:
            found += [_mask_edge(sc, t, call), _head_mapping(sc, t, call), _softcap_chain(sc, t, call)]
    return [c for c in found if c is not None and c.score >= MIN_SCORE]
