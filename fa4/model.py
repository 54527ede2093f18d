"""Bit-faithful numerics model of the FA4 forward kernel: the Blackwell (SM100) path with its
polynomial exp2 and lazy rescaling, and the Hopper (SM90) path, knob by knob.

``attention(q, k, v, *, ..., numerics=None)`` has the audited-callable signature of
``flash_attn.cute.flash_attn_func`` (docs/design.md) plus ``numerics``, an :class:`FA4Numerics`.
Each step follows production's order and precision; the production function it models is named
where it happens (flash-attn-4 4.0.0b36, ``flash_attn/cute``):

1. S = Q K^T in float32 — the tensor-core MMA.  *Assumption*: every product is exact and the
   d-term sum is rounded once to float32 (computed in float64 from the exact inputs).  The MMA's
   internal summation order and truncation are not specified by the source and cannot be
   reproduced on a CPU; the fidelity report measures the consequence.
2. softcap (``utils.create_softcap_scoremod`` via ``apply_score_mod_inner``): ``s*scale``,
   ``/ softcap`` (``div.rn``, :func:`fa4.primitives.div_rn`), ``tanh`` (MUFU.TANH: the
   instruction on CUDA, else modelled correctly rounded), ``* softcap``, each rounded (SASS);
   then ``scale_log2 = log2(e)``.  Without softcap ``scale_log2 = fl32(scale * log2(e))``.
3. Masks (``mask.py`` ``AttentionMask.apply_mask``): -inf outside the causal / local window
   (bottom-right aligned) and beyond seqlen_k.  KV blocks run from the last to the first
   (``flash_fwd_sm90.py`` ``mma``; the SM100 softmax loop), over the block range of the row's
   query tile (``block_info.py`` ``get_n_block_min_max``).
4. Row max (``Softmax.online_softmax`` / ``SoftmaxSm100.update_row_max``): NaN-quiet
   ``max.f32``; SM100 keeps the old max while ``(old - new) * scale_log2 >= -rescale_threshold``
   (lazy rescaling; threshold 0 disables it: the max moves at every block, as on SM90).
5. ``t = fma(s, scale_log2, bias)``, ``bias = fma(-max, scale_log2, max_offset)`` — ptxas
   fuses both (``SoftmaxSm100.scale_subtract_rowmax``; on SM90 ``bias = -fl32(max*scale_log2)``
   and ``s*scale_log2 - bias`` is one FFMA; with max_offset 0 the two forms agree).
6. ``P = exp2(t)`` per element: hardware (``ex2.approx.ftz``, modelled as the correctly rounded
   exp2 with flush-to-zero: see :func:`hardware_exp2`) or the bit-exact polynomial
   (``fa4.ex2.ex2_emulation_2``) on the columns ``SoftmaxSm100.apply_exp2_convert`` emulates.
7. Row sum of the *unrounded* float32 P in production's order (``utils.fadd_reduce``: SM100
   eight packed lanes; SM90 four thread-partial sequential chains reduced at the end).
8. P cast to ``p_dtype`` (round to nearest even; fp8 saturating: ``cvt.rn.satfinite``).
9. O = O * acc_scale + P V per block (float32 accumulator; the MMA sum rounded once, as 1.).
10. Finalize (``Softmax.finalize`` / SM100 epilogue): learnable sink folded into the row sum,
    ``rcp_approx`` (modelled as the correctly rounded reciprocal), O * rcp, the output cast
    (fp8 inputs give bf16), LSE in natural log with max_offset accounted for.

NaN semantics come along: a NaN score is ignored by the row max, swallowed (P = 0) where the
polynomial exp2 handles it and propagated by the hardware exp2.

Mods (``score_mod``, ``mask_mod``, ``aux_tensors``, ``block_sparse_tensors``: the ``numerics.mods``
objects; the reference forms evaluated in float32), where production applies them:

* score_mod, step 2 (``flash_fwd_sm90.py`` ``mma_one_n_block`` / ``first_half_block_overlap``,
  ``flash_fwd_sm100.py`` ``softmax_step``: ``apply_score_mod`` *before* the mask, on every
  visited block): ``softmax.py`` ``apply_score_mod_inner`` takes ``fl32(S * softmax_scale)`` (one
  FMUL) and the mod's float32 result (:func:`fa4.primitives.apply_score_mod`);
  ``utils.compute_softmax_scale_log2`` makes ``scale_log2 = LOG2_E`` (not ``fl32(scale *
  LOG2_E)``): so an identity score_mod gives ``fma(fl32(S*scale), LOG2_E, bias)`` where no mod
  gives ``fma(S, fl32(scale*LOG2_E), bias)`` — not the same bits in general.  ``softcap`` and a
  score_mod together are refused (``interface._flash_attn_fwd``).
* mask_mod, step 3 (``mask.py`` ``AttentionMask.apply_mask``'s mask_mod branch, SM100
  ``apply_mask_sm100``): a key is kept where the mod keeps it, and (on the first block visited,
  ``mask_seqlen=True``) below seqlen_k.  ``interface._resolve_causal_local_window`` drops
  ``causal`` and the window when a mask_mod is given (``causal=False, local=False``): every KV
  block is visited (``get_n_block_min_max`` without causal), from the last to the first, the
  mask_mod applied on every one (the interior loop runs ``mask_fn`` "if mask_mod is not None"),
  and the tiles / exp2 interleave are the non-causal ones (``FA4Numerics.for_inputs`` gets
  ``causal=False``).  The backward keeps ``causal`` (``fa4.model_bwd``).
* block sparsity (``block_sparse_utils.py`` ``consume_block_sparse_loads`` on SM90,
  ``softmax_block_sparse_sm100`` on SM100): per query tile only the listed KV blocks, the
  *partial* ("mask") list first, then the *full* list, each list from its last entry to its
  first (lists ascending, as ``compute_block_sparsity`` / flex's ``BlockMask`` build them: so
  each list runs from its highest block down); a sparse KV block of ``kv_subtile_factor`` tiles
  from its last tile to its first; the mask_mod on partial blocks only (full blocks:
  ``mask_mod=None``, seqlen masking only); the causal/window flags, when no mask_mod dropped them,
  on every visited block — but on SM100 the full list's inner blocks (all but its first coarse
  block) run with ``mask_fn=None`` (``softmax_block_sparse_sm100_list``,
  ``allow_unmasked_inner_blocks``): there not even the flags mask.  A query tile with no block:
  out 0, LSE -inf (SM90 ``softmax.reset(); acc_O.fill(0)``; SM100
  ``handle_block_sparse_empty_tile_correction_sm100``).  Block sizes:
  ``block_sparsity.normalize_block_sparse_config`` requires the sparse query block to be a
  multiple of ``q_stage * tile_m`` and the sparse KV block a multiple of tile_n (SM90: equal to
  it, after ``interface._fit_sm90_fwd_tile_to_block_sparsity``), and SM100 turns 2-CTA off
  (``use_2cta_instrs ... and not use_block_sparsity``): ``FA4Numerics.for_inputs(...,
  block_sparse=(block_q, block_k))`` picks the tiles as production does.
* mask_mod or block sparsity make visibility per element and the visit order per tile, so they
  take the plain loop (torch); a score_mod alone keeps the fast loop (``fa4.forward_loop``).
  ``masked_exp2="hardware"``: with a mask_mod every iteration applies a mask; with block sparsity
  the partial blocks and the first KV block of the full list (its seqlen mask), as
  ``softmax_block_sparse_sm100_list`` calls ``mask_fn``.

Where each part lives: the numerics record and production's tables that fill it,
``fa4.knobs``; steps 1-9 over the KV blocks (and the fast CPU loop), ``fa4.forward_loop``; the
per-row arithmetic of steps 2-10, ``fa4.forward_steps``; the block-sparse visit order,
``fa4.block_sparse``.  When an input requires grad, ``attention`` runs under an autograd function
(``fa4.autograd``) whose backward is ``fa4.model_bwd.attention_backward`` (production's backward
kernels, modelled the same way).  The primitives both directions share — :func:`hardware_exp2`,
the mask rule, the float32 scales, the broadcasting FFMA — live in ``fa4.primitives``.
"""

from __future__ import annotations

import torch

from fa4.autograd import differentiable
from fa4.block_sparse import block_sparse_kv_order
from fa4.forward_loop import FwdMods, attention_forward
from fa4.knobs import SUPPORTED_DTYPES, FA4Numerics, check_dtype, sm90_sparse_fwd_tile
from fa4.primitives import bind_model_scalars, check_mods, hardware_exp2
from numerics.mods import BlockSparse, MaskMod, ScoreMod

__all__ = [
    "FA4Numerics",
    "attention",
    "hardware_exp2",
    "SUPPORTED_DTYPES",
    "FwdMods",
    "block_sparse_kv_order",
    "sm90_sparse_fwd_tile",
]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int | None, int | None] = (None, None),
    softcap: float = 0.0,
    learnable_sink: torch.Tensor | None = None,
    return_lse: bool = False,
    numerics: FA4Numerics | None = None,
    score_mod: ScoreMod | None = None,
    mask_mod: MaskMod | None = None,
    aux_tensors: list | None = None,
    block_sparse_tensors: BlockSparse | None = None,
    aux_scalars: tuple | None = None,
):
    """The FA4 forward pass as production computes it (module doc), on q's device.

    q: (b, sq, hq, d); k: (b, sk, hk, d); v: (b, sk, hk, dv); hq % hk == 0; dtype bf16, fp16,
    fp8 e4m3fn / e5m2 (descale 1).  Returns out (b, sq, hq, dv) in the input dtype (bf16 for
    fp8 inputs) and, with ``return_lse``, lse (b, hq, sq) float32.  ``numerics=None``:
    ``FA4Numerics.sm100`` for these inputs (with a mask_mod: as non-causal; with block
    sparsity: its block size).  Differentiable when q, k, v or learnable_sink requires grad
    (grad mode on): the backward is production's, ``fa4.model_bwd``.  The mods (module doc,
    "Mods"): ``numerics.mods`` objects; ``aux_tensors`` the list every mod reads from,
    ``aux_scalars`` the runtime scalars (handed to the mods' forms only when given,
    ``fa4.primitives.bind_model_scalars``; kept for the backward).  With a mask_mod, ``causal``
    and ``window_size`` are ignored in the forward, as production ignores them
    (``interface._resolve_causal_local_window``); the backward keeps them.
    """
    validate_inputs(q, k, v, learnable_sink)
    check_mods(softcap, score_mod, mask_mod, aux_tensors, block_sparse_tensors)
    score_mod, mask_mod, block_sparse_tensors = bind_model_scalars(
        aux_scalars, score_mod, mask_mod, block_sparse_tensors
    )
    kw = dict(
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=window_size,
        softcap=softcap,
        score_mod=score_mod,
        mask_mod=mask_mod,
        aux_tensors=aux_tensors,
        block_sparse_tensors=block_sparse_tensors,
    )
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, learnable_sink)):
        out, lse = differentiable(q, k, v, learnable_sink, numerics, kw)
    else:
        out, lse = attention_forward(q, k, v, numerics=numerics, learnable_sink=learnable_sink, **kw)
    return (out, lse) if return_lse else out


def validate_inputs(q, k, v, sink) -> None:
    """Reject what the model cannot stand for — not 4-d (batch, seqlen, heads, dim), a dtype
    outside ``SUPPORTED_DTYPES``, mixed dtypes, mismatched shapes, heads_q not a multiple of
    heads_kv, a learnable sink not of shape (heads_q,) — with the value and what is accepted,
    before any work.  Public for ``fa4.varlen``, which checks each sequence the same way."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(
                f"{name} must be a 4-d tensor (batch, seqlen, heads, dim), got {getattr(t, 'shape', type(t))}"
            )
        check_dtype(t.dtype)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"incompatible shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"heads_q ({q.shape[2]}) must be a multiple of heads_kv ({k.shape[2]})")
    if sink is not None and sink.shape != (q.shape[2],):
        raise ValueError(f"learnable_sink must have shape (heads_q,) = ({q.shape[2]},), got {tuple(sink.shape)}")
