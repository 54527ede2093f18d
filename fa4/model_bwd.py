"""Bit-faithful numerics model of the FA4 backward kernel (Hopper SM90 and Blackwell SM100 paths).

``attention_backward(q, k, v, out, lse, do, *, dlse, ..., numerics)`` returns (dq, dk, dv,
dsink) as production's ``interface._flash_attn_bwd`` computes them (flash-attn-4 4.0.0b36,
``flash_attn/cute``), step by step in float32 with production's roundings.  ``fa4.model.attention``
calls it from its autograd hook (``interface.FlashAttnFunc.backward``: the saved inputs, the
*returned* out, the float32 LSE, dO and dLSE when the LSE output receives a gradient).

1. Preprocess (``flash_bwd_preprocess.py`` ``FlashAttentionBackwardPreprocess.kernel``):
   D = rowsum(fp32(O) * fp32(dO)) from the rounded O — each thread sums its 8-column chunks in
   column order, the ``threads_per_row`` partials are combined by ``utils.warp_reduce``
   (butterfly, offsets 1, 2, 4, ...); D' = D - dLSE; ``lse_log2 = lse * log2(e)`` with an
   LSE of -inf (a row that saw no key) mapped to 0; dq_accum zeroed.
2. S = Q K^T in float32 (exact products, one rounding: the forward model's MMA assumption).
3. softcap (``utils.create_softcap_scoremod`` via ``apply_score_mod_inner``): ``s*scale``,
   ``/ softcap``, tanh.approx, ``* softcap``, as in the forward; ``scale_log2 = log2(e)``.
4. Masks (``mask.py`` ``AttentionMask.apply_mask``): -inf outside the causal / local window
   (bottom-right aligned), exactly the forward's rule.
5. P = ex2.approx(fma(S, scale_log2, -lse_log2)) — the hardware exp2 (MUFU.EX2, modelled
   correctly rounded with flush-to-zero: ``fa4._primitives.hardware_exp2``, the forward's) on
   both archs: the backward never takes the polynomial (``flash_bwd_sm90.py`` ``mma_one_m_block`` step (3);
   ``flash_bwd_sm100.py`` ``compute_loop``, ``fma_packed_f32x2`` then ``exp2``).
6. dP = dO V^T in float32; dS = P * (dP - D') (FSUB then FMUL; SM100 ``sub_packed_f32x2`` /
   ``mul_packed_f32x2``, the same IEEE operations); softcap backward
   (``utils.create_softcap_scoremod_bwd``): dS * (1 - t*t), ``1 - t*t`` one FFMA.
7. P and dS cast to the input dtype (``utils.cvt_f16``: ``cvt.rn``; SM100 ``ds_dtype``).
8. dV = P^T dO and dK = dS^T Q accumulated over the query blocks (ascending m_block, float32
   accumulator, each block's MMA sum rounded once); dK * scale (``FlashAttentionBackwardSm90.mma``
   ``acc_dK * softmax_scale``; SM100 ``epilogue_dKV``), then the cast.  GQA: each query head's
   unscaled float32 partial is added into dk_accum / dv_accum (``epilogue_dKV`` bulk
   reduce-add) in head order, then ``flash_bwd_postprocess.py`` multiplies by scale (1 for dV)
   and casts.
9. dQ = dS K per (query block, KV block) — on SM100 with 2-CTA the dQ MMA reduces over the CTA
   pair's keys (``mma_tiler_dsk``) — added into the float32 dq_accum (``dQaccum_store`` /
   ``dQacc_reduce``), then ``dq_accum * scale`` cast (``flash_bwd_postprocess.py``).  The
   order of those adds is production's only nondeterminism: atomics land in any order; with
   ``deterministic`` a semaphore orders them by KV block (ascending; descending from the row's
   last block for causal / local, ``spt``).  The model uses that order when
   ``bwd_deterministic`` and ascending otherwise (one of the orders production may take).
10. dsink (``flash_bwd_postprocess.py`` ``dsink_row_term`` + ``block_sum``): per head, over
    batches and rows, ``-exp2((sink - lse) * log2 e) * D'`` (1 for an LSE of -inf), each
    thread's chain fused into FFMAs, then a warp butterfly and a block reduction; cast to the
    sink's dtype.

Unspecified by the source, assumed here (each named where it is used): the MMA's internal
summation (as in the forward model), the order ``TensorSSA.reduce`` folds a thread's elements
(sequential), and which mul/add pairs ptxas contracts into FFMA (those a ``mul`` feeds an
``add`` directly, the forward model's convention).  MUFU.EX2 / MUFU.TANH are not correctly
rounded (about 2 ULP), so the model can differ from the device by that much per element.

This module does not import ``fa4.model`` (which imports it): the primitives it shares with
the forward — the exp2 model, the mask rule, the float32 scales and the broadcasting FFMA —
come from ``fa4._primitives``, the same functions the forward calls.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fa4._primitives import LOG2_E as _LOG2_E
from fa4._primitives import fma as _fma
from fa4._primitives import hardware_exp2
from fa4._primitives import scales as _scales
from fa4._primitives import visible as _visible
from numerics.fp import round_to
from numerics.fp import to_f32 as _f32

__all__ = ["attention_backward", "bwd_plan", "BwdPlan"]

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True)
class BwdPlan:
    """Production's backward configuration for one call, after the numerics' knobs.

    tile_m, tile_n: query rows / keys per block; dq_keys: keys one dQ MMA reduces (tile_n, or
    2 * tile_n with SM100's 2-CTA pair); post_threads: threads of the dQ postprocess CTA that
    reduces dsink; hdimv_multiple: the padding of head_dim_v the preprocess tiles with;
    dq_descending: dq_accum takes the KV blocks last first (deterministic causal / local,
    production's ``spt``), else first to last."""

    tile_m: int
    tile_n: int
    dq_keys: int
    post_threads: int
    hdimv_multiple: int
    dq_descending: bool


def bwd_plan(numerics, head_dim: int, head_dim_v: int, causal: bool, local: bool) -> BwdPlan:
    """The tiles production picks (``interface._flash_attn_bwd``: SM90 ``_tile_size_bwd_sm90``;
    SM100 128 x 128, 2-CTA for head_dim >= 128), overridden by the numerics' ``bwd_*`` knobs."""
    if numerics.arch == "sm90":
        if head_dim <= 64:
            tm, tn, single_wg, swap = 128, 128, False, False
        elif head_dim <= 96:
            tm, tn, single_wg, swap = 64, 128, True, False
        elif head_dim <= 128:
            tm, tn, single_wg, swap = (64 if causal or local else 80), 128, False, False
        elif head_dim <= 192:
            tm, tn, single_wg, swap = 64, 96, False, True
        else:
            tm, tn, single_wg, swap = 64, 48, False, True
        # num_threads_post_dQ: 128 with dQ_single_wg, else num_wg (2) * 128; hdim_multiple_of 64 with dKV_swapAB
        cta_pair, post, mult = False, 128 if single_wg else 256, 64 if swap else 32
    else:
        if head_dim > 192 or head_dim_v > 128:
            raise NotImplementedError(
                "the SM100 backward model takes head_dim <= 192 and head_dim_v <= 128 "
                "(FlashAttentionBackwardSm100; head dim 256 runs dedicated kernels, not modelled)"
            )
        tm, tn, cta_pair, post, mult = 128, 128, head_dim >= 128, 128, 32  # use_2cta_instrs: head_dim >= 128
    tm = numerics.bwd_tile_m or tm
    tn = numerics.bwd_tile_n or tn
    dq_tiles = numerics.bwd_dq_tiles or (2 if cta_pair else 1)
    spt = numerics.bwd_deterministic and (causal or local)  # FlashAttentionBackwardSm90/Sm100: self.spt
    return BwdPlan(tm, tn, tn * dq_tiles, post, mult, spt)


def _butterfly(x: torch.Tensor) -> torch.Tensor:
    """``utils.warp_reduce(x, add)`` over the last dim (a power of two): offsets 1, 2, 4, ...
    pair adjacent lanes first, so the result is the adjacent-pairs tree sum."""
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    return x[..., 0]


def _row_dot(out: torch.Tensor, do: torch.Tensor, hdimv_multiple: int) -> torch.Tensor:
    """Step 1, D = rowsum(fp32(O) * fp32(dO)) in the preprocess kernel's order: head_dim_v padded
    to ``hdimv_multiple`` (zeros), copied in 8-element (16-byte) vectors by ``threads_per_row =
    gmem_k_block_size / 8`` threads; each thread folds its elements in column order (assumed:
    ``TensorSSA.reduce`` is sequential; the products are exact in float32, so a fused FFMA chain
    gives the same sums), then the warp butterfly.  out, do: (b, h, sq, dv) -> (b, h, sq)."""
    dv = out.shape[-1]
    dvp = -(-dv // hdimv_multiple) * hdimv_multiple
    gk = next(g for g in (128, 64, 32, 16) if dvp % g == 0)
    prod = torch.nn.functional.pad(out.float() * do.float(), (0, dvp - dv))
    per = prod.reshape(*prod.shape[:-1], dvp // gk, gk // 8, 8).transpose(-3, -2)  # (..., thread, chunk, 8)
    per = per.reshape(*per.shape[:-2], -1)
    acc = per[..., 0].clone()
    for i in range(1, per.shape[-1]):
        acc = acc + per[..., i]
    return _butterfly(acc)


def _preprocess(out, do, lse, dlse, plan: BwdPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 1 (``FlashAttentionBackwardPreprocess.kernel``): (D', lse_log2), both (b, h, sq)."""
    d = _row_dot(out, do, plan.hdimv_multiple)
    if dlse is not None:
        d = d - dlse.float()  # PdPsum_val -= gdLSE[row]
    lse_log2 = lse * _f32(_LOG2_E)  # lse * LOG2_E if lse != -inf else 0.0
    lse_log2 = torch.where(lse == -math.inf, torch.zeros_like(lse_log2), lse_log2)
    return d, lse_log2


def _scores(q64, k64, vis, scale: float, softcap: float):
    """Steps 2-4: the masked float32 scores and, with softcap, tanh's output t (None without).
    Softcap exactly as the forward model's ``_block_scores`` (``apply_score_mod_inner``:
    FMUL, div.rn, tanh.approx modelled correctly rounded, FMUL)."""
    s = torch.einsum("bihd,bjhd->bhij", q64, k64).float()  # S = Q K^T (the MMA: one rounding)
    t = None
    if softcap > 0:
        x = (s * scale) / softcap
        t = torch.tanh(x.double()).float()
        s = t * _f32(softcap)
    return s.masked_fill(~vis, -math.inf), t


def _ds(s, t, lse_log2, d_prime, do64, v64, sl2: float):
    """Steps 5-6: P (float32) and dS (float32) of every (row, key)."""
    p = hardware_exp2(_fma(s, sl2, -lse_log2.unsqueeze(-1)))  # exp2(S * scale_log2 - lse_log2), FFMA
    dp = torch.einsum("bihc,bjhc->bhij", do64, v64).float()  # dP = dO V^T (one rounding)
    ds = p * (dp - d_prime.unsqueeze(-1))  # FSUB, FMUL
    if t is not None:  # create_softcap_scoremod_bwd: grad * (1 - t*t), 1 - t*t contracted to FFMA
        ds = ds * _fma(-t, t, 1.0)
    return p, ds


def _accumulate_rows(a64: torch.Tensor, x64: torch.Tensor, tile_m: int) -> torch.Tensor:
    """Step 8: sum_i a[b,h,i,j] x[b,i,h,c] into a float32 (b, h, j, c) accumulator, one query block
    of ``tile_m`` rows per MMA (its exact sum rounded once), blocks in ascending order
    (``for m_block in range(m_block_min, m_block_max)``)."""
    acc = None
    for i0 in range(0, a64.shape[2], tile_m):
        blk = torch.einsum("bhij,bihc->bhjc", a64[:, :, i0 : i0 + tile_m], x64[:, i0 : i0 + tile_m])
        acc = blk.float() if acc is None else (acc.double() + blk).float()
    return acc


def _reduce_heads(acc: torch.Tensor, hk: int, scale: float, dtype) -> torch.Tensor:
    """Step 8's epilogue: (b, hq, sk, c) float32 partials -> (b, sk, hk, c) in ``dtype``.  Heads of
    a group are added in order into a zeroed float32 buffer (``epilogue_dKV``; one head: the
    accumulator itself), multiplied by ``scale`` (FMUL) and cast (cvt.rn)."""
    b, hq, sk, c = acc.shape
    g = acc.view(b, hk, hq // hk, sk, c)
    tot = g[:, :, 0].clone()
    for h in range(1, hq // hk):
        tot = tot + g[:, :, h]
    if scale != 1.0:
        tot = tot * scale
    return tot.to(dtype).permute(0, 2, 1, 3).contiguous()


def _dq(ds64, k64, scale: float, plan: BwdPlan, dtype) -> torch.Tensor:
    """Step 9: per (row, KV group of ``dq_keys``) the dQ MMA's float32 tile, added into the zeroed
    float32 dq_accum in the model's order (module doc), then ``dq_accum * scale`` cast.
    ds64: (b, h, sq, sk); k64: (b, sk, h, d) -> (b, sq, h, d)."""
    sk = ds64.shape[-1]
    groups = list(range(0, sk, plan.dq_keys))
    if plan.dq_descending:  # dQaccum_store / _dq_semaphore_lock_value: n_block_max - 1 - n_block
        groups = groups[::-1]
    acc = torch.zeros(ds64.shape[:3] + (k64.shape[-1],), dtype=torch.float32, device=ds64.device)
    for j0 in groups:
        j1 = j0 + plan.dq_keys
        acc = acc + torch.einsum("bhij,bjhd->bhid", ds64[..., j0:j1], k64[:, j0:j1]).float()
    return (acc * scale).to(dtype).permute(0, 2, 1, 3).contiguous()


def _dsink(sink: torch.Tensor, lse: torch.Tensor, d_prime: torch.Tensor, threads: int) -> torch.Tensor:
    """Step 10 (``flash_bwd_postprocess.py``): dsink[h] = -sum over batches and rows of
    ``exp2((sink - lse) * LOG2_E) * D'`` (FADD, FMUL, MUFU.EX2; 1 where lse is -inf).  Thread t
    takes rows t, t + threads, ... of batch 0, then of batch 1, ...; ``sink_sum +=
    -p * D'`` is one FFMA (assumed contracted); ``block_sum``: each warp's butterfly, then warp
    0's butterfly over the warp totals (lanes past the warp count hold 0)."""
    b, h, sq = lse.shape
    s = sink.float().view(1, h, 1)
    p = hardware_exp2((s - lse) * _f32(_LOG2_E))
    p = torch.where(lse == -math.inf, torch.ones_like(p), p)
    pad = -(-sq // threads) * threads - sq
    p, dp = (torch.nn.functional.pad(x.permute(1, 0, 2), (0, pad)) for x in (p, d_prime))
    p, dp = (x.reshape(h, -1, threads) for x in (p, dp))  # (h, batch x row-rounds, thread)
    acc = torch.zeros(h, threads, dtype=torch.float32, device=lse.device)
    for r in range(p.shape[1]):
        acc = _fma(-p[:, r], dp[:, r], acc)
    warps = _butterfly(acc.view(h, threads // 32, 32))
    total = _butterfly(torch.nn.functional.pad(warps, (0, 32 - warps.shape[-1])))
    return total.to(sink.dtype)


def attention_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    do: torch.Tensor,
    *,
    dlse: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int | None, int | None] = (None, None),
    softcap: float = 0.0,
    learnable_sink: torch.Tensor | None = None,
    numerics,
):
    """Production's backward (module doc) of ``fa4.model.attention``; ``numerics`` an
    ``fa4.model.FA4Numerics`` (arch and the ``bwd_*`` / ``ds_dtype`` knobs).

    q: (b, sq, hq, d); k: (b, sk, hk, d); v: (b, sk, hk, dv), bf16 or fp16; out, do: (b, sq,
    hq, dv) in the input dtype (out as the forward returned it); lse, dlse: (b, hq, sq) float32.
    Returns (dq, dk, dv) in the input dtype and dsink in the sink's dtype (None without sink).
    """
    _validate(q, k, v, out, do)
    b, sq, hq, d = q.shape
    sk, hk, dv_ = k.shape[1], k.shape[2], v.shape[-1]
    local = not causal and any(w is not None for w in window_size)
    plan = bwd_plan(numerics, d, dv_, causal, local)
    scale, softcap, sl2 = _scales(d, softmax_scale, softcap)
    out_t, do_t = out.permute(0, 2, 1, 3), do.permute(0, 2, 1, 3)
    d_prime, lse_log2 = _preprocess(out_t, do_t, lse.float(), dlse, plan)  # step 1
    q64, do64 = q.double(), do.double()
    k64, v64 = (t.double().repeat_interleave(hq // hk, dim=2) for t in (k, v))
    vis = _visible(sq, sk, causal, window_size, q.device)
    s, t = _scores(q64, k64, vis, scale, softcap)  # steps 2-4
    p, ds = _ds(s, t, lse_log2, d_prime, do64, v64, sl2)  # steps 5-6
    ds_dtype = numerics.ds_dtype or q.dtype
    p_lp = round_to(p, q.dtype).double()  # step 7
    ds_lp = round_to(ds, ds_dtype, saturate=ds_dtype in _FP8).double()
    dv = _reduce_heads(_accumulate_rows(p_lp, do64, plan.tile_m), hk, 1.0, q.dtype)  # step 8
    dk = _reduce_heads(_accumulate_rows(ds_lp, q64, plan.tile_m), hk, scale, q.dtype)
    dq = _dq(ds_lp, k64, scale, plan, q.dtype)  # step 9
    dsink = None if learnable_sink is None else _dsink(learnable_sink, lse.float(), d_prime, plan.post_threads)
    return dq, dk, dv, dsink


def _validate(q, k, v, out, do) -> None:
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise NotImplementedError(
            f"the FA4 backward takes bf16 or fp16 inputs only (interface._flash_attn_bwd), got {q.dtype}"
        )
    for name, t in (("k", k), ("v", v), ("out", out), ("do", do)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {t.dtype}")
    if out.shape != do.shape or out.shape[:3] != q.shape[:3] or out.shape[-1] != v.shape[-1]:
        raise ValueError(f"out {tuple(out.shape)} and do {tuple(do.shape)} must be (b, sq, hq, dv)")
