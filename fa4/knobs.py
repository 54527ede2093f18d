"""``FA4Numerics``: the knobs that decide FA4's numerics (tiles, exp2 mode and interleave,
polynomial degree, lazy rescaling, P / dS dtypes, backward tiles, MMA summation), and production's
tables that choose them per call (flash-attn-4 4.0.0b36, ``flash_attn/cute``: ``_TUNING_CONFIG``,
the rescaling settings, the SM90 tile fitted to block sparsity).  The forward model
(``fa4.model``) and the backward (``fa4.model_bwd``) read one record; a variant to audit is a new
value, not new code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from fa4.code_paths import SM100_TILE_M, SM100_TILE_N, sm90_fwd_tile, sm100_fwd_geometry
from fa4.ex2 import DEGREES, POLY_EX2, emulated_columns
from fa4.primitives import FP8 as _FP8
from numerics.mods import BlockSparse

__all__ = ["FA4Numerics", "SUPPORTED_DTYPES", "PRODUCTION_RESCALING", "sm90_sparse_fwd_tile", "check_dtype"]

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)

#: Production's lazy-rescaling settings by input dtype, (rescale_threshold, max_offset)
#: (``flash_fwd_sm100.py`` ``softmax_loop``): 16-bit inputs threshold 8, offset 0; fp8 threshold
#: 0, offset 8.  :meth:`FA4Numerics.sm100` takes them; ``fa4-audit bounds`` analyses them.
PRODUCTION_RESCALING = {
    "bfloat16": (8.0, 0),
    "float16": (8.0, 0),
    "float8_e4m3fn": (0.0, 8),
    "float8_e5m2": (0.0, 8),
}

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
        the rescaling of :data:`PRODUCTION_RESCALING` (threshold 8 / max_offset 0 for
        16-bit inputs, 0 / 8 for fp8); the exp2 interleave from
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
        check_dtype(dtype)
        if block_sparse is not None:
            use_2cta = False
        fp8 = dtype in _FP8
        threshold, offset = PRODUCTION_RESCALING[str(dtype).removeprefix("torch.")]
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
            rescale_threshold=threshold,
            max_offset=offset,
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
        check_dtype(dtype)
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


def check_dtype(dtype: torch.dtype) -> None:
    """Refuse an input dtype outside ``SUPPORTED_DTYPES``, naming the accepted ones."""
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"unsupported input dtype {dtype}; accepted: bfloat16, float16, float8_e4m3fn, float8_e5m2")
