"""The forward's loop over KV blocks, steps 1-9 of ``fa4.model``'s module doc: S = Q K^T per
block (float64 from the exact inputs, rounded once; or the tensor cores' sum,
``numerics.tensor_core``), the per-row arithmetic of ``fa4.forward_steps``, P V into the
accumulator, each row over the blocks of its range from the last to the first
(``flash_fwd_sm90.py`` ``mma``, the SM100 softmax loop).  :func:`attention_forward` adds the
epilogue (step 10): it is ``fa4.model.attention`` without the input checks and autograd.

On CPU the loop runs fast (numba) and gives the bits of the plain loop — every row of every block
through the torch functions of steps 3-9, S and P V by einsums over all rows: a block's float64
GEMMs cover only a window of the rows that visit it (:func:`_row_window`; MKL gives each row the
same float64 sum then), steps 3-8 and step 9's accumulator run as compiled loops
(``fa4.ex2_cpu.softmax_block`` and ``o_update``, on torch's OpenMP team) that hand back to the
torch functions every row they cannot decide exactly (a NaN; a float64 intermediate within a few
ulps of a float32 rounding boundary); :func:`_run_fast` drives them.  A mask_mod or block sparsity takes the
plain loop (visibility per element, visit order per tile); a score_mod alone keeps the fast loop
(its step 2 is in :meth:`_Loop.scores`, before the compiled step).  ``docs/performance.md``: the
profile and the argument; ``tests/test_model_speed_bits.py``: the fast loop against the plain one,
bit for bit.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import numpy as np
import torch

from fa4.block_sparse import sparse_steps
from fa4.ex2 import POLY_EX2
from fa4.forward_steps import RowState, apply_softcap, finalize, o_rows, pad_mask, softmax_rows
from fa4.knobs import FA4Numerics
from fa4.primitives import FP8 as _FP8
from fa4.primitives import LOG2_E as _LOG2_E
from fa4.primitives import apply_mask_mod, apply_score_mod, visible_bounds
from fa4.primitives import scales as _scales
from numerics.fp import format_of
from numerics.fp import to_f32 as _f32
from numerics.mods import BlockSparse, MaskMod, ScoreMod, index_grid
from numerics.tensor_core import tc_dot
from numerics.tiles import block_ranges, masked_blocks

__all__ = ["attention_forward", "forward_loop", "FwdMods", "kv_block_ranges"]


def kv_block_ranges(
    sq: int, sk: int, nm: FA4Numerics, causal: bool, window: tuple, device, *, heads: int = 1, pack: int = 1
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``numerics.tiles.block_ranges`` with the tiles of ``nm``: the KV blocks each query tile
    visits.  Public for ``fa4.varlen``, whose tiles (pack_gqa, split-KV) need the same ranges."""
    return block_ranges(sq, sk, nm.tile_m, nm.tile_n, causal, window, device, heads=heads, pack=pack)


#: CPU: the fast loop (row windows, the compiled softmax step of ``fa4.ex2_cpu``); tests turn it
#: off to compare with the plain loop, which runs every row of every block through torch
_FAST_CPU = True
#: a block's row window starts and ends at multiples of this (or at seqlen_q): see :func:`_row_window`
_ROW_GRANULE = 192


@dataclass
class _Loop:
    """What the KV blocks of :func:`forward_loop` share.  ``fast``: q, k, v held head-major
    (b, heads, seqlen, d) for ``torch.matmul`` over row windows and the compiled softmax step;
    else (b, seqlen, heads, d) for the einsums over all rows, and the softmax step in torch."""

    nm: FA4Numerics
    fast: bool
    q64: torch.Tensor
    k64: torch.Tensor
    v64: torch.Tensor
    vis: tuple  # (lo, hi), each (sq,) int64: the keys [lo, hi) a row may see (visible_bounds)
    sk: int
    ranges: tuple  # n_min, n_max, m_hi, m_lo: (heads_q, sq) int64
    scale: float
    softcap: float
    sl2_t: torch.Tensor
    off: torch.Tensor
    p_dtype: torch.dtype
    compiled: dict | None = None  # fast: the block-independent arguments of the compiled step
    bufs: dict | None = None  # fast: flat float64 storage reused by every block (no page faults)
    mods: FwdMods | None = None  # the call's mods (``fa4.model`` module doc, "Mods")

    def buffer(self, name: str, shape: tuple) -> torch.Tensor:
        """A contiguous float64 tensor of ``shape`` (fast: carved from the reused storage)."""
        if self.bufs is None:
            return torch.zeros(shape, dtype=torch.float64, device=self.q64.device)
        return self.bufs[name][: math.prod(shape)].view(shape)

    def scores(self, j0: int, j1: int, r0: int, r1: int) -> torch.Tensor:
        """Steps 1-2 for keys [j0, j1) and rows [r0, r1): (b, heads_q, rows, nc), float64 S (its
        float32 rounding is the consumer's) or, with softcap or a score_mod, float32."""
        if self.nm.mma == "tensor_core":  # the plain loop's layout (b, seqlen, heads, d)
            q_ = self.q64.permute(0, 2, 1, 3).unsqueeze(3)
            k_ = self.k64[:, j0:j1].permute(0, 2, 1, 3).unsqueeze(2)
            s = tc_dot(q_, k_).double()  # step 1 as the tensor cores sum it
        elif self.fast:
            q, k = self.q64[:, :, r0:r1], self.k64[:, :, j0:j1].transpose(-1, -2)
            s = torch.matmul(q, k, out=self.buffer("s", (*q.shape[:3], j1 - j0)))  # step 1
        else:
            s = torch.einsum("bihd,bjhd->bhij", self.q64, self.k64[:, j0:j1])  # step 1
        if self.mods is not None and self.mods.score_mod is not None:  # step 2: apply_score_mod_inner
            idx = index_grid(s.shape[0], s.shape[1], 0, 0, rows=range(r0, r1), keys=range(j0, j1), device=s.device)
            return apply_score_mod(s.float(), self.scale, self.mods.score_mod, idx, self.mods.aux)[1]
        return apply_softcap(s.float(), self.scale, self.softcap) if self.softcap > 0 else s  # step 2

    def pv(self, p64: torch.Tensor, j0: int, j1: int) -> torch.Tensor:
        """Step 9's MMA, the block's real columns: (b, heads_q, rows, dv) float64."""
        if self.fast:
            out = self.buffer("pv", (*p64.shape[:3], self.v64.shape[-1]))
            return torch.matmul(p64[..., : j1 - j0], self.v64[:, :, j0:j1], out=out)
        return torch.einsum("bhij,bjhd->bhid", p64[..., : j1 - j0], self.v64[:, j0:j1])


def _row_window(act: torch.Tensor, sq: int, fast: bool) -> tuple[int, int]:
    """The rows [r0, r1) a block computes: all of them (the plain loop), or (fast) a window
    around the rows of any head that visit it, its ends at multiples of ``_ROW_GRANULE`` or at
    seqlen_q and at least that many rows from the end.  Why: MKL's float64 GEMM sums a row's
    d products in an order that can depend on where the row sits in the call (rows in groups
    from the call's first one; a final partial group, M < 4 taken apart) and on the thread
    split, and S is its float64 result rounded once.  A window whose ends fall on multiples of
    192 (= 3 * 64) reproduced every float64 bit of the all-rows call on adversarial inputs (wide
    exponent ranges, inexact sums) under 1 to 16 threads on AMD EPYC and Intel Xeon;
    ``tests/test_model_speed_bits.py`` checks the fast loop against the plain one where it runs."""
    if not fast:
        return 0, sq
    rows = act.any(0).nonzero()
    g = _ROW_GRANULE
    r0, r1 = int(rows[0]) // g * g, min(sq, -(-(int(rows[-1]) + 1) // g) * g)
    if r1 == sq and 0 < r0 and sq - r0 < g:
        r0 -= g
    return r0, r1


@dataclass(frozen=True)
class _Block:
    """KV block ``n`` (keys [j0, j1)) on the window of rows [r0, r1)."""

    n: int
    j0: int
    j1: int
    r0: int
    r1: int

    def rows_of(self, idx: torch.Tensor, hq: int, sq: int):
        """For window rows ``idx`` (flat over (b, heads_q, window)): their flat state row
        (b * heads_q * sq), flat (head, row) index and row within the window."""
        bh, r = idx // (self.r1 - self.r0), idx % (self.r1 - self.r0)
        return bh * sq + self.r0 + r, (bh % hq) * sq + self.r0 + r, r


def _torch_rows(
    st: RowState, lp: _Loop, s: torch.Tensor, blk: _Block, idx, p64, acc, first, masked=None, hw_rows=None
) -> None:
    """Steps 3-8 in torch on window rows ``idx`` (the plain loop: every active row; the fast
    loop: those its compiled step left), written into the state and the block's buffers.
    With a mask_mod: ``masked`` (bool, flat over the block's (b, heads_q, window rows); None: all
    rows) says where this block applies it; ``hw_rows`` (same layout) which rows run this block
    as a masked iteration (``masked_exp2="hardware"``; None: the flag rule)."""
    nm, tn = lp.nm, lp.nm.tile_n
    nc = blk.j1 - blk.j0
    f, hr, r = blk.rows_of(idx, st.row_max.shape[1], st.row_max.shape[2])
    col = torch.arange(blk.j0, blk.j1, device=s.device)
    vis = (col >= lp.vis[0][blk.r0 + r, None]) & (col < lp.vis[1][blk.r0 + r, None])  # visible_bounds' rule
    if hw_rows is not None and nm.arch == "sm100":
        # softmax_block_sparse_sm100_list runs the full list's inner blocks with mask_fn=None: not even
        # the causal / window flags mask them (SM90's consume_block_sparse_loads keeps the flags there)
        vis = vis | ~hw_rows[idx, None]
    if lp.mods is not None and lp.mods.mask_mod is not None:
        b, hq = st.row_max.shape[:2]
        grid = index_grid(b, hq, 0, 0, rows=range(blk.r0, blk.r1), keys=range(blk.j0, blk.j1), device=s.device)
        mm = apply_mask_mod(lp.mods.mask_mod, grid, lp.mods.aux).expand(b, hq, blk.r1 - blk.r0, nc)
        mm = mm.reshape(-1, nc)[idx]
        vis = vis & (mm if masked is None else (mm | ~masked[idx, None]))  # mask.py: the mask_mod branch
    sc = pad_mask(s.reshape(-1, nc)[idx].float(), vis, tn)  # step 3
    hw = None
    if nm.masked_exp2 == "hardware" and lp.mods is not None and lp.mods.per_element:
        hw = torch.ones_like(idx, dtype=torch.bool) if hw_rows is None else hw_rows[idx]
    elif nm.masked_exp2 == "hardware":
        m_hi, m_lo = (x.reshape(-1)[hr] for x in lp.ranges[2:])
        hw = (blk.n >= m_hi) | (blk.n < m_lo) | (nc < tn)
    rm, rs, pt, sd = st.row_max.view(-1), st.row_sum.view(-1), st.partial.view(-1, 4), st.started.view(-1)
    out = softmax_rows(sc, rm[f], sd[f], rs[f], pt[f], hw, nm, lp.p_dtype, lp.sl2_t, lp.off)  # steps 4-8
    rm[f], rs[f], pt[f], acc[idx], first[idx] = out[:5]
    sd[f] = True
    p64.view(-1, tn)[idx] = out[5]


def _compiled_args(nm: FA4Numerics, p_dtype, sl2: float, vis, ranges) -> dict:
    """The block-independent arguments of ``fa4.ex2_cpu.softmax_block`` for these numerics."""
    from fa4 import ex2_cpu  # lazy: numba (about 0.15 s to import), needed only by the CPU fast loop

    emu = nm.emulated_mask()
    fmt = format_of(p_dtype)
    lp = [p_dtype != torch.bfloat16, fmt.p, fmt.emin, p_dtype in _FP8, p_dtype != torch.float8_e4m3fn]
    return dict(
        tab=tuple(x.contiguous().numpy() for x in (*vis, *ranges)),
        poly=(emu.nonzero().flatten().numpy(), ex2_cpu.padded(POLY_EX2[nm.poly_degree])),
        fp=np.array([sl2, nm.max_offset, -nm.rescale_threshold], dtype=np.float32),
        lp=np.array(lp, dtype=np.int64),
        maxv=float(fmt.max),
        flags=(nm.masked_exp2 == "hardware", nm.rescale_threshold > 0, nm.arch == "sm90", not emu.any(), not emu.all()),
    )


def _compiled_rows(st: RowState, lp: _Loop, blk: _Block, s: torch.Tensor):
    """Steps 3-8 for the block's window in ``fa4.ex2_cpu.softmax_block``.  Returns the block's
    geometry (for :func:`_accumulate`), P (float64, the MMA's operand), the accumulator scale,
    first and each row's status (1 done, 2 left to :func:`_torch_rows`)."""
    from fa4 import ex2_cpu  # lazy: numba (about 0.15 s to import), needed only by the CPU fast loop

    b, hq, sq = st.row_max.shape
    tn, nc, nr = lp.nm.tile_n, blk.j1 - blk.j0, blk.r1 - blk.r0
    kw = lp.compiled
    masked_hw, lazy, sm90, no_emu, some_hw = kw["flags"]
    geo = np.array([nr, blk.r0, hq, blk.n, masked_hw, nc < tn, lazy, sm90, no_emu, some_hw, blk.j0], dtype=np.int64)
    p64 = lp.buffer("p", (b, hq, nr, tn))  # every row the GEMM reads is written
    acc, first = torch.empty(b * hq * nr, dtype=torch.float32), torch.empty(b * hq * nr, dtype=torch.bool)
    status = torch.empty(b * hq * nr, dtype=torch.uint8)
    state = (st.row_max.view(-1, sq), st.row_sum.view(-1, sq), st.started.view(-1, sq), st.partial.view(-1, sq, 4))
    ex2_cpu.softmax_block(
        s.reshape(-1, nc).numpy(),
        geo,
        kw["tab"],
        kw["poly"],
        kw["fp"],
        kw["lp"],
        kw["maxv"],
        tuple(x.numpy() for x in state),
        (p64.view(-1, tn).numpy(), acc.numpy(), first.numpy(), status.numpy()),
    )
    return geo, p64, acc, first, status


def _accumulate(st: RowState, pv, blk: _Block, acc, first, geo, status, idx) -> None:
    """Step 9's accumulator on the block's rows: compiled (``geo`` given) on the rows it
    completed, torch on ``idx`` and on the rows the compiled update leaves (a NaN)."""
    from fa4 import ex2_cpu  # lazy: numba (about 0.15 s to import), needed only by the CPU fast loop

    hq, sq, dv = st.row_max.shape[1], st.row_max.shape[2], st.acc_o.shape[-1]
    pv = pv.reshape(-1, dv)
    if geo is not None:
        ao = st.acc_o.view(-1, sq, dv)
        args = (pv.numpy(), ao.numpy(), geo, acc.numpy(), first.numpy(), status.numpy())
        ex2_cpu.o_update(*args)
        idx = (status >= 2).nonzero().flatten()
    if idx.numel():
        f = blk.rows_of(idx, hq, sq)[0]
        ao = st.acc_o.view(-1, dv)
        ao[f] = o_rows(ao[f], acc[idx], pv[idx], first[idx])


def _accumulate_tc(st: RowState, lp: _Loop, p64, blk: _Block, acc, first, idx) -> None:
    """Step 9 with ``mma="tensor_core"``: the P V MMA takes the rescaled accumulator
    fl32(O * acc_scale) (0 on a row's first block) as its C, and sums C and the block's products
    in k16 instructions as measured on the H200 (``numerics.tensor_core``)."""
    hq, sq, dv = st.row_max.shape[1], st.row_max.shape[2], st.acc_o.shape[-1]
    f = blk.rows_of(idx, hq, sq)[0]
    ao = st.acc_o.view(-1, dv)
    c = torch.where(first[idx].unsqueeze(-1), torch.zeros_like(ao[f]), ao[f] * acc[idx].unsqueeze(-1))
    nc = blk.j1 - blk.j0
    p = p64.view(-1, p64.shape[-1])[idx, :nc]  # (rows, nc)
    v = lp.v64[:, blk.j0 : blk.j1].permute(0, 2, 3, 1).reshape(-1, dv, nc)  # (b * heads, dv, nc)
    # idx is ascending, so each (batch, head)'s rows are one run: one MMA call per run, V shared
    ends = torch.searchsorted(idx // (blk.r1 - blk.r0), torch.arange(v.shape[0] + 1, device=idx.device)).tolist()
    out = torch.empty_like(c)
    for g, (e0, e1) in enumerate(zip(ends[:-1], ends[1:])):
        if e1 > e0:
            out[e0:e1] = tc_dot(p[e0:e1].unsqueeze(1), v[g], c[e0:e1])
    ao[f] = out


def _run_block(st: RowState, lp: _Loop, n: int, active=None, masked=None, hw_rows=None) -> None:
    """Steps 1-9 for KV block ``n`` on the rows whose query tile visits it (``active``: by default
    from the block ranges, (heads_q, sq); block sparsity gives it, (b, heads_q, sq), with
    ``masked`` / ``hw_rows`` of that shape: where the block applies the mask_mod / runs as a
    masked iteration, :func:`_torch_rows`)."""
    if active is None:
        active = (n >= lp.ranges[0]) & (n < lp.ranges[1])  # (heads_q, sq)
    if not bool(active.any()):
        return
    b, hq, sq = st.row_max.shape
    tn, sk = lp.nm.tile_n, lp.sk
    r0, r1 = _row_window(active, sq, lp.fast)
    blk = _Block(n, n * tn, min((n + 1) * tn, sk), r0, r1)
    s = lp.scores(blk.j0, blk.j1, r0, r1)  # steps 1-2
    p64 = lp.buffer("p", (b, hq, r1 - r0, tn))
    acc = torch.empty(b * hq * (r1 - r0), dtype=torch.float32, device=s.device)
    first = torch.empty(b * hq * (r1 - r0), dtype=torch.bool, device=s.device)
    idx = active.expand(b, hq, sq).reshape(-1).nonzero().flatten()
    flat = lambda x: None if x is None else x.expand(b, hq, sq).reshape(-1)
    if idx.numel():
        _torch_rows(st, lp, s, blk, idx, p64, acc, first, flat(masked), flat(hw_rows))  # steps 3-8
    if lp.nm.mma == "tensor_core":
        _accumulate_tc(st, lp, p64, blk, acc, first, idx)  # step 9 as the tensor cores sum it
    else:
        _accumulate(st, lp.pv(p64, blk.j0, blk.j1), blk, acc, first, None, None, idx)  # step 9


_SCRATCH = threading.local()
_SCRATCH_KEEP = 1 << 28  # bytes of float64 scratch a thread keeps from one call to the next


def _scratch(n: int, slot: str) -> torch.Tensor:
    """n float64 of CPU scratch: the calling thread's kept storage ``slot`` when large enough
    (fresh pages cost their first touch: 80 MB took 26-30 ms to fill the first time, 5 ms the
    next)."""
    buf = getattr(_SCRATCH, slot, None)
    if buf is None or buf.numel() < n:
        buf = torch.empty(n, dtype=torch.float64)
        if n * 8 <= _SCRATCH_KEEP:
            setattr(_SCRATCH, slot, buf)
    return buf[:n]


def _fast_blocks(lp: _Loop, sq: int, nblk: int) -> list[_Block]:
    """The blocks some row visits, from the last to the first, each with its row window."""
    out = []
    for n in range(nblk - 1, -1, -1):
        active = (n >= lp.ranges[0]) & (n < lp.ranges[1])  # (heads_q, sq)
        if bool(active.any()):
            out.append(_Block(n, n * lp.nm.tile_n, min((n + 1) * lp.nm.tile_n, lp.sk), *_row_window(active, sq, True)))
    return out


def _run_fast(st: RowState, lp: _Loop, blocks: list[_Block]) -> None:
    """Steps 1-9 of the fast loop for its blocks: the GEMMs on the row windows into reused
    storage, steps 3-8 and step 9's accumulator compiled (on torch's OpenMP team), the rows
    they leave through the torch functions."""
    b, hq, sq = st.row_max.shape
    rows = b * hq * max(blk.r1 - blk.r0 for blk in blocks)
    widths = {"s": lp.nm.tile_n, "p": lp.nm.tile_n, "pv": st.acc_o.shape[-1]}
    flat, at, lp.bufs = _scratch(rows * sum(widths.values()), "loop"), 0, {}
    for x, w in widths.items():
        lp.bufs[x], at = flat[at : at + rows * w], at + rows * w
    for blk in blocks:
        s = lp.scores(blk.j0, blk.j1, blk.r0, blk.r1)  # steps 1-2
        geo, p64, acc, first, status = _compiled_rows(st, lp, blk, s)  # steps 3-8
        idx = (status == 2).nonzero().flatten()
        if idx.numel():
            _torch_rows(st, lp, s, blk, idx, p64, acc, first)  # steps 3-8 of the rows left
        _accumulate(st, lp.pv(p64, blk.j0, blk.j1), blk, acc, first, geo, status, idx)  # step 9


def _make_loop(q, k, v, nm: FA4Numerics, vis, ranges, scales: tuple, mods: FwdMods | None = None) -> _Loop:
    """The inputs exactly in float64 (k, v repeated per query head), laid out for the loop."""
    scale, softcap, sl2 = scales
    fast = _FAST_CPU and q.device.type == "cpu" and nm.mma == "exact" and not (mods is not None and mods.per_element)
    rep = q.shape[2] // k.shape[2]
    if fast:  # head-major, converted in one pass, into the thread's kept scratch
        sizes = [x.numel() * (rep if x is not q else 1) for x in (q, k, v)]
        flat = _scratch(sum(sizes), "inputs").split(sizes)
        q64, k64, v64 = (_head_major64(x, rep if x is not q else 1, o) for x, o in zip((q, k, v), flat))
    else:
        q64 = q.to(torch.float64)
        k64 = k.to(torch.float64).repeat_interleave(rep, dim=2)
        v64 = v.to(torch.float64).repeat_interleave(rep, dim=2)
    p_dtype = nm.p_dtype or q.dtype
    lp = _Loop(
        nm,
        fast,
        q64,
        k64,
        v64,
        vis,
        k.shape[1],
        ranges,
        scale,
        softcap,
        torch.tensor(sl2, dtype=torch.float32, device=q.device),
        torch.tensor(float(nm.max_offset), dtype=torch.float32, device=q.device),
        p_dtype,
        mods=mods,
    )
    if fast:
        lp.compiled = _compiled_args(nm, p_dtype, sl2, vis, ranges)
    return lp


def _head_major64(x: torch.Tensor, rep: int, flat: torch.Tensor) -> torch.Tensor:
    """(b, s, h, d) -> (b, h * rep, s, d) float64 in ``flat``'s storage, each head repeated
    ``rep`` times in place (``repeat_interleave`` on the head axis), the values exact."""
    b, s, h, d = x.shape
    out = flat.view(b, h, rep, s, d)
    out.copy_(x.permute(0, 2, 1, 3).unsqueeze(2).expand(b, h, rep, s, d))
    return out.view(b, h * rep, s, d)


def forward_loop(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    nm: FA4Numerics,
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int | None, int | None] = (None, None),
    softcap: float = 0.0,
    ranges: tuple[torch.Tensor, torch.Tensor] | None = None,
    mods: FwdMods | None = None,
) -> tuple[RowState, torch.Tensor, torch.Tensor]:
    """Steps 1-9 (``fa4.model`` module doc): the softmax loop over KV blocks from the last to the
    first, each row visiting the blocks of its range.  ``ranges`` = per (head, row) [n_min, n_max)
    of shape (heads_q, seqlen_q) (``fa4.varlen``: pack_gqa, split-KV); None:
    :func:`kv_block_ranges`.  ``mods``: the call's mods (``fa4.model`` module doc, "Mods";
    ``causal`` / ``window_size`` already resolved: off with a mask_mod); block sparsity visits each
    query tile's blocks in production's order (``fa4.block_sparse.block_sparse_kv_order``).
    Returns the loop's final state and the float32 scale_log2 and max_offset tensors."""
    b, sq, hq, d = q.shape
    sk, dv = k.shape[1], v.shape[-1]
    dev = q.device
    n_min, n_max, nblk = kv_block_ranges(sq, sk, nm, causal, window_size, dev, heads=hq)
    m_hi, m_lo = masked_blocks(sq, sk, nm.tile_m, nm.tile_n, causal, window_size, dev, heads=hq)
    if ranges is not None:
        n_min, n_max = ranges
    vis = visible_bounds(sq, sk, causal, window_size, dev)
    mods = None if mods is None or mods.empty else mods
    if mods is not None and mods.score_mod is not None:
        # utils.compute_softmax_scale_log2: the scale is the mod's (applied before it); exp2 takes LOG2_E
        scale = _scales(d, softmax_scale, 0.0)[0]
        sc = (scale, 0.0, _f32(_LOG2_E))
    else:
        sc = _scales(d, softmax_scale, softcap)
    lp = _make_loop(q, k, v, nm, vis, (n_min, n_max, m_hi, m_lo), sc, mods)
    st = RowState.empty((b, hq, sq), dv, dev)
    if mods is not None and mods.block_sparse is not None:
        for n, active, masked, hw in sparse_steps(mods.block_sparse, nm, b, hq, sq, sk, dev):
            _run_block(st, lp, n, active, masked, hw)
        return st, lp.sl2_t, lp.off
    blocks = _fast_blocks(lp, sq, nblk) if lp.fast else []
    if blocks:
        _run_fast(st, lp, blocks)
    elif not lp.fast:
        for n in range(nblk - 1, -1, -1):
            _run_block(st, lp, n)
    return st, lp.sl2_t, lp.off


@dataclass(frozen=True)
class FwdMods:
    """A call's mods as the forward loop applies them (``fa4.model`` module doc, "Mods"): the
    ``numerics.mods`` objects and the whole ``aux_tensors`` list (production hands every mod the
    same list).  ``fa4.varlen`` takes it too, to refuse them."""

    score_mod: ScoreMod | None = None
    mask_mod: MaskMod | None = None
    aux: tuple = ()
    block_sparse: BlockSparse | None = None

    @classmethod
    def of(cls, *, score_mod=None, mask_mod=None, aux_tensors=None, block_sparse_tensors=None) -> FwdMods:
        return cls(score_mod, mask_mod, tuple(aux_tensors or ()), block_sparse_tensors)

    @property
    def empty(self) -> bool:
        return self.score_mod is None and self.mask_mod is None and self.block_sparse is None

    @property
    def per_element(self) -> bool:
        """Visibility per element and a per-tile visit order: the plain loop."""
        return self.mask_mod is not None or self.block_sparse is not None


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    numerics: FA4Numerics | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int | None, int | None] = (None, None),
    softcap: float = 0.0,
    learnable_sink: torch.Tensor | None = None,
    score_mod: ScoreMod | None = None,
    mask_mod: MaskMod | None = None,
    aux_tensors: list | None = None,
    block_sparse_tensors: BlockSparse | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 1-10 on inputs ``fa4.model.attention`` has checked, its mods' scalars bound: (out
    (b, sq, hq, dv) in the input dtype, bf16 for fp8; lse (b, hq, sq) float32).  A mask_mod drops
    ``causal`` and the window (``interface._resolve_causal_local_window``); ``numerics=None``:
    ``FA4Numerics.for_call("sm100", ...)`` for what remains.  The forward of ``attention`` with
    and without autograd (``fa4.autograd``)."""
    fm = FwdMods.of(
        score_mod=score_mod, mask_mod=mask_mod, aux_tensors=aux_tensors, block_sparse_tensors=block_sparse_tensors
    )
    if mask_mod is not None:  # interface._resolve_causal_local_window: a mask_mod drops causal and local
        causal, window_size = False, (None, None)
    nm = numerics
    if nm is None:
        nm = FA4Numerics.for_call(
            "sm100", q, k, v, causal=causal, window_size=window_size, block_sparse_tensors=block_sparse_tensors
        )
    kw = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap)
    st, sl2_t, off = forward_loop(q, k, v, nm, **kw, mods=fm)
    out_dtype = torch.bfloat16 if q.dtype in _FP8 else q.dtype
    out, lse = finalize(nm, st.row_max, st.final_row_sum(nm), st.acc_o, sl2_t, off, learnable_sink, out_dtype)
    return out.permute(0, 2, 1, 3).contiguous(), lse
