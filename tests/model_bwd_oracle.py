"""The backward model before it was blocked for speed (commit 8fe5207): every score of every
head at once, no tile skipped; since then only its dq_accum adds changed (subnormals flushed,
``fa4.model_bwd.reduce_add``).  The oracle ``tests/test_model_bwd.py`` holds ``fa4.model_bwd``
to: on finite inputs the blocked model must give the same bits (the skipped tiles hold P = 0
and dS = 0 exactly, which add nothing), so the H200 fidelity measured against this version
carries over.  Not imported by the package."""

from __future__ import annotations

import math

import torch

from fa4.model_bwd import _FP8, BwdPlan, _dsink, _preprocess, _reduce_heads, _validate, bwd_plan, reduce_add
from fa4.primitives import fma as _fma
from fa4.primitives import hardware_exp2
from fa4.primitives import scales as _scales
from fa4.primitives import visible as _visible
from numerics.fp import round_to
from numerics.fp import to_f32 as _f32


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
        acc = reduce_add(acc, torch.einsum("bhij,bjhd->bhid", ds64[..., j0:j1], k64[:, j0:j1]).float())
    return (acc * scale).to(dtype).permute(0, 2, 1, 3).contiguous()


def attention_backward_unblocked(
    q,
    k,
    v,
    out,
    lse,
    do,
    *,
    dlse=None,
    softmax_scale=None,
    causal=False,
    window_size=(None, None),
    softcap=0.0,
    learnable_sink=None,
    numerics,
):
    """``fa4.model_bwd.attention_backward``'s contract, computed unblocked."""
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
