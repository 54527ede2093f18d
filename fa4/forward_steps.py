"""The forward's arithmetic on a set of query rows, steps 2-10 of ``fa4.model``'s module doc, in
torch: the softcap (step 2), the mask (3), the row max with lazy rescaling (4), the fused exponent
(5), exp2 (6), the row sum in production's order (7), P's cast (8), the O accumulator (9) and the
epilogue (10).  ``fa4.forward_loop`` drives them over KV blocks; each function names the
production step it models (flash-attn-4 4.0.0b36, ``flash_attn/cute``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fa4.ex2 import emulated_columns, ex2_emulation_2
from fa4.knobs import FA4Numerics
from fa4.primitives import FP8 as _FP8
from fa4.primitives import LOG2_E as _LOG2_E
from fa4.primitives import fma as _fma
from fa4.primitives import hardware_exp2, hardware_lg2, hardware_rcp, softcap_tanh
from numerics.fp import fma_f32, round_to
from numerics.fp import to_f32 as _f32

__all__ = ["RowState", "apply_softcap", "pad_mask", "softmax_rows", "o_rows", "finalize"]

_LN2 = math.log(2.0)


def _exp2_mixed(t: torch.Tensor, nm: FA4Numerics) -> torch.Tensor:
    if nm.exp2 == "hardware":
        return hardware_exp2(t)
    emu = ex2_emulation_2(t.contiguous(), nm.poly_degree)
    if nm.exp2 == "emulated":
        return emu
    cols = (
        emulated_columns(
            nm.tile_n, ex2_emu_freq=nm.emu_freq, ex2_emu_res=nm.emu_res, ex2_emu_start_frg=nm.emu_start_frg
        )
        if nm.tile_n % 32 == 0
        else torch.zeros(nm.tile_n, dtype=torch.bool)
    )
    return torch.where(cols.to(t.device), emu, hardware_exp2(t))


def _row_sum_sm100(p: torch.Tensor, init: torch.Tensor | None) -> torch.Tensor:
    """``utils.fadd_reduce`` for arch >= 100: eight lanes (packed pairs (0,1),(2,3),(4,5),(6,7)),
    each a sequential float32 chain over the groups of 8 columns, ``init`` added to lane 0
    first; then (l0+l2, l1+l3, ...) pairwise: ((0,1)+(2,3)), ((4,5)+(6,7)), their sum, and
    finally lane pair [0] + [1]."""
    g = p.reshape(*p.shape[:-1], -1, 8)
    acc = g[..., 0, :].clone()
    if init is not None:
        acc[..., 0] = init + acc[..., 0]
    for i in range(1, g.shape[-2]):
        acc = acc + g[..., i, :]
    l01, l23, l45, l67 = acc[..., 0:2], acc[..., 2:4], acc[..., 4:6], acc[..., 6:8]
    a = l01 + l23
    c = l45 + l67
    a = a + c
    return a[..., 0] + a[..., 1]


def _row_sum_sm90(p: torch.Tensor, partial: torch.Tensor | None, scale: torch.Tensor | None) -> torch.Tensor:
    """SM90: four thread-partial sums per row (thread q of a quad owns columns 8j+2q, 8j+2q+1),
    each a strictly sequential float32 chain in column order; a later block starts with
    ``fma(partial, scale, p0)`` (ptxas fuses it).  Returns the (…, 4) partials."""
    n = p.shape[-1]
    cols = torch.arange(n, device=p.device).reshape(-1, 4, 2).permute(1, 0, 2).reshape(4, -1)  # (4, n/4)
    pq = p[..., cols]  # (..., 4, n/4)
    if partial is None:
        acc = torch.zeros_like(pq[..., 0]) + pq[..., 0]
    else:
        acc = fma_f32(partial, scale.unsqueeze(-1).expand_as(partial).contiguous(), pq[..., 0].contiguous())
    for i in range(1, pq.shape[-1]):
        acc = acc + pq[..., i]
    return acc


@dataclass
class RowState:
    """Per (batch, head, query row) running state of the softmax loop, all float32 but ``started``."""

    row_max: torch.Tensor  # (b, hq, sq)
    started: torch.Tensor  # (b, hq, sq) bool: a block of the row has been processed
    row_sum: torch.Tensor  # (b, hq, sq), SM100
    partial: torch.Tensor  # (b, hq, sq, 4): SM90's thread-partial row sums
    acc_o: torch.Tensor  # (b, hq, sq, dv)

    @classmethod
    def empty(cls, shape: tuple[int, int, int], dv: int, dev) -> RowState:
        return cls(
            row_max=torch.full(shape, -math.inf, dtype=torch.float32, device=dev),
            started=torch.zeros(shape, dtype=torch.bool, device=dev),
            row_sum=torch.zeros(shape, dtype=torch.float32, device=dev),
            partial=torch.zeros(shape + (4,), dtype=torch.float32, device=dev),
            acc_o=torch.zeros(shape + (dv,), dtype=torch.float32, device=dev),
        )

    def final_row_sum(self, nm: FA4Numerics) -> torch.Tensor:
        """The row sum the epilogue uses: SM100's running sum, SM90's four thread partials
        reduced pairwise ((0+1) + (2+3), the quad shuffle of ``Softmax.finalize``)."""
        if nm.arch == "sm90":
            p = self.partial
            return (p[..., 0] + p[..., 1]) + (p[..., 2] + p[..., 3])
        return self.row_sum


def apply_softcap(s: torch.Tensor, scale: float, softcap: float) -> torch.Tensor:
    """Step 2 on float32 scores: ``utils.create_softcap_scoremod`` via ``apply_score_mod_inner``
    (``s*scale`` FMUL, ``/ softcap`` div.rn, tanh (MUFU.TANH: the instruction on CUDA, else
    correctly rounded), ``* softcap`` FMUL; no FFMA: the SASS rounds each)."""
    return softcap_tanh(s, scale, softcap) * _f32(softcap)


def pad_mask(s: torch.Tensor, vis: torch.Tensor, tn: int) -> torch.Tensor:
    """Step 3: a block's float32 scores (..., nc) padded to ``tn`` columns and masked with -inf
    where ``vis`` (..., nc) is False (``mask.py`` ``AttentionMask.apply_mask``) and beyond seqlen_k."""
    s = torch.nn.functional.pad(s, (0, tn - s.shape[-1]), value=-math.inf)
    mask = torch.nn.functional.pad(vis, (0, tn - vis.shape[-1]), value=False)
    return s.masked_fill(~mask, -math.inf)


def _update_row_max(s, row_max, first, sl2_t, nm: FA4Numerics):
    """Step 4: the block's new row max, the max subtracted (-inf -> 0) and the accumulator
    scale ``exp2((old - new) * scale_log2)``, with SM100's lazy rescaling."""
    blk_max = torch.where(torch.isnan(s), torch.full_like(s, -math.inf), s).amax(-1)  # step 4
    new_max = torch.where(first, blk_max, torch.fmax(row_max, blk_max))
    safe = torch.where(new_max == -math.inf, torch.zeros_like(new_max), new_max)
    scale_arg = (row_max - safe) * sl2_t
    acc_scale = torch.where(first, torch.zeros_like(safe), hardware_exp2(scale_arg))
    if nm.rescale_threshold > 0:  # SoftmaxSm100.update_row_max: lazy rescaling
        keep = ~first & (scale_arg >= -nm.rescale_threshold)
        new_max = torch.where(keep, row_max, new_max)
        safe = torch.where(keep, row_max, safe)
        acc_scale = torch.where(keep, torch.ones_like(acc_scale), acc_scale)
    return new_max, safe, acc_scale


def _block_row_sum(p, first, row_sum, partial, acc_scale, nm: FA4Numerics):
    """Step 7: (row sum, SM90 partials) after this block, in production's order."""
    if nm.arch == "sm100":  # step 7
        init = torch.where(first, torch.zeros_like(row_sum), row_sum * acc_scale)
        blk_sum = _row_sum_sm100(p, init)
        blk_sum = torch.where(first, _row_sum_sm100(p, None), blk_sum)
        new_partial = partial
    else:
        new_partial = torch.where(
            first.unsqueeze(-1), _row_sum_sm90(p, None, None), _row_sum_sm90(p, partial, acc_scale)
        )
        blk_sum = row_sum
    return blk_sum, new_partial


def softmax_rows(s, m_old, started, l_old, part_old, hw, nm: FA4Numerics, p_dtype, sl2_t, off):
    """Steps 4-8 in torch on a set of rows (``s``: (rows, tile_n) masked float32 scores, the
    rows' state before the block; ``hw``: rows whose exp2 is the hardware's on every column,
    ``FA4Numerics.masked_exp2``).  Returns their new row max, row sum, SM90 partials, the
    accumulator scale, ``first`` and P rounded to p_dtype, as float64 (the P V MMA's operand)."""
    first = ~started
    new_max, safe, acc_scale = _update_row_max(s, m_old, first, sl2_t, nm)  # step 4
    bias = _fma(-safe, sl2_t, off)  # step 5: ptxas fuses max_offset - max*scale_log2 (one rounding)
    t = _fma(s, sl2_t, bias.unsqueeze(-1))
    p = _exp2_mixed(t, nm)  # step 6
    if hw is not None:  # masked_exp2 = "hardware": this block's masked rows take MUFU.EX2 only
        p = torch.where(hw.unsqueeze(-1), hardware_exp2(t), p)
    blk_sum, new_partial = _block_row_sum(p, first, l_old, part_old, acc_scale, nm)  # step 7
    p_lp = round_to(p, p_dtype, saturate=p_dtype in _FP8)  # step 8
    return new_max, blk_sum, new_partial, acc_scale, first, p_lp.double()


def o_rows(acc_o, acc_scale, pv, first):
    """Step 9's accumulator on a set of rows: fl32(P V) on a row's first block, else
    fl32(O * acc_scale + P V) with the product rounded to float32 first (FMUL, then the MMA
    accumulating onto it)."""
    return torch.where(first.unsqueeze(-1), pv.float(), (acc_o * acc_scale.unsqueeze(-1)).double().add(pv).float())


def finalize(nm, row_max, row_sum, acc_o, sl2, off, sink, out_dtype):
    """The SM100 correction-warp epilogue (``flash_fwd_sm100.py`` ``correction_loop``) or
    ``Softmax.finalize`` (SM90): learnable sink, reciprocal, O scaling, LSE.  Fused operations
    follow the SASS ptxas emits (fma where it fuses, separate roundings where it does not).
    ``fa4.forward_loop.attention_forward`` ends with it; ``fa4.varlen`` finishes each sequence
    (and each split) the same way."""
    dev = row_sum.device
    l2e = torch.tensor(_f32(_LOG2_E), device=dev)
    ln2 = torch.tensor(_f32(_LN2), device=dev)
    if sink is not None:
        s = sink.to(torch.float32).view(1, -1, 1).expand_as(row_sum)
        empty = row_max == -math.inf
        if nm.arch == "sm100":  # softmax.apply_learnable_sink
            u = _fma(s, l2e, -(row_max * sl2)) + off  # FMUL, FFMA, FADD
            row_sum = torch.where(empty, torch.full_like(row_sum, 2.0**nm.max_offset), row_sum + hardware_exp2(u))
            row_max = torch.where(empty, s * (l2e / sl2), row_max)  # div.rn, FMUL
        else:  # Softmax.finalize: FMUL sink*LOG2_E, FSEL, then FADD (no FFMA: the SASS rounds
            # the product first, as it feeds both the select and the subtraction; sm_90a SASS
            # of the b36 kernel with a learnable sink, compiled 2026-12-01)
            s_l2 = s * l2e
            rms = torch.where(empty, s_l2, row_max * sl2)
            row_sum = row_sum + hardware_exp2(s_l2 - rms)
    bad = (row_sum == 0) | torch.isnan(row_sum)
    rcp = hardware_rcp(torch.where(bad, torch.ones_like(row_sum), row_sum))  # rcp.approx.ftz
    out = (acc_o * rcp.unsqueeze(-1)).to(out_dtype)
    lg2 = hardware_lg2(row_sum)  # lg2.approx.ftz
    if nm.arch == "sm90" and sink is not None:
        lse = (rms + lg2) * ln2
    else:  # FFMA(row_max, scale_log2, lg2 - max_offset) * LN2
        lse = _fma(row_max, sl2, lg2 - off) * ln2
    lse = torch.where(bad, torch.full_like(lse, -math.inf), lse)
    return out, lse
