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
  take the plain loop (torch); a score_mod alone keeps the fast loop (its step 2 is in
  :meth:`_Loop.scores`, before the compiled step).  ``masked_exp2="hardware"``: with a mask_mod
  every iteration applies a mask; with block sparsity the partial blocks and the first KV block
  of the full list (its seqlen mask), as ``softmax_block_sparse_sm100_list`` calls ``mask_fn``.

On CPU the loop runs fast (numba) and gives the bits of the plain loop — every row of
every block through the torch functions of steps 3-9, S and P V by einsums over all rows: a
block's float64 GEMMs cover only a window of the rows that visit it (:func:`_row_window`; MKL
gives each row the same float64 sum then), steps 3-8 and step 9's accumulator run as compiled
loops (``fa4.ex2_cpu.softmax_block`` and ``o_update``) that hand back to the torch functions
every row they cannot decide exactly (a NaN; a float64 intermediate within a few ulps of a
float32 rounding boundary), and a block's softmax step runs on a background thread beside its
neighbours' GEMMs (:func:`_run_fast`).  ``docs/performance.md``: the profile and the argument;
``tests/test_model_speed_bits.py``: the fast loop against the plain one, bit for bit.

When an input requires grad, ``attention`` runs under an autograd function whose backward is
``fa4.model_bwd.attention_backward`` (production's backward kernels, modelled the same way).
The primitives both share — :func:`hardware_exp2`, the mask rule, the float32 scales, the
broadcasting FFMA — live in ``fa4.primitives`` (re-exported here under their old names).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from fa4 import ex2_cpu
from fa4.code_paths import SM100_TILE_M, SM100_TILE_N, sm90_fwd_tile, sm100_fwd_geometry
from fa4.ex2 import DEGREES, POLY_EX2, emulated_columns, ex2_emulation_2
from fa4.model_bwd import attention_backward
from fa4.primitives import FP8 as _FP8
from fa4.primitives import LOG2_E as _LOG2_E
from fa4.primitives import (
    apply_mask_mod,
    apply_score_mod,
    bind_model_scalars,
    check_block_sparse,
    check_mods,
    hardware_exp2,
    hardware_lg2,
    hardware_rcp,
    softcap_tanh,
    visible_bounds,
)
from fa4.primitives import fma as _fma
from fa4.primitives import scales as _scales
from numerics.fp import fma_f32, format_of, round_to
from numerics.fp import to_f32 as _f32
from numerics.mods import BlockSparse, MaskMod, ScoreMod, index_grid
from numerics.tensor_core import tc_dot
from numerics.tiles import block_ranges, masked_blocks

__all__ = [
    "FA4Numerics", "attention", "hardware_exp2", "SUPPORTED_DTYPES", "FwdMods", "block_sparse_kv_order",
    "sm90_sparse_fwd_tile",
]  # fmt: skip

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)
_LN2 = math.log(2.0)

# flash_fwd_sm100.py _TUNING_CONFIG: (use_2cta_instrs, is_causal, head_dim_padded, is_sm103)
_SM100_TUNING = {
    (True, False, 128, False): (10, 1),
    (False, True, 128, False): (16, 1),
    (True, False, 192, False): (16, 0),
    (False, True, 192, False): (32, 1),
    (True, False, 128, True): (0, 0),
    (False, True, 128, True): (0, 0),
    (True, False, 192, True): (0, 0),
    (False, True, 192, True): (0, 0),
    (True, False, 256, False): (14, 0),
    (True, True, 256, False): (14, 0),
}
# _FP8_TUNING_CONFIG overrides for fp8
_SM100_FP8_TUNING = {(True, False, 128, False): (10, 1), (False, True, 128, False): (8, 1)}


@dataclass(frozen=True)
class FA4Numerics:
    """The knobs that decide FA4's forward numerics.  A variant to gate is a new value
    (``dataclasses.replace``), not new code.

    arch: ``"sm100"`` or ``"sm90"`` (row-sum order, LSE/finalize form).
    tile_m, tile_n: query rows and keys per tile (tile_n sets the KV block boundaries; tile_m
    only which blocks a query tile visits).
    exp2: ``"mixed"`` (production: emulation on the interleaved columns), ``"emulated"`` (every
    element), ``"hardware"`` (none).
    poly_degree, emu_freq, emu_res, emu_start_frg: the polynomial and the interleave
    (``fa4.ex2.emulated_columns``).
    rescale_threshold: log2 units the row max may lag (0: rescale whenever the max grows).
    max_offset: log2 offset added to every exponent (fp8 spends unused code points).
    p_dtype: dtype P is cast to before P V (None: the input dtype).

    Backward knobs (``fa4.model_bwd``; None: production's choice for the arch and head dim,
    ``fa4.model_bwd.bwd_plan``):
    bwd_tile_m, bwd_tile_n: query rows / keys per backward block (dK/dV accumulate one query
    block per step; dQ one KV block per step).
    bwd_dq_tiles: KV blocks one dQ MMA reduces (SM100's 2-CTA pair: 2).
    bwd_deterministic: production's ``deterministic=True`` (semaphore-ordered dQ adds).
    ds_dtype: dtype dS is cast to before the dK / dQ MMAs (None: the input dtype).
    bwd_hd256_generic: production's ``FLASH_ATTENTION_HD256_GENERIC_BWD=1`` — SM100 head dim
    (256, 256) takes the generic backward (KV tile 64) instead of the dedicated kernels.

    mma: ``"exact"`` (products exact, the sum rounded once: the model's assumption, fast) or
    ``"tensor_core"``: S = Q K^T and O += P V summed as the H200's wgmma does, measured
    (``numerics.tensor_core``, ``docs/tensor-cores.md``): k16 instructions in order, products and
    the accumulator truncated 2 bits below float32's significand at the largest exponent, the
    sum truncated to float32; the P V instruction takes fl32(O * acc_scale) as its accumulator.
    Measured for SM90's wgmma (bf16/fp16); for SM100's tcgen05 the published B200 parameters
    (the same) are unverified here.

    masked_exp2: ``"same"`` (4.0.0b36: a block's exp2 does not depend on masking) or
    ``"hardware"``: the iterations that apply a mask (diagonal, window edge, the partial last
    block) use MUFU.EX2 on every column — the behaviour flash-attention #2595 removed, which
    broke decode/prefill bitwise consistency (#2596): a row's masked blocks differ between a
    prefill tile and a decode step.
    """

    arch: Literal["sm100", "sm90"] = "sm100"
    tile_m: int = 128
    tile_n: int = 128
    exp2: Literal["mixed", "emulated", "hardware"] = "mixed"
    poly_degree: int = 3
    emu_freq: int = 0
    emu_res: int = 4
    emu_start_frg: int = 0
    rescale_threshold: float = 8.0
    max_offset: int = 0
    p_dtype: torch.dtype | None = None
    bwd_tile_m: int | None = None
    bwd_tile_n: int | None = None
    bwd_dq_tiles: int | None = None
    bwd_deterministic: bool = False
    ds_dtype: torch.dtype | None = None
    bwd_hd256_generic: bool = False
    masked_exp2: Literal["same", "hardware"] = "same"
    mma: Literal["exact", "tensor_core"] = "exact"

    def __post_init__(self):
        if self.arch not in ("sm100", "sm90"):
            raise ValueError(f"arch must be 'sm100' or 'sm90', got {self.arch!r}")
        if self.mma not in ("exact", "tensor_core"):
            raise ValueError(f"mma must be 'exact' or 'tensor_core', got {self.mma!r}")
        if self.masked_exp2 not in ("same", "hardware"):
            raise ValueError(f"masked_exp2 must be 'same' or 'hardware', got {self.masked_exp2!r}")
        if self.exp2 not in ("mixed", "emulated", "hardware"):
            raise ValueError(f"exp2 must be 'mixed', 'emulated' or 'hardware', got {self.exp2!r}")
        if self.poly_degree not in DEGREES:
            raise ValueError(f"poly_degree must be one of {list(DEGREES)}, got {self.poly_degree!r}")
        if self.tile_n <= 0 or self.tile_n % 8 or self.tile_m <= 0:
            raise ValueError(
                f"tile_n must be a positive multiple of 8 and tile_m positive, got {self.tile_m}x{self.tile_n}"
            )
        if self.rescale_threshold < 0:
            raise ValueError(f"rescale_threshold must be >= 0 (log2 units), got {self.rescale_threshold}")
        if self.p_dtype is not None and self.p_dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"p_dtype must be one of {SUPPORTED_DTYPES} or None, got {self.p_dtype}")
        for name in ("bwd_tile_m", "bwd_tile_n", "bwd_dq_tiles"):
            val = getattr(self, name)
            if val is not None and (not isinstance(val, int) or val <= 0):
                raise ValueError(f"{name} must be a positive int or None, got {val!r}")
        if self.ds_dtype is not None and self.ds_dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"ds_dtype must be one of {SUPPORTED_DTYPES} or None, got {self.ds_dtype}")

    @property
    def poly_coefficients(self) -> tuple[float, ...]:
        """The float32 coefficients of the polynomial exp2 (``fa4.ex2.POLY_EX2[poly_degree]``):
        what ``numerics.bounds.ex2_error_bound`` bounds."""
        return POLY_EX2[self.poly_degree]

    def emulated_mask(self) -> torch.Tensor:
        """Bool (tile_n,): the key columns of a tile whose exp2 takes the polynomial (``mixed``:
        production's interleave, ``fa4.ex2.emulated_columns``; tiles not a multiple of 32 have
        no fragments to interleave and use the hardware)."""
        if self.exp2 == "hardware" or (self.exp2 == "mixed" and self.tile_n % 32):
            return torch.zeros(self.tile_n, dtype=torch.bool)
        if self.exp2 == "emulated":
            return torch.ones(self.tile_n, dtype=torch.bool)
        return emulated_columns(
            self.tile_n, ex2_emu_freq=self.emu_freq, ex2_emu_res=self.emu_res, ex2_emu_start_frg=self.emu_start_frg
        )

    @staticmethod
    def sm100(
        dtype: torch.dtype,
        head_dim: int,
        causal: bool = False,
        local: bool = False,
        *,
        seqlen_q: int | None = None,
        qhead_per_kvhead: int = 1,
        head_dim_v: int | None = None,
        use_2cta: bool | None = None,
        pack_gqa: bool | None = None,
        varlen_q: bool = False,
        block_sparse: tuple[int, int] | None = None,
    ) -> FA4Numerics:
        """Production SM100 defaults, as ``interface._flash_attn_fwd`` and
        ``FlashAttentionForwardSm100.__init__``/``__call__`` choose them for these inputs:
        threshold 8 / max_offset 0 for 16-bit inputs, 0 / 8 for fp8; the exp2 interleave from
        ``_TUNING_CONFIG`` (``_FP8_TUNING_CONFIG`` for fp8) keyed by (2-CTA, causal, padded head
        dim), the default rule when no key matches, and pack_gqa's override.

        2-CTA (``interface.py``, ``use_2cta_instrs``): hd256, or non-causal non-local head dims
        128/192 with head_dim_v 128 — and more than one 128-row block of packed queries (unless
        hd256 decode) and ``128 % qhead_per_kvhead == 0`` when GQA is packed.  ``seqlen_q=None``
        assumes a long sequence.  ``pack_gqa=None`` is production's default: ``qhead_per_kvhead >
        1``.  ``varlen_q`` (cu_seqlens_q or seqused_q given): packed GQA at padded head dim > 64
        without masks interleaves every 32nd fragment instead of the tuned 10th
        (``FlashAttentionForwardSm100.__call__``, after ``_setup_attributes``).  ``block_sparse``
        (the sparse block size, or None): block sparsity turns 2-CTA off (``interface.py``:
        ``use_2cta_instrs = ... and not use_block_sparsity``).
        """
        _check_dtype(dtype)
        if block_sparse is not None:
            use_2cta = False
        fp8 = dtype in _FP8
        hdp = int(math.ceil(head_dim / 16) * 16)
        pack_gqa = qhead_per_kvhead > 1 if pack_gqa is None else pack_gqa
        packed_rows = None if seqlen_q is None else seqlen_q * (qhead_per_kvhead if pack_gqa else 1)
        dv = head_dim if head_dim_v is None else head_dim_v
        q_stage, default_2cta = sm100_fwd_geometry(
            d=head_dim,
            dv=dv,
            causal=causal,
            local=local,
            packed_rows=packed_rows,
            qhead_per_kvhead=qhead_per_kvhead,
            pack_gqa=pack_gqa,
        )
        use_2cta = default_2cta if use_2cta is None else use_2cta
        key = (use_2cta, causal, hdp, False)
        tune = dict(zip(("freq", "start"), _SM100_TUNING[key])) if key in _SM100_TUNING else {}
        if fp8 and hdp >= 96 and key in _SM100_FP8_TUNING:
            tune = dict(zip(("freq", "start"), _SM100_FP8_TUNING[key]))
        enable = (
            tune["freq"] > 0
            if "freq" in tune
            else (hdp <= 128 or (hdp == 192 and use_2cta and not causal and not local))
        )
        freq = tune.get("freq", 16) if enable else 0
        if enable and pack_gqa and hdp > 64 and not causal and not local:
            freq = 32 if varlen_q else tune.get("freq", 10)
        return FA4Numerics(
            arch="sm100",
            tile_m=q_stage * SM100_TILE_M * (2 if use_2cta else 1),  # BlockInfo's tile: q_stage x 128 rows, a CTA pair
            tile_n=SM100_TILE_N,
            exp2="mixed",
            poly_degree=3,
            emu_freq=freq,
            emu_res=4,
            emu_start_frg=tune.get("start", 1),
            rescale_threshold=0.0 if fp8 else 8.0,
            max_offset=8 if fp8 else 0,
        )

    @staticmethod
    def sm90(
        dtype: torch.dtype = torch.bfloat16,
        head_dim: int = 128,
        causal: bool = False,
        local: bool = False,
        head_dim_v: int | None = None,
        block_sparse: tuple[int, int] | None = None,
    ) -> FA4Numerics:
        """The Hopper path (``flash_fwd_sm90.py``): hardware exp2, the max moves at every block,
        no threshold, no max_offset; tiles from ``interface._tile_size_fwd_sm90``
        (``fa4.code_paths.sm90_fwd_tile``), fitted to the sparse block size ``block_sparse``
        = (block_q, block_k) when given (:func:`sm90_sparse_fwd_tile`)."""
        if dtype in _FP8:
            raise NotImplementedError("the SM90 path supports only bf16 and fp16 (flash_fwd.py _check_type)")
        _check_dtype(dtype)
        dv = head_dim if head_dim_v is None else head_dim_v
        tm, tn = sm90_fwd_tile(d=head_dim, dv=dv, causal=causal, local=local)
        if block_sparse is not None:
            tm, tn = sm90_sparse_fwd_tile(head_dim, tm, tn, block_sparse)
        return FA4Numerics(arch="sm90", tile_m=tm, tile_n=tn, exp2="hardware", rescale_threshold=0.0, max_offset=0)

    @staticmethod
    def for_inputs(
        arch: str,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool = False,
        window_size: tuple = (None, None),
        *,
        block_sparse: tuple[int, int] | None = None,
    ) -> FA4Numerics:
        """Production's numerics of ``arch`` (``"sm100"`` or ``"sm90"``) for a call on these
        inputs: head dims, seqlen_q and GQA grouping from the shapes, local from the window;
        ``block_sparse``: the sparse block size (block_q, block_k) of a block-sparse call.  With a
        mask_mod, pass causal=False and no window (production drops them:
        ``interface._resolve_causal_local_window``; ``attention`` does so)."""
        local = not causal and any(w is not None for w in window_size)
        if arch == "sm100":
            return FA4Numerics.sm100(
                q.dtype,
                q.shape[-1],
                causal,
                local,
                seqlen_q=q.shape[1],
                qhead_per_kvhead=q.shape[2] // k.shape[2],
                head_dim_v=v.shape[-1],
                block_sparse=block_sparse,
            )
        if arch == "sm90":
            return FA4Numerics.sm90(
                q.dtype, q.shape[-1], causal=causal, local=local, head_dim_v=v.shape[-1], block_sparse=block_sparse
            )
        raise ValueError(f"arch must be 'sm100' or 'sm90', got {arch!r}")

    @staticmethod
    def for_call(
        arch: str,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool = False,
        window_size: tuple = (None, None),
        mask_mod=None,
        block_sparse_tensors: BlockSparse | None = None,
    ) -> FA4Numerics:
        """:meth:`for_inputs` for a call with these keywords, resolved as production resolves it:
        a mask_mod drops causal and the window from the forward's configuration
        (``interface._resolve_causal_local_window``: the tiles and exp2 interleave are then the
        non-causal ones), block sparsity fits the tiles to its sparse block size."""
        if mask_mod is not None:
            causal, window_size = False, (None, None)
        bs = None if block_sparse_tensors is None else tuple(block_sparse_tensors.block_size)
        return FA4Numerics.for_inputs(arch, q, k, v, causal, window_size, block_sparse=bs)


def sm90_sparse_fwd_tile(head_dim: int, tm: int, tn: int, block_sparse: tuple[int, int]) -> tuple[int, int]:
    """SM90's forward tile with block sparsity of sparse block (block_q, block_k):
    ``interface._tile_size_fwd_sm90(..., sparse_block_size_q)`` (head dim <= 96: 128 x 128 when
    block_q is not a multiple of 192) then ``_fit_sm90_fwd_tile_to_block_sparsity`` (tile_m 64
    when block_q is not a multiple of tile_m but of 64; tile_n = block_k when block_k is smaller
    and a multiple of 16).  (tm, tn): the tile without block sparsity."""
    bq, bk = block_sparse
    if head_dim <= 96 and bq % 192 != 0:
        tm, tn = 128, 128
    if bq % tm != 0 and bq % 64 == 0:
        tm = 64
    if bk < tn and bk % 16 == 0:
        tn = bk
    return tm, tn


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"unsupported input dtype {dtype}; accepted: bfloat16, float16, float8_e4m3fn, float8_e5m2")


def kv_block_ranges(
    sq: int, sk: int, nm: FA4Numerics, causal: bool, window: tuple, device, *, heads: int = 1, pack: int = 1
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``numerics.tiles.block_ranges`` with the tiles of ``nm``: the KV blocks each query tile
    visits.  Public for ``fa4.varlen``, whose tiles (pack_gqa, split-KV) need the same ranges."""
    return block_ranges(sq, sk, nm.tile_m, nm.tile_n, causal, window, device, heads=heads, pack=pack)


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
class _RowState:
    """Per (batch, head, query row) running state of the softmax loop, all float32 but ``started``."""

    row_max: torch.Tensor  # (b, hq, sq)
    started: torch.Tensor  # (b, hq, sq) bool: a block of the row has been processed
    row_sum: torch.Tensor  # (b, hq, sq), SM100
    partial: torch.Tensor  # (b, hq, sq, 4): SM90's thread-partial row sums
    acc_o: torch.Tensor  # (b, hq, sq, dv)

    @classmethod
    def empty(cls, shape: tuple[int, int, int], dv: int, dev) -> _RowState:
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


def _softcap(s: torch.Tensor, scale: float, softcap: float) -> torch.Tensor:
    """Step 2 on float32 scores: ``utils.create_softcap_scoremod`` via ``apply_score_mod_inner``
    (``s*scale`` FMUL, ``/ softcap`` div.rn, tanh (MUFU.TANH: the instruction on CUDA, else
    correctly rounded), ``* softcap`` FMUL; no FFMA: the SASS rounds each)."""
    return softcap_tanh(s, scale, softcap) * _f32(softcap)


def _pad_mask(s: torch.Tensor, vis: torch.Tensor, tn: int) -> torch.Tensor:
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


def _softmax_rows(s, m_old, started, l_old, part_old, hw, nm: FA4Numerics, p_dtype, sl2_t, off):
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


def _o_rows(acc_o, acc_scale, pv, first):
    """Step 9's accumulator on a set of rows: fl32(P V) on a row's first block, else
    fl32(O * acc_scale + P V) with the product rounded to float32 first (FMUL, then the MMA
    accumulating onto it)."""
    return torch.where(first.unsqueeze(-1), pv.float(), (acc_o * acc_scale.unsqueeze(-1)).double().add(pv).float())


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
    mods: FwdMods | None = None  # the call's mods (module doc, "Mods")

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
        return _softcap(s.float(), self.scale, self.softcap) if self.softcap > 0 else s  # step 2

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
    st: _RowState, lp: _Loop, s: torch.Tensor, blk: _Block, idx, p64, acc, first, masked=None, hw_rows=None
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
    sc = _pad_mask(s.reshape(-1, nc)[idx].float(), vis, tn)  # step 3
    hw = None
    if nm.masked_exp2 == "hardware" and lp.mods is not None and lp.mods.per_element:
        hw = torch.ones_like(idx, dtype=torch.bool) if hw_rows is None else hw_rows[idx]
    elif nm.masked_exp2 == "hardware":
        m_hi, m_lo = (x.reshape(-1)[hr] for x in lp.ranges[2:])
        hw = (blk.n >= m_hi) | (blk.n < m_lo) | (nc < tn)
    rm, rs, pt, sd = st.row_max.view(-1), st.row_sum.view(-1), st.partial.view(-1, 4), st.started.view(-1)
    out = _softmax_rows(sc, rm[f], sd[f], rs[f], pt[f], hw, nm, lp.p_dtype, lp.sl2_t, lp.off)  # steps 4-8
    rm[f], rs[f], pt[f], acc[idx], first[idx] = out[:5]
    sd[f] = True
    p64.view(-1, tn)[idx] = out[5]


def _compiled_args(nm: FA4Numerics, p_dtype, sl2: float, vis, ranges) -> dict:
    """The block-independent arguments of ``fa4.ex2_cpu.softmax_block`` for these numerics."""
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


def _compiled_rows(st: _RowState, lp: _Loop, blk: _Block, s: torch.Tensor):
    """Steps 3-8 for the block's window in ``fa4.ex2_cpu.softmax_block``.  Returns the block's
    geometry (for :func:`_accumulate`), P (float64, the MMA's operand), the accumulator scale,
    first and each row's status (1 done, 2 left to :func:`_torch_rows`)."""
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


def _accumulate(st: _RowState, pv, blk: _Block, acc, first, geo, status, idx) -> None:
    """Step 9's accumulator on the block's rows: compiled (``geo`` given) on the rows it
    completed, torch on ``idx`` and on the rows the compiled update leaves (a NaN)."""
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
        ao[f] = _o_rows(ao[f], acc[idx], pv[idx], first[idx])


def _accumulate_tc(st: _RowState, lp: _Loop, p64, blk: _Block, acc, first, idx) -> None:
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


def _run_block(st: _RowState, lp: _Loop, n: int, active=None, masked=None, hw_rows=None) -> None:
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


def _run_fast(st: _RowState, lp: _Loop, blocks: list[_Block]) -> None:
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
    mods = dict(
        score_mod=score_mod, mask_mod=mask_mod, aux_tensors=aux_tensors, block_sparse_tensors=block_sparse_tensors
    )
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, learnable_sink)):
        kw = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap, **mods)
        return _differentiable(q, k, v, learnable_sink, numerics, return_lse, kw)
    fm = FwdMods.of(**mods)
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
    out = out.permute(0, 2, 1, 3).contiguous()
    return (out, lse) if return_lse else out


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
) -> tuple[_RowState, torch.Tensor, torch.Tensor]:
    """Steps 1-9 (module doc): the softmax loop over KV blocks from the last to the first, each
    row visiting the blocks of its range.  ``ranges`` = per (head, row) [n_min, n_max) of shape
    (heads_q, seqlen_q) (``fa4.varlen``: pack_gqa, split-KV); None: :func:`kv_block_ranges`.
    ``mods``: the call's mods (module doc, "Mods"; ``causal`` / ``window_size`` already resolved:
    off with a mask_mod); block sparsity visits each query tile's blocks in production's order
    (:func:`block_sparse_kv_order`).  Returns the loop's final state and the float32 scale_log2
    and max_offset tensors."""
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
    st = _RowState.empty((b, hq, sq), dv, dev)
    if mods is not None and mods.block_sparse is not None:
        for n, active, masked, hw in _sparse_steps(mods.block_sparse, nm, b, hq, sq, sk, dev):
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
    """A call's mods as the forward loop applies them (module doc, "Mods"): the ``numerics.mods``
    objects and the whole ``aux_tensors`` list (production hands every mod the same list).
    Public for ``fa4.varlen``, which refuses them."""

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


def block_sparse_kv_order(bs: BlockSparse, b: int, h: int, qb: int, tile_n: int, sk: int) -> list[tuple[int, str]]:
    """The KV tiles a query tile of sparse query block ``qb`` (batch ``b``, head ``h``, indices
    into the block masks, broadcast dims 0) visits, in production's order, each with its kind:
    ``"partial"`` (the mask_mod applied), ``"full_first"`` (no mask_mod; the full list's first
    coarse block, which ``softmax_block_sparse_sm100_list`` runs with the seqlen ``mask_fn``) or
    ``"full"``.  ``consume_block_sparse_loads`` (SM90) / ``softmax_block_sparse_sm100``: the
    partial list, then the full list, each from its last entry to its first
    (``mask_block_idx[cnt - 1 - i]``), the lists ascending (the block masks' order); a coarse
    block of ``kv_subtile_factor`` tiles from its last tile to its first
    (``sparse_physical_n_block_forward`` over descending offsets).  Tiles at or beyond seqlen_k
    (a coarse block's tail) are dropped: production runs them fully masked, which leaves the
    row's state as it was (row max -inf, sum and O 0 times a 0 rescale) on finite inputs."""
    f = bs.block_size[1] // tile_n
    nblk = -(-sk // tile_n)
    out = []
    for mask, kind in ((bs.partial, "partial"), (bs.full, "full")):
        lst = mask[b, h, qb].nonzero().flatten().tolist()
        for i, c in enumerate(reversed(lst)):
            k = "full_first" if kind == "full" and i == 0 else kind
            out += [(c * f + j, k) for j in reversed(range(f)) if c * f + j < nblk]
    return out


def _sparse_steps(bs: BlockSparse, nm: FA4Numerics, b: int, hq: int, sq: int, sk: int, dev):
    """The block-sparse forward schedule: (n, active, masked, hw) per step, each (b, heads_q, sq)
    bool — the rows visiting KV tile n at that step of their tile's order
    (:func:`block_sparse_kv_order`), those applying the mask_mod there (partial blocks) and those
    running it as a masked iteration (partial, or the full list's first coarse block).  Rows are
    independent, so the steps only keep each row's own order."""
    check_block_sparse(bs, b, hq, sq, sk, nm.tile_m, nm.tile_n, nm.arch)
    B, H, nq, _ = bs.full.shape
    full, part = bs.full.cpu(), bs.partial.cpu()
    bsc = BlockSparse(full, part, tuple(bs.block_size))
    kinds = {"partial": 0, "full_first": 1, "full": 2}
    orders = [
        [[block_sparse_kv_order(bsc, i, j, qb, nm.tile_n, sk) for qb in range(nq)] for j in range(H)] for i in range(B)
    ]
    steps = max((len(o) for ob in orders for oh in ob for o in oh), default=0)
    n_at = torch.full((B, H, nq, max(steps, 1)), -1, dtype=torch.int64)
    k_at = torch.zeros_like(n_at)
    for i in range(B):
        for j in range(H):
            for qb in range(nq):
                for t, (n, kind) in enumerate(orders[i][j][qb]):
                    n_at[i, j, qb, t], k_at[i, j, qb, t] = n, kinds[kind]
    row_blk = torch.arange(sq) // bs.block_size[0]
    n_rows, k_rows = (x[:, :, row_blk].expand(b, hq, sq, -1).to(dev) for x in (n_at, k_at))
    for t in range(steps):
        nt, kt = n_rows[..., t], k_rows[..., t]
        for n in sorted(set(nt.unique().tolist()) - {-1}):
            active = nt == n
            yield n, active, active & (kt == 0), active & (kt <= 1)


def _differentiable(q, k, v, sink, numerics, return_lse: bool, kw: dict):
    """``attention`` through :class:`_AttentionFn` (numerics resolved here, as ``attention`` does,
    so that the backward sees the same record; ``kw`` carries the mods to both directions, as
    ``interface.FlashAttnFunc`` saves them on ``ctx``)."""
    nm = numerics
    if nm is None:
        nm = FA4Numerics.for_call(
            "sm100",
            q,
            k,
            v,
            causal=kw["causal"],
            window_size=kw["window_size"],
            mask_mod=kw.get("mask_mod"),
            block_sparse_tensors=kw.get("block_sparse_tensors"),
        )
    out, lse = _AttentionFn.apply(q, k, v, sink, nm, kw)
    return (out, lse) if return_lse else out


class _AttentionFn(torch.autograd.Function):
    """``attention`` under autograd, as ``interface.FlashAttnFunc``: the forward is the forward
    model (bit for bit: ``attention`` itself, grad mode being off in here); the backward is
    ``fa4.model_bwd.attention_backward`` on the saved inputs, the returned (rounded) out and the
    float32 LSE, dO (zeros when out gets no gradient) and dLSE when the LSE output gets one."""

    @staticmethod
    def forward(ctx, q, k, v, sink, nm, kw):
        out, lse = attention(q, k, v, learnable_sink=sink, return_lse=True, numerics=nm, **kw)
        ctx.save_for_backward(q, k, v, sink, out, lse)
        ctx.nm, ctx.kw = nm, kw
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, sink, out, lse = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout
        dq, dk, dv, dsink = attention_backward(
            q, k, v, out, lse, dout, dlse=dlse, learnable_sink=sink, numerics=ctx.nm, **ctx.kw
        )
        return dq, dk, dv, dsink, None, None


def finalize(nm, row_max, row_sum, acc_o, sl2, off, sink, out_dtype):
    """The SM100 correction-warp epilogue (``flash_fwd_sm100.py`` ``correction_loop``) or
    ``Softmax.finalize`` (SM90): learnable sink, reciprocal, O scaling, LSE.  Fused operations
    follow the SASS ptxas emits (fma where it fuses, separate roundings where it does not).
    Public for ``fa4.varlen``, which finishes each sequence (and each split) the same way."""
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
        _check_dtype(t.dtype)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"incompatible shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"heads_q ({q.shape[2]}) must be a multiple of heads_kv ({k.shape[2]})")
    if sink is not None and sink.shape != (q.shape[2],):
        raise ValueError(f"learnable_sink must have shape (heads_q,) = ({q.shape[2]},), got {tuple(sink.shape)}")
