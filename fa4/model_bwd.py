"""Bit-faithful numerics model of the FA4 backward kernel (Hopper SM90 and Blackwell SM100 paths).

``attention_backward(q, k, v, out, lse, do, *, dlse, ..., numerics)`` returns (dq, dk, dv,
dsink) as production's ``interface._flash_attn_bwd`` computes them (flash-attn-4 4.0.0b36,
``flash_attn/cute``), step by step in float32 with production's roundings.  ``fa4.model.attention``
calls it from its autograd hook (``interface.FlashAttnFunc.backward``: the saved inputs, the
*returned* out, the float32 LSE, dO and dLSE when the LSE output receives a gradient).

1. Preprocess (``flash_bwd_preprocess.py`` ``FlashAttentionBackwardPreprocess.kernel``):
   D = rowsum(fp32(O) * fp32(dO)) from the rounded O — each thread sums its 8-column chunks
   element-major (element 0 of each chunk, then element 1, ...: ``row_dot``), the
   ``threads_per_row`` partials are combined by ``utils.warp_reduce``
   (butterfly, offsets 1, 2, 4, ...); D' = D - dLSE; ``lse_log2 = lse * log2(e)`` with an
   LSE of -inf (a row that saw no key) mapped to 0; dq_accum zeroed.
2. S = Q K^T in float32 (exact products, one rounding: the forward model's MMA assumption; with
   ``FA4Numerics.mma="tensor_core"`` this and the other four MMAs — dP, dV, dK, dQ — are summed
   as the H200's wgmma sums them, accumulators taken as C: ``_mm``).
3. softcap (``utils.create_softcap_scoremod`` via ``apply_score_mod_inner``): ``s*scale``,
   ``/ softcap``, tanh.approx, ``* softcap``, as in the forward; ``scale_log2 = log2(e)``.
4. Masks (``mask.py`` ``AttentionMask.apply_mask``): -inf outside the causal / local window
   (bottom-right aligned), exactly the forward's rule.
5. P = ex2.approx(fma(S, scale_log2, -lse_log2)) — the hardware exp2 (MUFU.EX2, modelled
   correctly rounded with flush-to-zero: ``fa4.primitives.hardware_exp2``, the forward's) on
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

Head dim 256 on SM100 (``interface._flash_attn_bwd``: ``use_dedicated_hd256_kernel`` for (256,
256) unless ``FLASH_ATTENTION_HD256_GENERIC_BWD=1``, the knob ``bwd_hd256_generic``): two
kernels, ``sm100_hd256_2cta_fmha_backward_dqkernel.py`` then ``..._dkdvkernel.py``, no
postprocess.  Same preprocess, S (one MMA chain over all 256 columns), P and dS = P * (dP - D')
as above; then (a) the dQ kernel multiplies dS by the scale in float32 *before* its cast and
accumulates dQ in one TMEM chain over the KV blocks, ascending (each block's MMA sum rounded once
with the accumulator; no atomics, so deterministic whatever ``deterministic`` says), the
epilogue only casts; (b) the dK/dV kernel zeroes masked dS (+0) under causal masking, and with
GQA sums every query head of a group into one TMEM chain, head after head, dK scaled once at the
end.  Refused (``_hd256_refusals``): softcap, local windows, a learnable sink, a gradient of the
LSE.  The kernels also visit a few more fully masked blocks than ``get_m_block_min_max`` (dQ
ranges per 256-row CTA pair; dK/dV's first query block rounded down to even): on finite inputs
they add exact zeros; their effect on non-finite inputs is not modelled.

Tiles: production computes, per key group, only the query blocks
``block_info.BlockInfo.get_m_block_min_max`` gives it (causal / local); the model does the same
(``_schedule``), so a non-finite value in a tile production skips reaches no gradient, while in a
tile it computes, a masked score's P = 0 and dS = 0 still meet it in the MMAs (0 * inf = NaN), as
on the device.  The model streams one query block at a time over chunks of (batch x head) rows.

Unspecified by the source, assumed here (each named where it is used): the MMA's internal
summation (as in the forward model), the order ``TensorSSA.reduce`` folds a thread's elements
(sequential), and which mul/add pairs ptxas contracts into FFMA (those a ``mul`` feeds an
``add`` directly, the forward model's convention).  MUFU.EX2 / MUFU.TANH are the instructions
themselves on CUDA (``fa4.mufu``); on the CPU they are modelled correctly rounded, and they are
not (about 2 ULP), so there the model can differ from the device by that much per element.

Mods (``score_mod``, ``mask_mod``, ``aux_tensors``, ``block_sparse_tensors``; ``fa4.model``'s
module doc for the forward), as ``flash_bwd_sm90.py`` ``mma_one_m_block`` (SM100:
``flash_bwd_sm100.py`` ``compute_loop``) applies them:

* step 3 with a score_mod: the pre-mod S is kept (``acc_S_pre``), ``apply_score_mod`` as in the
  forward (``fl32(S * scale)``, the mod in float32: ``fa4.primitives.apply_score_mod``),
  ``scale_log2 = LOG2_E`` (``FlashAttentionBackwardSm90.__call__``: "softmax_scale_log2 =
  LOG2_E" with a score_mod); step 6: after ``dS = P * (dP - D')``, ``apply_score_mod_bwd``:
  ``dS <- score_mod_bwd(dS, fl32(S_pre * scale))`` (``softmax.py`` ``apply_score_mod_bwd_inner``),
  the mod's ``grad`` in float32, on every element of the tile (masked ones carry dS = 0); then
  the cast and the dK / dQ MMAs as without a mod (dK and dQ still times the scale at the end).
  No score_mod_bwd (``grad`` None): refused, as ``interface._flash_attn_bwd`` asserts.
* step 4 with a mask_mod: ``mask.py`` ``apply_mask`` (``mask_seqlen=True`` on every block).  The
  backward resolves the flags *without* the mask_mod (``_flash_attn_bwd`` calls
  ``_resolve_causal_local_window(causal, ...)`` with no mask_mod; ``FlashAttnFunc.backward`` passes
  ``ctx.causal``): with ``causal`` or a window, the tiles, the block range and the mask are the
  flags' and ``apply_mask``'s causal / local branch ignores the mask_mod; without them every
  query block is visited (all of ``get_m_block_min_max``) and the mask_mod masks each.  The
  forward did the opposite (a mask_mod drops the flags there), so with both given forward and
  backward differentiate different functions: production's behaviour, modelled as is.
* block sparsity (``block_sparse_utils.py`` ``consume_block_sparse_mma_bwd_sm90``; SM100
  ``get_m_block_from_iter_bwd``): per KV block, the query blocks of its *partial* list (the
  mask_mod applied; ascending list order, each sparse block's ``q_subtile_factor`` tiles in
  order), then of its *full* list (no mask_mod, seqlen masking only), skipping tiles at or past
  ``m_block_max``; dK / dV accumulate in that order (the first visited starts them), dQ adds into
  dq_accum per (query block, KV block) in ascending KV block (the model's order, and the
  deterministic ``dq_write_order`` rank).  A KV block with no query block: dK = dV = 0
  ("KV tile with zero Q blocks produces no dK/dV; write zeros").  Tiles from
  ``_tile_size_bwd_sm90(..., sparse_block_size_q)`` (:func:`bwd_plan`); the sparse block must be
  (q_subtile_factor * tile_m, tile_n) on SM90 (``normalize_block_sparse_config_bwd``); SM100 takes
  2-CTA when ``kv_subtile_factor`` is even (``block_sparse_bwd_supports_2cta``) — that CTA-pair
  dQ reduction under block sparsity is not modelled (refused), nor are mods on SM100's
  dedicated head-dim-256 kernels.

This module imports nothing of the forward model (``fa4.autograd`` imports it): the primitives
it shares with the forward — the exp2 model, the mask rule, the float32 scales and the broadcasting FFMA —
come from ``fa4.primitives``, the same functions the forward calls.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fa4.code_paths import sm90_bwd_tile, sm100_bwd_tile
from fa4.primitives import FP8 as _FP8
from fa4.primitives import LOG2_E as _LOG2_E
from fa4.primitives import (
    apply_mask_mod,
    apply_score_mod,
    bind_model_scalars,
    check_block_sparse,
    check_mods,
    hardware_exp2,
    softcap_tanh,
)
from fa4.primitives import fma as _fma
from fa4.primitives import scales as _scales
from fa4.primitives import visible as _visible
from numerics.fp import flush_to_zero, round_to
from numerics.fp import to_f32 as _f32
from numerics.tensor_core import tc_dot

__all__ = ["attention_backward", "bwd_plan", "BwdPlan", "reduce_add", "fold_order"]


@dataclass(frozen=True)
class BwdPlan:
    """Production's backward configuration for one call, after the numerics' knobs.

    tile_m, tile_n: query rows / keys per block; dq_keys: keys one dQ MMA reduces (tile_n, or
    2 * tile_n with SM100's 2-CTA pair); post_threads: threads of the dQ postprocess CTA that
    reduces dsink; hdimv_multiple: the padding of head_dim_v the preprocess tiles with;
    dq_descending: dq_accum takes the KV blocks last first (deterministic causal / local,
    production's ``spt``), else first to last; hd256: SM100's dedicated head-dim-256 kernels
    (module doc, "Head dim 256 on SM100")."""

    tile_m: int
    tile_n: int
    dq_keys: int
    post_threads: int
    hdimv_multiple: int
    dq_descending: bool
    hd256: bool = False


def bwd_plan(
    numerics, head_dim: int, head_dim_v: int, causal: bool, local: bool, *, block_sparse: tuple | None = None
) -> BwdPlan:
    """The tiles production picks (``interface._flash_attn_bwd``: SM90 ``_tile_size_bwd_sm90``;
    SM100 128 x 128, 2-CTA for head_dim >= 128; ``fa4.code_paths.sm90_bwd_tile`` /
    ``sm100_bwd_tile``), overridden by the numerics' ``bwd_*`` knobs.  ``block_sparse``: the
    sparse block size (block_q, block_k) of a block-sparse call: SM90 ``_tile_size_bwd_sm90(...,
    sparse_block_size_q)`` (head dim in (96, 128]: tile_m 64 when block_q is not a multiple of
    80; head dim > 192: 64 x 64); SM100 2-CTA only when block_k covers an even number of tiles
    (``block_sparse_bwd_supports_2cta``)."""
    if numerics.arch == "sm90":
        if block_sparse is not None and numerics.bwd_deterministic:  # refused as production refuses it
            raise NotImplementedError(
                "Deterministic not implemented for block-sparse backward (flash_bwd_sm90.py "
                "FlashAttentionBackwardSm90.dQaccum_store asserts it on SM90)"
            )
        cfg = sm90_bwd_tile(d=head_dim, dv=head_dim_v, causal=causal, local=local)
        tm, tn = cfg.tile_m, cfg.tile_n
        if block_sparse is not None and 96 < head_dim <= 128 and block_sparse[0] % tm:
            tm = 64
        swap_ab = cfg.dkv_swap_ab
        if block_sparse is not None and head_dim > 192:  # "keep it at 64": 64 x 64, no dKV_swapAB
            tm, tn, swap_ab = 64, 64, False
        # num_threads_post_dQ: 128 with dQ_single_wg, else num_wg (2) * 128; hdim_multiple_of 64 with dKV_swapAB
        cta_pair, post, mult = False, 128 if cfg.dq_single_wg else 256, 64 if swap_ab else 32
    elif (head_dim, head_dim_v) == (256, 256) and not numerics.bwd_hd256_generic:
        # interface._flash_attn_bwd: use_dedicated_hd256_kernel; dQ kernel tiles (128, 128), one
        # dQ MMA per KV block of 128; dK/dV kernel 128 query rows per MMA (no CTA-pair dQ reduction)
        tm, tn, _, _ = sm100_bwd_tile(d=head_dim, dv=head_dim_v)
        cta_pair, post, mult = False, 128, 32
    else:
        if (head_dim > 192 or head_dim_v > 128) and (head_dim, head_dim_v) != (256, 256):
            raise NotImplementedError(
                f"the SM100 backward model takes head_dim <= 192 and head_dim_v <= 128, or (256, 256); got "
                f"({head_dim}, {head_dim_v}) (interface._validate_head_dims)"
            )
        # use_2cta_instrs: head_dim >= 128; FLASH_ATTENTION_HD256_GENERIC_BWD: n_block_size 64
        tm, tn, cta_pair, _ = sm100_bwd_tile(d=head_dim, dv=head_dim_v, hd256_generic=numerics.bwd_hd256_generic)
        if block_sparse is not None and block_sparse[1] % tn == 0:
            cta_pair = cta_pair and (block_sparse[1] // tn) % 2 == 0
        post, mult = 128, 32
    tm = numerics.bwd_tile_m or tm
    tn = numerics.bwd_tile_n or tn
    dq_tiles = numerics.bwd_dq_tiles or (2 if cta_pair else 1)
    spt = numerics.bwd_deterministic and (causal or local)  # FlashAttentionBackwardSm90/Sm100: self.spt
    hd256 = numerics.arch == "sm100" and (head_dim, head_dim_v) == (256, 256) and not numerics.bwd_hd256_generic
    return BwdPlan(tm, tn, tn * dq_tiles, post, mult, spt and not hd256, hd256)


def butterfly(x: torch.Tensor) -> torch.Tensor:
    """``utils.warp_reduce(x, add)`` over the last dim (a power of two): offsets 1, 2, 4, ...
    pair adjacent lanes first, so the result is the adjacent-pairs tree sum.  Public: the
    preprocess-order probe (``benchmarks/experiments/h200_preprocess_order.py``) ends its candidate orders
    with it."""
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    return x[..., 0]


def _preprocess_geometry(dv: int, hdimv_multiple: int) -> tuple[int, int]:
    """(head_dim_v padded to ``hdimv_multiple``, ``gmem_k_block_size``: the columns one row's
    threads cover per pass, 8 per thread) of ``FlashAttentionBackwardPreprocess``."""
    dvp = -(-dv // hdimv_multiple) * hdimv_multiple
    return dvp, next(g for g in (128, 64, 32, 16) if dvp % g == 0)


def fold_order(dv: int, hdimv_multiple: int) -> list[int]:
    """The columns a preprocess thread folds for D, as offsets from its first column, in its
    order: element-major over its chunks of 8 (chunk c starts ``c * gmem_k_block_size`` columns
    on) — element 0 of every chunk, then element 1, ... (the ``reduce`` over modes (0, 2) as
    compiled: sm_90a PTX at head dims 192 and 256, sm_100a at 256; the static backward audit
    checks it).  One chunk: column order."""
    dvp, gk = _preprocess_geometry(dv, hdimv_multiple)
    return [c * gk + e for e in range(8) for c in range(dvp // gk)]


def row_dot(out: torch.Tensor, do: torch.Tensor, hdimv_multiple: int) -> torch.Tensor:
    """Step 1, D = rowsum(fp32(O) * fp32(dO)) in the preprocess kernel's order: head_dim_v padded
    to ``hdimv_multiple`` (zeros), copied in 8-element (16-byte) vectors by ``threads_per_row =
    gmem_k_block_size / 8`` threads; each thread folds its columns in :func:`fold_order` in one
    FFMA chain (the products are exact in float32, so FFMA and FADD chains agree), then the warp
    butterfly.  Measured: the chunk-major order left 2 dQ and 12 dK elements of the H200's
    head-dim-256 backward different; this order, none.  out, do: (b, h, sq, dv) -> (b, h, sq).
    Public: that probe (``benchmarks/experiments/h200_preprocess_order.py``) replaces it with each candidate
    order; :func:`_preprocess` looks it up at each call."""
    dv = out.shape[-1]
    dvp, gk = _preprocess_geometry(dv, hdimv_multiple)
    prod = torch.nn.functional.pad(out.float() * do.float(), (0, dvp - dv))
    order = torch.tensor(fold_order(dv, hdimv_multiple), device=prod.device)
    per = prod[..., torch.arange(0, gk, 8, device=prod.device).unsqueeze(1) + order]  # (..., thread, fold)
    acc = per[..., 0].clone()
    for i in range(1, per.shape[-1]):
        acc = acc + per[..., i]
    return butterfly(acc)


def _preprocess(out, do, lse, dlse, plan: BwdPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 1 (``FlashAttentionBackwardPreprocess.kernel``): (D', lse_log2), both (b, h, sq)."""
    d = row_dot(out, do, plan.hdimv_multiple)
    if dlse is not None:
        d = d - dlse.float()  # PdPsum_val -= gdLSE[row]
    lse_log2 = lse * _f32(_LOG2_E)  # lse * LOG2_E if lse != -inf else 0.0
    lse_log2 = torch.where(lse == -math.inf, torch.zeros_like(lse_log2), lse_log2)
    return d, lse_log2


@dataclass(frozen=True)
class _MBlock:
    """One query block of the schedule: rows [i0, i1) meet the key groups [j0, j1) (whole
    ``dq_keys`` groups, the last one cut at sk); keys [jn, j1) are first met here, so their dK /
    dV accumulators start from this block's MMA (``zero_init``)."""

    i0: int
    i1: int
    j0: int
    j1: int
    jn: int


def _schedule(plan: BwdPlan, sq: int, sk: int, causal: bool, window: tuple) -> list[_MBlock]:
    """The (query block, key group) tiles production computes: per key group of ``dq_keys``
    keys, the query blocks [m_min, m_max) of ``block_info.BlockInfo.get_m_block_min_max`` (SM100
    passes the 2-CTA pair's group: ``tile_n * cluster_shape_mnk[0]``); the others hold no
    visible score and are skipped, as production skips them (their P and dS are never formed, so
    a non-finite value there reaches no gradient).  Per query block the groups met form one
    range, because m_min and m_max never decrease along the keys."""
    left, right = window
    if causal:
        right = 0  # interface._resolve_causal_local_window
    tm, gk = plan.tile_m, plan.dq_keys
    n_m = -(-sq // tm)
    lo, hi = [], []
    for g in range(-(-sk // gk)):
        m_min, m_max = 0, n_m
        if right is not None:
            m_min = max(m_min, (g * gk + sq - sk - right) // tm)
        if left is not None:
            m_max = min(m_max, -(-((g + 1) * gk + sq - sk + left) // tm))
        lo.append(m_min)
        hi.append(m_max)
    out = []
    for m in range(n_m):
        groups = [g for g in range(len(lo)) if lo[g] <= m < hi[g]]
        if groups:
            j1 = min(sk, (groups[-1] + 1) * gk)
            first = [g for g in groups if lo[g] == m]  # a suffix of groups: lo never decreases
            out.append(_MBlock(m * tm, min(sq, (m + 1) * tm), groups[0] * gk, j1, first[0] * gk if first else j1))
    return out


@dataclass
class _Inputs:
    """One chunk of (batch x head) rows, heads-major float64 (exact copies of the inputs) with the
    preprocess outputs: q, do (n, sq, .); k, v (n, sk, .), KV heads repeated per query head."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    do: torch.Tensor
    d_prime: torch.Tensor
    neg_lse_log2: torch.Tensor


def _mm(a64: torch.Tensor, b64: torch.Tensor, mma: str, c: torch.Tensor | None = None) -> torch.Tensor:
    """One MMA, a64 (n, r, k) @ b64 (n, k, m) on exact float64 copies of 16-bit values:
    ``mma="exact"`` the exact float64 sum (its consumer rounds once, and adds ``c`` itself);
    ``"tensor_core"`` float32 as the H200's wgmma sums it (``numerics.tensor_core``: k16
    instructions over k in order, the accumulator ``c`` (zeros when None) aligned with each
    instruction's products), the forward model's ``mma`` knob on the backward's five MMAs."""
    if mma == "tensor_core":
        return tc_dot(a64.unsqueeze(-2), b64.mT.unsqueeze(-3), c)
    return a64 @ b64


def _p_and_ds(x: _Inputs, blk: _MBlock, vis, scale: float, softcap: float, sl2: float, mma: str = "exact", mod=None):
    """Steps 2-6 on one block: P and dS (float32).  S = Q K^T and dP = dO V^T are MMAs (exact
    products, one rounding); softcap as the forward model's ``_block_scores``
    (``apply_score_mod_inner``: FMUL, div.rn, tanh.approx, FMUL);
    P = ex2.approx(fma(S, scale_log2, -lse_log2)); dS = P * (dP - D') (FSUB, FMUL); softcap
    backward (``create_softcap_scoremod_bwd``): dS * (1 - t*t), ``1 - t*t`` one FFMA.
    ``mod`` = (score_mod, index tensors, aux) (module doc, "Mods"): the mod replaces softcap;
    ``vis`` may be (n | 1, rows, keys) (a mask_mod's, per head)."""
    rows, keys = slice(blk.i0, blk.i1), slice(blk.j0, blk.j1)
    s = _mm(x.q[:, rows], x.k[:, keys].mT, mma).float()
    t = xs = None
    if mod is not None:  # apply_score_mod on S (acc_S_pre kept for score_mod_bwd)
        xs, s = apply_score_mod(s, scale, *mod)
    elif softcap > 0:
        t = softcap_tanh(s, scale, softcap)
        s = t * _f32(softcap)
    if vis is not None:
        s.masked_fill_(~vis, -math.inf)
    p = hardware_exp2(_fma(s, sl2, x.neg_lse_log2[:, rows, None]))
    dp = _mm(x.do[:, rows], x.v[:, keys].mT, mma).float().sub_(x.d_prime[:, rows, None])
    ds = torch.mul(p, dp, out=dp)
    if mod is not None:  # apply_score_mod_bwd_inner: dS <- score_mod_bwd(dS, fl32(S_pre * scale))
        bwd = mod[0].forms.get("model_bwd")  # fa4.mod_forms
        ds = (bwd or mod[0].grad)(ds, xs, *mod[1], list(mod[2]))
        if not isinstance(ds, torch.Tensor) or ds.dtype != torch.float32:
            raise TypeError(f"score_mod {mod[0].name!r}'s grad returned {getattr(ds, 'dtype', type(ds))} on float32")
        ds = ds.expand(xs.shape).contiguous()
    elif t is not None:
        ds = ds * _fma(-t, t, 1.0)
    return p, ds


def _accumulate_keys(acc: torch.Tensor, rows, ab: tuple, blk: _MBlock, first: bool = True, mma: str = "exact") -> None:
    """Step 8 for one query block: the block's MMA ``ab`` = (a64 (n, keys, rows), b64 (n, rows,
    c)) into the float32 accumulator rows ``rows``: its exact sum added with one rounding (``acc
    + sum``), or with ``mma="tensor_core"`` the accumulator as the wgmma's C; keys first met here
    start from the MMA alone (``zero_init``) — unless ``first`` is False (a later head of an
    hd256 GQA chain: every key has its accumulator already)."""
    jn = blk.jn if first else blk.j1
    old = jn - blk.j0
    if mma == "tensor_core":
        c = acc[rows, blk.j0 : blk.j1].clone()
        c[:, old:] = 0.0
        acc[rows, blk.j0 : blk.j1] = _mm(*ab, mma, c)
        return
    blk_sum = ab[0] @ ab[1]
    if old:
        acc[rows, blk.j0 : jn] = (acc[rows, blk.j0 : jn].double() + blk_sum[:, :old]).float()
    if jn < blk.j1:
        acc[rows, jn : blk.j1] = blk_sum[:, old:].float()


def _dq_chain(ds64: torch.Tensor, k64: torch.Tensor, plan: BwdPlan, mma: str = "exact") -> torch.Tensor:
    """Step 9 of the hd256 dQ kernel: one TMEM accumulator per query block, each KV block's MMA
    adding into it (its exact sum rounded once with the accumulator, or the accumulator as the
    MMA's C), ascending, no atomics."""
    acc = None
    for j in range(0, ds64.shape[-1], plan.dq_keys):
        a, b = ds64[..., j : j + plan.dq_keys], k64[:, j : j + plan.dq_keys]
        if mma == "tensor_core":
            acc = _mm(a, b, mma, acc)
        else:
            acc = (a @ b).float() if acc is None else (acc.double() + a @ b).float()
    return acc


def reduce_add(acc: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """One add of the float32 bulk reduction into dq_accum / dk_accum / dv_accum
    (``copy_utils.cpasync_reduce_bulk_add_f32``: ``cp.reduce.async.bulk...add.f32``, on SM90 and
    SM100): round to nearest, and — the PTX ISA says so of this instruction — subnormal inputs
    and results flushed to sign-preserving zero (found by the static backward audit,
    ``audits/checks/static/backward.py``: every reduction production compiles is this one)."""
    return flush_to_zero(flush_to_zero(acc) + flush_to_zero(x))


def _dq_block(ds64: torch.Tensor, k64: torch.Tensor, plan: BwdPlan, mma: str = "exact") -> torch.Tensor:
    """Step 9 for one query block: per key group of ``dq_keys`` the dQ MMA's float32 tile, added
    into the zeroed float32 dq_accum rows (``reduce_add``) in the model's order (module doc).
    ds64: (n, rows, keys); k64: (n, keys, d) -> (n, rows, d) float32 (unscaled)."""
    starts = range(0, ds64.shape[-1], plan.dq_keys)
    acc = torch.zeros(*ds64.shape[:2], k64.shape[-1], dtype=torch.float32, device=ds64.device)
    for j in reversed(starts) if plan.dq_descending else starts:
        acc = reduce_add(acc, _mm(ds64[..., j : j + plan.dq_keys], k64[:, j : j + plan.dq_keys], mma).float())
    return acc


def _reduce_heads(acc: torch.Tensor, hk: int, scale: float, dtype) -> torch.Tensor:
    """Step 8's epilogue: (b, hq, sk, c) float32 partials -> (b, sk, hk, c) in ``dtype``.  GQA:
    the heads of a group are added in order into a zeroed float32 buffer (``epilogue_dKV``'s
    ``reduce_add``); one head per group: the accumulator itself, no reduction.  Then times
    ``scale`` (FMUL) and the cast (cvt.rn)."""
    b, hq, sk, c = acc.shape
    g = acc.view(b, hk, hq // hk, sk, c)
    tot = g[:, :, 0].clone() if hq == hk else reduce_add(torch.zeros_like(g[:, :, 0]), g[:, :, 0])
    for h in range(1, hq // hk):
        tot = reduce_add(tot, g[:, :, h])
    if scale != 1.0:
        tot = tot * scale
    return tot.to(dtype).permute(0, 2, 1, 3).contiguous()


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
    warps = butterfly(acc.view(h, threads // 32, 32))
    total = butterfly(torch.nn.functional.pad(warps, (0, 32 - warps.shape[-1])))
    return total.to(sink.dtype)


@torch.no_grad()  # the model's gradients are values: no double backward
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
    score_mod=None,
    mask_mod=None,
    aux_tensors: list | None = None,
    block_sparse_tensors=None,
    aux_scalars: tuple | None = None,
):
    """Production's backward (module doc) of ``fa4.model.attention``; ``numerics`` an
    ``fa4.knobs.FA4Numerics`` (arch and the ``bwd_*`` / ``ds_dtype`` knobs).

    q: (b, sq, hq, d); k: (b, sk, hk, d); v: (b, sk, hk, dv), bf16 or fp16; out, do: (b, sq,
    hq, dv) in the input dtype (out as the forward returned it); lse, dlse: (b, hq, sq) float32.
    Returns (dq, dk, dv) in the input dtype and dsink in the sink's dtype (None without sink).
    The mods: ``numerics.mods`` objects (module doc, "Mods"); ``causal`` / ``window_size`` as the
    caller gave them (production's backward keeps them beside a mask_mod); ``aux_scalars`` the
    forward's (``FlashAttnFunc.backward`` passes ``ctx.aux_scalars``), bound as the forward binds them.
    """
    _validate(q, k, v, out, do)
    check_mods(softcap, score_mod, mask_mod, aux_tensors, block_sparse_tensors)
    score_mod, mask_mod, block_sparse_tensors = bind_model_scalars(
        aux_scalars, score_mod, mask_mod, block_sparse_tensors
    )
    if score_mod is not None and score_mod.grad is None:
        raise NotImplementedError(
            f"score_mod {score_mod.name!r} has no backward (grad): interface._flash_attn_bwd asserts "
            "'score_mod_bwd is required when score_mod is provided'"
        )
    b, sq, hq, d = q.shape
    sk, hk, dv_ = k.shape[1], k.shape[2], v.shape[-1]
    local = not causal and any(w is not None for w in window_size)
    bs = block_sparse_tensors
    plan = bwd_plan(numerics, d, dv_, causal, local, block_sparse=None if bs is None else tuple(bs.block_size))
    if plan.hd256:
        _hd256_refusals(softcap, local, learnable_sink, dlse)
        if score_mod is not None or mask_mod is not None or bs is not None:
            raise NotImplementedError("mods on SM100's dedicated head_dim=256 backward kernels are not modelled")
    scale, softcap, sl2 = _scales(d, softmax_scale, softcap)
    if score_mod is not None:  # FlashAttentionBackwardSm90/Sm100.__call__: LOG2_E only, the scale is the mod's
        sl2 = _f32(_LOG2_E)
    aux = tuple(aux_tensors or ())
    flags = causal or local  # mask.py apply_mask: the causal / local branch ignores the mask_mod
    use_mm = mask_mod is not None and not flags
    out_t, do_t = out.permute(0, 2, 1, 3), do.permute(0, 2, 1, 3)
    d_prime, lse_log2 = _preprocess(out_t, do_t, lse.float(), dlse, plan)  # step 1
    ds_dtype = numerics.ds_dtype or q.dtype
    mma = numerics.mma
    if bs is not None and plan.dq_keys != plan.tile_n:
        raise NotImplementedError(
            "the SM100 block-sparse backward with 2-CTA (an even kv_subtile_factor at head_dim >= 128: "
            "block_sparse_bwd_supports_2cta) is not modelled"
        )
    mods = (score_mod, mask_mod if use_mm else None, aux)
    if bs is not None:
        acc, dq = _sparse_backward(
            q,
            k,
            v,
            do,
            d_prime,
            lse_log2,
            plan,
            bs,
            (causal, window_size),
            mods,
            (scale, softcap, sl2),
            ds_dtype,
            mma,
            numerics.arch,
        )
    else:
        acc, dq = _dense_backward(
            q, k, v, do, d_prime, lse_log2, plan, (causal, window_size), mods, (scale, softcap, sl2), ds_dtype, mma
        )
    chain = plan.hd256 and hq > hk
    h_acc = hk if chain else hq
    dv = _reduce_heads(acc["dv"].view(b, h_acc, sk, dv_), hk, 1.0, q.dtype)
    dk = _reduce_heads(acc["dk"].view(b, h_acc, sk, d), hk, scale, q.dtype)
    dq = dq if plan.hd256 else dq * scale
    dq = dq.to(q.dtype).view(b, hq, sq, d).permute(0, 2, 1, 3).contiguous()
    dsink = None if learnable_sink is None else _dsink(learnable_sink, lse.float(), d_prime, plan.post_threads)
    return dq, dk, dv, dsink


def _mod_index(bh: torch.Tensor, hq: int, rows: tuple[int, int], keys: tuple[int, int]) -> tuple:
    """Index tensors (b, h, q_idx, kv_idx) of a backward tile: ``bh`` the (batch x query head)
    rows (flat), each (n, 1, 1); q_idx (1, rows, 1); kv_idx (1, 1, keys): broadcasting to the
    tile's (n, rows, keys) (the mods are elementwise, ``numerics.mods``)."""
    dev = bh.device
    q = torch.arange(*rows, device=dev).view(1, -1, 1)
    kv = torch.arange(*keys, device=dev).view(1, 1, -1)
    return (bh // hq).view(-1, 1, 1), (bh % hq).view(-1, 1, 1), q, kv


def _tile_mods(mods: tuple, bh: torch.Tensor, hq: int, blk: _MBlock, apply_mask: bool = True):
    """(``_p_and_ds``'s ``mod``, the mask_mod's visibility or None) for one tile."""
    score_mod, mask_mod, aux = mods
    if score_mod is None and (mask_mod is None or not apply_mask):
        return None, None
    idx = _mod_index(bh, hq, (blk.i0, blk.i1), (blk.j0, blk.j1))
    mod = None if score_mod is None else (score_mod, idx, aux)
    vis = apply_mask_mod(mask_mod, idx, aux) if mask_mod is not None and apply_mask else None
    return mod, vis


def _dense_backward(q, k, v, do, d_prime, lse_log2, plan: BwdPlan, flags: tuple, mods: tuple, sc: tuple, ds_dtype, mma):
    """Steps 2-9 over production's (query block, key group) schedule (``_schedule``), streamed by
    chunks of (batch x head) rows.  Returns the float32 dK / dV accumulators and dq_accum."""
    b, sq, hq, d = q.shape
    sk, hk, dv_ = k.shape[1], k.shape[2], v.shape[-1]
    causal, window_size = flags
    scale, softcap, sl2 = sc
    sched = _schedule(plan, sq, sk, causal, window_size)
    masks = [_block_mask(blk, sq, sk, causal, window_size, q.device) for blk in sched]
    chain = plan.hd256 and hq > hk  # GQA summed in one MMA chain, head-major
    n_acc = b * hk if chain else b * hq
    acc = {n: torch.zeros(n_acc, sk, c, dtype=torch.float32, device=q.device) for n, c in (("dk", d), ("dv", dv_))}
    dq = torch.zeros(b * hq, sq, d, dtype=torch.float32, device=q.device)
    step = max(1, _CHUNK_ELEMENTS // (plan.tile_m * sk))
    all_bh = torch.arange(b * hq, device=q.device)
    for rows_q, rows_acc, first in _row_chunks(b, hq, hk, step, chain, q.device):
        x = _heads_major(q, k, v, do, d_prime, lse_log2, rows_q)
        for blk, vis in zip(sched, masks):
            mod, mm = _tile_mods(mods, all_bh[rows_q], hq, blk)
            if mm is not None:  # the mask_mod branch of apply_mask (no flags), with mask_seqlen
                vis = mm
            p, ds = _p_and_ds(x, blk, vis, scale, softcap, sl2, mma, mod)  # steps 2-6
            p64 = round_to(p, q.dtype).double()  # step 7
            ds_k = ds.masked_fill(~vis, 0.0) if plan.hd256 and causal and vis is not None else ds
            ds64 = round_to(ds_k, ds_dtype, saturate=ds_dtype in _FP8).double()
            rows, keys = slice(blk.i0, blk.i1), slice(blk.j0, blk.j1)
            _accumulate_keys(acc["dv"], rows_acc, (p64.mT, x.do[:, rows]), blk, first, mma)  # step 8
            _accumulate_keys(acc["dk"], rows_acc, (ds64.mT, x.q[:, rows]), blk, first, mma)
            if plan.hd256:  # the dQ kernel scales dS in float32 before its cast, and chains
                ds_q = round_to(ds * _f32(scale), ds_dtype, saturate=ds_dtype in _FP8).double()
                dq[rows_q, rows] = _dq_chain(ds_q, x.k[:, keys], plan, mma)
            else:
                dq[rows_q, rows] = _dq_block(ds64, x.k[:, keys], plan, mma)  # step 9
    return acc, dq


def block_sparse_q_order(bs, b: int, h: int, n: int, plan: BwdPlan, m_block_max: int) -> list[tuple[int, bool]]:
    """The query tiles KV tile ``n`` (batch ``b``, head ``h``: indices into the block masks,
    broadcast dims 0) visits in production's backward, each with whether it is partial (the
    mask_mod applied): ``consume_block_sparse_mma_bwd_sm90`` / ``get_m_block_from_iter_bwd`` —
    the partial list, then the full list, each in list order (ascending), a sparse query block's
    ``q_subtile_factor`` tiles in order, tiles at or past ``m_block_max`` skipped."""
    qsub = bs.block_size[0] // plan.tile_m
    c = n // (bs.block_size[1] // plan.tile_n)
    out = []
    for mask, partial in ((bs.partial, True), (bs.full, False)):
        for sb in mask[b, h, :, c].nonzero().flatten().tolist():
            out += [(sb * qsub + j, partial) for j in range(qsub) if sb * qsub + j < m_block_max]
    return out


def _sparse_backward(
    q, k, v, do, d_prime, lse_log2, plan: BwdPlan, bs, flags: tuple, mods: tuple, sc: tuple, ds_dtype, mma, arch
):
    """Steps 2-9 under block sparsity (module doc, "Mods"): per KV tile (ascending: dQ's adds in
    that order, descending with ``dq_descending``), per group of (batch x head) rows sharing a
    visit order (:func:`block_sparse_q_order`), the query tiles in that order: dK / dV start on the
    first, dq_accum takes each tile's dQ MMA (``reduce_add``).  Returns the accumulators."""
    b, sq, hq, d = q.shape
    sk, dv_ = k.shape[1], v.shape[-1]
    causal, window = flags
    scale, softcap, sl2 = sc
    tm, tn = plan.tile_m, plan.tile_n
    check_block_sparse(bs, b, hq, sq, sk, tm, tn, arch)
    left = None if causal else window[0]
    acc = {n: torch.zeros(b * hq, sk, c, dtype=torch.float32, device=q.device) for n, c in (("dk", d), ("dv", dv_))}
    dq = torch.zeros(b * hq, sq, d, dtype=torch.float32, device=q.device)
    x = _heads_major(q, k, v, do, d_prime, lse_log2, slice(None))
    B, H = bs.full.shape[:2]
    full, part = bs.full.cpu(), bs.partial.cpu()
    bsc = type(bs)(full, part, tuple(bs.block_size))
    bh_all = torch.arange(b * hq).view(b, hq)
    n_blocks = range(-(-sk // tn))
    for n in reversed(n_blocks) if plan.dq_descending else n_blocks:
        m_max = -(-sq // tm)  # get_m_block_min_max: only a left window lowers m_block_max
        if left is not None:
            m_max = min(m_max, -(-((n + 1) * tn + sq - sk + left) // tm))
        groups: dict[tuple, list] = {}
        for i in range(B):
            for j in range(H):
                order = tuple(block_sparse_q_order(bsc, i, j, n, plan, m_max))
                rows = bh_all[i if B > 1 else slice(None)][..., j if H > 1 else slice(None)]
                groups.setdefault(order, []).append(rows.reshape(-1))
        j0, j1 = n * tn, min((n + 1) * tn, sk)
        for order, rows in groups.items():
            bh = torch.cat(rows).sort().values.to(q.device)
            xg = _Inputs(*(t[bh] for t in (x.q, x.k, x.v, x.do, x.d_prime, x.neg_lse_log2)))
            for t, (m, partial) in enumerate(order):
                i0, i1 = m * tm, min((m + 1) * tm, sq)
                blk = _MBlock(i0, i1, j0, j1, j0 if t == 0 else j1)
                vis = _block_mask(blk, sq, sk, causal, window, q.device)  # the flags (causal / local branch)
                mod, mm = _tile_mods(mods, bh, hq, blk, apply_mask=partial)
                if mm is not None:  # a partial block: the mask_mod branch of apply_mask
                    vis = mm
                p, ds = _p_and_ds(xg, blk, vis, scale, softcap, sl2, mma, mod)  # steps 2-6
                p64 = round_to(p, q.dtype).double()  # step 7
                ds64 = round_to(ds, ds_dtype, saturate=ds_dtype in _FP8).double()
                _accumulate_keys(acc["dv"], bh, (p64.mT, xg.do[:, i0:i1]), blk, True, mma)  # step 8
                _accumulate_keys(acc["dk"], bh, (ds64.mT, xg.q[:, i0:i1]), blk, True, mma)
                dq[bh, i0:i1] = reduce_add(dq[bh, i0:i1], _mm(ds64, xg.k[:, j0:j1], mma).float())  # step 9
    return acc, dq


def _row_chunks(b: int, hq: int, hk: int, step: int, chain: bool, device):
    """The (batch x query head) rows in processing order, ``step`` at a time: (rows of the
    heads-major inputs, rows of the dK / dV accumulator, whether those accumulators start here).
    Generic: consecutive rows, one accumulator each.  hd256 GQA chain: query head r of every
    group after head r - 1 (``r`` outer), into the group's accumulator."""
    if not chain:
        for c0 in range(0, b * hq, step):
            yield slice(c0, c0 + step), slice(c0, c0 + step), True
        return
    g = hq // hk
    grp = torch.arange(b * hk, device=device)  # (batch, kv head) in order
    for r in range(g):
        rows = (grp // hk) * hq + (grp % hk) * g + r
        for c0 in range(0, b * hk, step):
            yield rows[c0 : c0 + step], grp[c0 : c0 + step], r == 0


def _hd256_refusals(softcap: float, local: bool, learnable_sink, dlse) -> None:
    """What SM100's dedicated head-dim-256 backward refuses (interface._flash_attn_bwd and
    ``sm100_hd256_2cta_fmha_backward.BlackwellFusedMultiHeadAttentionBackward.__init__``)."""
    why = None
    if softcap:
        why = "softcap (interface._flash_attn_bwd: 'does not support softcap')"
    elif local:
        why = "local attention (BlackwellFusedMultiHeadAttentionBackward.__init__)"
    elif learnable_sink is not None:
        why = "learnable_sink (interface._flash_attn_bwd: 'does not support learnable_sink')"
    elif dlse is not None:
        why = "a gradient of the LSE (interface._flash_attn_bwd: 'does not support dlse', asserted at compile time)"
    if why:
        raise NotImplementedError(f"the SM100 backward with head_dim=256 does not support {why}")


#: (batch x head) rows per chunk times tile_m x seqlen_k: bounds the float64 block temporaries
#: (about 32 MiB each) so the CPU model streams through cache-sized blocks at any length.
_CHUNK_ELEMENTS = 1 << 22


def _block_mask(blk: _MBlock, sq: int, sk: int, causal: bool, window: tuple, device):
    """The block's visibility (``fa4.primitives.visible``), or None where every score is kept."""
    vis = _visible(sq, sk, causal, window, device, rows=(blk.i0, blk.i1), cols=(blk.j0, blk.j1))
    return None if bool(vis.all()) else vis


def _heads_major(q, k, v, do, d_prime, lse_log2, rows: slice) -> _Inputs:
    """``_Inputs`` for the (batch x head) rows ``rows``: (b, s, h, .) -> (b*h, s, .) float64."""
    hq = q.shape[2]

    def hm(t):
        t = t.repeat_interleave(hq // t.shape[2], dim=2) if t.shape[2] != hq else t
        return t.permute(0, 2, 1, 3).reshape(-1, t.shape[1], t.shape[3])[rows].double()

    flat = lambda t: t.reshape(-1, t.shape[-1])[rows]
    return _Inputs(hm(q), hm(k), hm(v), hm(do), flat(d_prime), -flat(lse_log2))


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
