"""FA4's code paths and tile rules: the groups of attention calls that production FA4
(flash-attn-4 4.0.0b36, ``flash_attn/cute``) runs through different compiled code or different
arithmetic, per GPU architecture and direction, and the tile sizes production picks for each.  One
statement of the rules: the model takes its tiles from the functions here (the forward's
``fa4.knobs.FA4Numerics``, the backward's ``fa4.model_bwd.bwd_plan``), the suites
(``audits.suites.cases.class_cases``) are built to cover every class, and coverage reports
(``audits.verdict.coverage``) name them.

A :class:`Call` holds the parts of a call that select the code; :func:`classes_of` maps it to
the names of the classes it falls in (a pure function of the call); :func:`classes` lists every
class of an architecture with a description and the production function that decides it.

What a :class:`Call` cannot say, and the assumption made:

- the batch size and the GPU's SM count: production's hd256 decode rules (the 2-CTA single-M-block
  forward, ``interface._flash_attn_fwd`` ``hd256_decode_2cta``, and the hd256 pack_gqa default)
  are taken as if the grid fits in one wave (batch 1, as the model does);
- the page size: ``paged`` is any paged KV cache; production takes the TMA page load when the
  page size equals tile_n (``paged_kv_non_tma``) and allows SM100's 2-CTA forward only at page
  size 128 (``page_size in [None, 128]``): a paged call is taken as 1-CTA (exact except at
  page size 128);
- a local window's extent: SM100's split-KV at d != dv counts KV blocks over all of seqlen_k;
- ``qv`` (MLA absorbed, dv 512 on SM100): the audited call (``flash_attn_func(q, k, v, ...)``)
  has no qv, so the MLA kernels (``_mla_fwd_plan``) are not a class here;
- the mods (``docs/mods.md``): a :class:`Call` says whether a score_mod and a mask_mod are given
  and the block-sparse block size, not which mod (each mod compiles its own kernel,
  ``score_mod_hash`` in production's compile key, but the same code path); block sparsity is
  taken as given with its ``block_size`` (production infers it from the tensors' shapes
  otherwise, ``block_sparsity.get_sparse_q_block_size``);
- explicit tile overrides, ``FLASH_ATTENTION_*`` environment knobs
  (``FLASH_ATTENTION_HD256_GENERIC_BWD``, 2-CTA disable): not audited calls.

With a mask_mod the forward's mask class is production's, not the call's flags: ``_flash_attn_fwd``
resolves ``causal`` and the window away (``_resolve_causal_local_window(..., mask_mod)``: every
KV block is visited and the mask_mod alone masks), while ``_flash_attn_bwd`` resolves them without
the mask_mod, so the backward keeps the flags' class (and skips the blocks they mask).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = [
    "Call",
    "PathClass",
    "ARCHS",
    "DIRECTIONS",
    "classes",
    "classes_of",
    "sm90_fwd_tile",
    "sm90_bwd_tile",
    "Sm90BwdTile",
    "sm90_accum_wider",
    "sm100_fwd_geometry",
    "sm100_bwd_tile",
    "hdim_multiple",
    "pad_to",
    "SM100_TILE_M",
    "SM100_TILE_N",
]

ARCHS = ("sm90", "sm100")
DIRECTIONS = ("forward", "backward")
#: SM100's forward tile (one CTA, one Q stage): ``_get_fwd_config``'s default FwdConfig(128, 128)
SM100_TILE_M = 128
SM100_TILE_N = 128
#: the SM count assumed where production compares a grid with it (B200); see the module docstring
_SM100_NUM_SMS = 148

_IF = "interface.py"


@dataclass(frozen=True)
class Call:
    """The parts of one attention call that select production's compiled code / arithmetic.

    dtype: torch dtype name; d, dv: head dims of Q/K and of V; causal / local: the mask
    (local: a window, not causal); softcap, sink: the features on; varlen: cu_seqlens /
    seqused given; paged: a paged KV cache (see the module docstring on its page size);
    num_splits: split-KV (1: none); pack_gqa: None = production's default;
    deterministic: ``deterministic=True`` in the backward; score_mod, mask_mod: a mod given;
    block_sparse: the sparse block (block_q, block_k) in tokens, () for dense; aux_scalars:
    runtime scalars given to the mods."""

    dtype: str
    d: int
    dv: int
    causal: bool = False
    local: bool = False
    softcap: bool = False
    sink: bool = False
    seqlen_q: int = 128
    seqlen_k: int = 128
    heads_q: int = 1
    heads_kv: int = 1
    varlen: bool = False
    paged: bool = False
    num_splits: int = 1
    pack_gqa: bool | None = None
    deterministic: bool = False
    score_mod: bool = False
    mask_mod: bool = False
    block_sparse: tuple = ()
    aux_scalars: bool = False

    def __post_init__(self):
        bs = self.block_sparse
        if bs and (len(bs) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in bs)):
            raise ValueError(f"Call.block_sparse = {bs!r} must be (block_q, block_k), two positive ints, or ()")
        for name in ("d", "dv", "heads_q", "heads_kv", "num_splits"):
            val = getattr(self, name)
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"Call.{name} = {val!r} must be an integer >= 1")
        for name in ("seqlen_q", "seqlen_k"):
            val = getattr(self, name)
            if not isinstance(val, int) or isinstance(val, bool) or val < 0:
                raise ValueError(f"Call.{name} = {val!r} must be an integer >= 0")
        if self.heads_q % self.heads_kv:
            raise ValueError(f"Call.heads_q {self.heads_q} must be a multiple of heads_kv {self.heads_kv}")

    @property
    def qhead_per_kvhead(self) -> int:
        return self.heads_q // self.heads_kv


@dataclass(frozen=True)
class PathClass:
    """One code-path class: ``name`` a stable id (``arch.fwd|bwd.what``), ``description`` one
    line for reports, ``source`` the production function that decides it (``file: function``,
    under ``flash_attn/cute``)."""

    name: str
    arch: str
    direction: str
    description: str
    source: str


# ----------------------------------------------------------------------------- tile rules


def sm90_fwd_tile(*, d: int, dv: int, causal: bool, local: bool, block_sparse: tuple = ()) -> tuple[int, int]:
    """(tile_m, tile_n) of the SM90 forward, by head-dim band (``interface._tile_size_fwd_sm90``):
    d <= 64: 192 x 128; d <= 96: 192 x 128 with a mask, 192 x 144 without; d <= 128: 128 x 128;
    d <= 192: 128 x 96 local, else 128 x 128 (dv <= 128) / 128 x 112; d > 192: 128 x 64 local,
    else 128 x 80.  With block sparsity (``block_sparse`` = (block_q, block_k)): at d <= 96 a
    block_q that is no multiple of 192 takes tile_m 128; then ``_fit_sm90_fwd_tile_to_block_sparsity``
    takes tile_m 64 when block_q is a multiple of 64 but not of tile_m, and tile_n = block_k when
    block_k is below tile_n and a multiple of 16 (production refuses other fits,
    ``block_sparsity.normalize_block_sparse_config``: block_k must equal tile_n on SM90)."""
    bq = block_sparse[0] if block_sparse else None
    if d <= 64:
        tm, tn = (128, 128) if bq is not None and bq % 192 else (192, 128)
    elif d <= 96:
        tm, tn = (128, 128) if bq is not None and bq % 192 else (192, 128) if causal or local else (192, 144)
    elif d <= 128:
        tm, tn = 128, 128
    elif d <= 192:
        tm, tn = 128, 96 if local else (128 if dv <= 128 else 112)
    else:
        tm, tn = 128, 64 if local else 80
    if block_sparse:
        bk = block_sparse[1]
        tm = 64 if bq % tm and bq % 64 == 0 else tm
        tn = bk if bk < tn and bk % 16 == 0 else tn
    return tm, tn


@dataclass(frozen=True)
class Sm90BwdTile:
    """The parts of SM90's ``BwdConfig`` (``interface._tile_size_bwd_sm90``) that change the
    arithmetic or the compiled code: the tile, dQ on one warpgroup, the swapped dK/dV and dQ
    MMAs, and the stage count of dO (1 at d in (128, 192] with dv > 128)."""

    tile_m: int
    tile_n: int
    dq_single_wg: bool
    dkv_swap_ab: bool
    dq_swap_ab: bool
    stages_do: int


def sm90_bwd_tile(*, d: int, dv: int, causal: bool, local: bool, block_sparse: tuple = ()) -> Sm90BwdTile:
    """SM90's backward configuration by head-dim band (``interface._tile_size_bwd_sm90``):
    d <= 64: 128 x 128; d <= 96: 64 x 128, dQ on one warpgroup; d <= 128: 64 x 128 with a mask,
    else 80 x 128 with dQ_swapAB (80 is not a multiple of 64); d <= 192: 64 x 96 with dKV_swapAB
    (one dO stage when dv > 128); d > 192: 64 x 48 with dKV_swapAB.  With block sparsity
    (``block_sparse`` = (block_q, block_k), ``sparse_block_size_q`` = block_q): at d <= 128 an
    80-row tile that does not divide block_q becomes 64 rows (no dQ_swapAB); at d > 192 the tile
    is 64 x 64 without dKV_swapAB (block sparsity derives its KV block from tile_n)."""
    bq = block_sparse[0] if block_sparse else None
    if d <= 64:
        return Sm90BwdTile(128, 128, False, False, False, 2)
    if d <= 96:
        return Sm90BwdTile(64, 128, True, False, False, 2)
    if d <= 128:
        tm = 64 if causal or local else 80
        tm = 64 if bq is not None and bq % tm else tm
        return Sm90BwdTile(tm, 128, False, False, tm % 64 != 0, 2)
    if d <= 192:
        return Sm90BwdTile(64, 96, False, True, False, 2 if dv <= 128 else 1)
    if bq is not None:
        return Sm90BwdTile(64, 64, False, False, False, 1)
    return Sm90BwdTile(64, 48, False, True, False, 1)


def hdim_multiple(*, arch: str, direction: str, d: int, block_sparse: tuple = ()) -> int:
    """The granularity production pads the head dims (d and dv alike) to in the main kernel's
    tile: SM90 forward 16 (``flash_fwd.py`` ``FlashAttentionForwardBase.__init__``); SM90
    backward 64 with dKV_swapAB (d > 128), else 16 (``flash_bwd_sm90.py``
    ``FlashAttentionBackwardSm90.__init__``); SM100 forward 16 (``flash_fwd_sm100.py``
    ``FlashAttentionForwardSm100.__init__``); SM100 backward 32 (``flash_bwd_sm100.py``
    ``FlashAttentionBackwardSm100.__init__``).  ``block_sparse``: the SM90 backward's tile
    under block sparsity (:func:`sm90_bwd_tile`: no dKV_swapAB at d > 192)."""
    _check_arch(arch)
    _check_direction(direction)
    if direction == "forward":
        return 16
    if arch == "sm90":
        t = sm90_bwd_tile(d=d, dv=d, causal=False, local=False, block_sparse=block_sparse)
        return 64 if t.dkv_swap_ab else 16
    return 32


def pad_to(x: int, m: int) -> int:
    """``x`` rounded up to a multiple of ``m`` (a head dim padded to a tile's or an accumulator's
    granularity)."""
    return -(-x // m) * m


#: where the SM90 backward's accumulators get their head-dim granularity, which can differ from
#: the main kernel's tile (:func:`hdim_multiple`)
_ACCUM_SRC = f"{_IF}: _flash_attn_bwd"  # hdim_multiple_of: 64 with dKV_swapAB on SM90, else 32


def sm90_accum_wider(*, d: int, dv: int, block_sparse: tuple = ()) -> bool:
    """Whether SM90's backward allocates, zeroes (preprocess) and reads back (postprocess) its fp32
    accumulators at a wider head-dim stride than its main kernel's tile uses.
    ``_flash_attn_bwd`` rounds the head dims to 32 (64 with dKV_swapAB) for ``dq_accum`` (and
    ``dk_accum``/``dv_accum`` under GQA), while ``FlashAttentionBackwardSm90.__init__`` pads its
    tile to 16 without dKV_swapAB (:func:`hdim_multiple`): the two agree unless rounding to 16
    and to 32 differ (d mod 32 in 1..16).  Measured on the H200 (flash-attn-4 4.0.0b36,
    docs/h200-results.md): exactly these head dims return dQ (and, under GQA, dK and dV)
    hundreds of times outside the backward bound; upstream flash-attention PR #2896.
    ``block_sparse``: as :func:`hdim_multiple`."""
    m = hdim_multiple(arch="sm90", direction="backward", d=d, block_sparse=block_sparse)
    acc = 64 if m == 64 else 32
    return pad_to(d, acc) != pad_to(d, m) or pad_to(dv, acc) != pad_to(dv, m)


def sm100_fwd_geometry(
    *,
    d: int,
    dv: int,
    causal: bool,
    local: bool,
    packed_rows: int | None,
    qhead_per_kvhead: int,
    pack_gqa: bool,
    split: bool = False,
    varlen_q: bool = False,
    paged: bool = False,
    block_sparse: bool = False,
) -> tuple[int, bool]:
    """(q_stage, use_2cta) of the SM100 forward (``interface._get_fwd_config``: two Q tiles per
    CTA when the packed query rows exceed one 128-row tile, unless dv is 256 (TMEM);
    ``interface._flash_attn_fwd`` ``use_2cta_instrs``: hd256, or no mask at padded head dims
    128/192 with padded dv 128 — not split, not varlen (hd256 excepted), not paged (see the module
    docstring), more than one M block (hd256 decode excepted: the grid assumed to fit in one wave),
    and ``128 % qhead_per_kvhead == 0`` when GQA is packed, not block-sparse:
    ``not use_block_sparsity``).  ``packed_rows`` = seqlen_q x (the query heads per KV head when
    packed); None: a long sequence."""
    # production compares head_dim_v with 256 and tests is_hdim256 = (d, dv) == (256, 256); on the
    # pairs SM100 accepts (_validate_head_dims) that is the padded head dims' test used here
    q_stage = 2 if packed_rows is None or (packed_rows > SM100_TILE_M and pad_to(dv, 16) != 256) else 1
    hd256 = pad_to(d, 16) == 256
    one_m_block = packed_rows is not None and packed_rows <= q_stage * SM100_TILE_M
    use_2cta = (
        not split
        and not block_sparse
        and (not varlen_q or hd256)
        and not paged
        and (not one_m_block or hd256)
        and (SM100_TILE_M % qhead_per_kvhead == 0 or not pack_gqa)
        and (hd256 or (not causal and not local and pad_to(d, 16) in (128, 192) and pad_to(dv, 16) == 128))
    )
    return q_stage, use_2cta


def sm100_bwd_tile(
    *, d: int, dv: int, hd256_generic: bool = False, block_sparse: tuple = ()
) -> tuple[int, int, bool, bool]:
    """(tile_m, tile_n, use_2cta, dedicated_hd256) of the SM100 backward
    (``interface._flash_attn_bwd``): 128 x 128, 2-CTA at head_dim >= 128; (256, 256) runs the
    dedicated kernel (``sm100_hd256_2cta_fmha_backward.py``) unless
    ``FLASH_ATTENTION_HD256_GENERIC_BWD=1`` (``hd256_generic``), which runs the generic kernel with
    a 64-key tile.  Block sparsity (``block_sparse`` = (block_q, block_k)) keeps 2-CTA only when
    block_k covers an even number of 128-key tiles (``block_sparsity.block_sparse_bwd_supports_2cta``)."""
    if d == 256 and dv == 256:
        return (128, 64, True, False) if hd256_generic else (128, 128, True, True)
    even = not block_sparse or (block_sparse[1] // SM100_TILE_N) % 2 == 0
    return 128, 128, d >= 128 and even, False


# ----------------------------------------------------------------------------- classes


def _cls(arch: str, direction: str, what: str, description: str, source: str) -> PathClass:
    short = "fwd" if direction == "forward" else "bwd"
    return PathClass(f"{arch}.{short}.{what}", arch, direction, description, source)


def _band(d: int) -> int:
    return next(b for b in (64, 96, 128, 192) if d <= b) if d <= 192 else 256


def _classes(arch: str) -> tuple[PathClass, ...]:
    out: list[PathClass] = []
    fwd, bwd = "forward", "backward"
    if arch == "sm90":
        src = f"{_IF}: _tile_size_fwd_sm90"
        for band, tm, tn, when in (
            (64, 192, 128, "any mask"),
            (96, 192, 128, "causal or local, P V from shared memory (mma_pv_is_rs off)"),
            (96, 192, 144, "no mask, P V from shared memory (mma_pv_is_rs off)"),
            (128, 128, 128, "any mask"),
            (192, 128, 128, "no window, dv <= 128"),
            (192, 128, 112, "no window, dv > 128"),
            (192, 128, 96, "local window"),
            (256, 128, 80, "no window"),
            (256, 128, 64, "local window"),
            (64, 128, 128, "block-sparse, block_q no multiple of 192"),
            (96, 128, 128, "block-sparse, block_q no multiple of 192"),
        ):
            out.append(
                _cls(arch, fwd, f"tile{tm}x{tn}.hd{band}", f"tile {tm}x{tn}, head dim band <= {band}, {when}", src)
            )
        src = f"{_IF}: _tile_size_bwd_sm90"
        for band, what, desc in (
            (64, "tile128x128", "tile 128x128, SdP swapped"),
            (96, "tile64x128", "tile 64x128, dQ on one warpgroup"),
            (128, "tile64x128", "tile 64x128 (causal or local)"),
            (128, "tile80x128", "tile 80x128 without a mask, dQ_swapAB (80 rows: not a multiple of 64)"),
            (192, "tile64x96", "tile 64x96, dKV_swapAB, dv <= 128 (two dO stages)"),
            (192, "tile64x96.dv256", "tile 64x96, dKV_swapAB, dv > 128 (one dO stage)"),
            (256, "tile64x48", "tile 64x48, dKV_swapAB (the smem dQaccum buffer leaves no room for 64x80)"),
            (256, "tile64x64", "tile 64x64 without dKV_swapAB: block-sparse (its KV block follows tile_n)"),
        ):
            out.append(_cls(arch, bwd, f"{what}.hd{band}", f"{desc}, head dim band <= {band}", src))
        fwd_pad = "flash_fwd.py: FlashAttentionForwardBase.__init__"
        bwd_pad = "flash_bwd_sm90.py: FlashAttentionBackwardSm90.__init__"
        out += [
            _cls(arch, fwd, "hdim_exact", "d and dv multiples of 16: no head-dim predication", fwd_pad),
            _cls(arch, fwd, "hdim_padded16", "d or dv padded to a multiple of 16 (check_hdim_oob)", fwd_pad),
            _cls(arch, bwd, "hdim_exact", "d and dv multiples of the MMA granularity (16, or 64 at d > 128)", bwd_pad),
            _cls(arch, bwd, "hdim_padded16", "d <= 128: d or dv padded to a multiple of 16", bwd_pad),
            _cls(arch, bwd, "hdim_padded64", "d > 128 (dKV_swapAB): d or dv padded to a multiple of 64", bwd_pad),
            _cls(
                arch,
                bwd,
                "accum.same_as_tile",
                "the fp32 dQ/dK/dV accumulators' head-dim stride equals the kernel tile's",
                _ACCUM_SRC,
            ),
            _cls(
                arch,
                bwd,
                "accum.wider_than_tile",
                "the fp32 accumulators are allocated wider (rounded to 32) than the kernel's tile (16): d <= 128 "
                "with d or dv mod 32 in 1..16 (d = dv: 8, 16, 40, 48, 72, 80, 104, 112)",
                _ACCUM_SRC,
            ),
            _cls(
                arch,
                bwd,
                "dq_swapab.hdim_not64",
                "the 80-row tile's dQ_swapAB GEMM at a padded head dim (112) that is not a multiple of WGMMA's M "
                "(64): d 104, 112 without a mask",
                f"{_IF}: _tile_size_bwd_sm90",
            ),
        ]
    else:
        src = f"{_IF}: _flash_attn_fwd"
        out += [
            _cls(arch, fwd, "hd128", "head dims 8..128 (standard range)", f"{_IF}: _validate_head_dims"),
            _cls(arch, fwd, "hd192", "DeepSeek shape (192, 128)", f"{_IF}: _validate_head_dims"),
            _cls(arch, fwd, "hd256", "(256, 256): q_stage 1 at dv 256, 2-CTA", f"{_IF}: _validate_head_dims"),
            _cls(
                arch,
                fwd,
                "q_stage1",
                "one 128-row Q tile per CTA (packed rows <= 128, or dv 256)",
                f"{_IF}: _get_fwd_config",
            ),
            _cls(arch, fwd, "q_stage2", "two 128-row Q tiles per CTA", f"{_IF}: _get_fwd_config"),
            _cls(arch, fwd, "2cta", "2-CTA MMA (a CTA pair shares the M tile)", src),
            _cls(arch, fwd, "1cta", "one CTA per M tile", src),
            _cls(
                arch,
                fwd,
                "splitkv",
                "split-KV: partial O/LSE per split, then the combine kernel",
                f"{_IF}: _get_fwd_config",
            ),
            _cls(
                arch,
                fwd,
                "splitkv.tile_n64",
                "split-KV at d != dv with >= 64 KV blocks: tile_n 64",
                f"{_IF}: _get_fwd_config",
            ),
            _cls(
                arch,
                fwd,
                "hdim_exact",
                "d and dv multiples of 16",
                "flash_fwd_sm100.py: FlashAttentionForwardSm100.__init__",
            ),
            _cls(
                arch,
                fwd,
                "hdim_padded16",
                "d or dv padded to a multiple of 16",
                "flash_fwd_sm100.py: FlashAttentionForwardSm100.__init__",
            ),
            _cls(arch, bwd, "1cta", "generic backward, 128x128, one CTA (head_dim < 128)", f"{_IF}: _flash_attn_bwd"),
            _cls(arch, bwd, "2cta", "generic backward, 128x128, 2-CTA (head_dim >= 128)", f"{_IF}: _flash_attn_bwd"),
            _cls(
                arch,
                bwd,
                "hd256_dedicated",
                "(256, 256): the dedicated hd256 2-CTA backward (deterministic without semaphores)",
                "sm100_hd256_2cta_fmha_backward.py: BlackwellFusedMultiHeadAttentionBackward",
            ),
            _cls(
                arch,
                bwd,
                "hdim_exact",
                "d and dv multiples of 32",
                "flash_bwd_sm100.py: FlashAttentionBackwardSm100.__init__",
            ),
            _cls(
                arch,
                bwd,
                "hdim_padded32",
                "d or dv padded to a multiple of 32",
                "flash_bwd_sm100.py: FlashAttentionBackwardSm100.__init__",
            ),
        ]
    if arch == "sm90":
        out.append(
            _cls(
                arch,
                fwd,
                "block_sparse.tile_fitted",
                "block-sparse: a tile shrunk to the sparse block other than the listed ones (tile_m 64, or "
                "tile_n = block_k)",
                f"{_IF}: _fit_sm90_fwd_tile_to_block_sparsity",
            )
        )
    out += _mod_classes(arch)
    blk = "block_info.py: BlockInfo.get_n_block_min_max"
    for direction in (fwd, bwd):
        entry = "_flash_attn_fwd" if direction == fwd else "_flash_attn_bwd"
        out += [
            _cls(arch, direction, "mask.none", "no mask: every KV block, only the seqlen mask", blk),
            _cls(arch, direction, "mask.causal", "causal: blocks past the diagonal skipped, the diagonal masked", blk),
            _cls(arch, direction, "mask.local", "local window: blocks outside skipped, both edges masked", blk),
            _cls(arch, direction, "softcap", "softcap: tanh on the scores", f"{_IF}: {entry}"),
            _cls(arch, direction, "sink", "learnable sink in the softmax denominator", f"{_IF}: {entry}"),
            _cls(arch, direction, "varlen", "varlen: cu_seqlens / seqused, per-sequence offsets", f"{_IF}: {entry}"),
        ]
        if direction == fwd:
            out += [
                _cls(arch, fwd, "mha", "one query head per KV head", f"{_IF}: _flash_attn_fwd"),
                _cls(
                    arch,
                    fwd,
                    "gqa.packed",
                    "GQA, the query heads of a KV head packed into the M tile (pack_gqa)",
                    f"{_IF}: _flash_attn_fwd",
                ),
                _cls(
                    arch,
                    fwd,
                    "gqa.unpacked",
                    "GQA without pack_gqa: each query head its own M tiles",
                    f"{_IF}: _flash_attn_fwd",
                ),
                _cls(
                    arch, fwd, "paged", "paged KV cache (page table; the KV loads follow it)", f"{_IF}: _flash_attn_fwd"
                ),
            ]
        else:
            out += [
                _cls(arch, bwd, "mha", "one query head per KV head", f"{_IF}: _flash_attn_bwd"),
                _cls(
                    arch,
                    bwd,
                    "gqa",
                    "GQA: dK/dV summed over the query heads (pack_gqa is off in the backward)",
                    f"{_IF}: _flash_attn_bwd",
                ),
                _cls(
                    arch,
                    bwd,
                    "deterministic",
                    "deterministic: semaphore-ordered dQ (and GQA dK/dV) adds",
                    f"{_IF}: _flash_attn_bwd",
                ),
            ]
    return tuple(out)


def _mod_classes(arch: str) -> list[PathClass]:
    """The mod classes of ``arch`` (``docs/mods.md``), forward and backward: a score_mod (its
    function inlined into the softmax's score pass, its derivative into dS: the kernels'
    ``apply_score_mod`` / ``apply_score_mod_bwd`` call these), a mask_mod (the mask evaluated per
    element in every visited block), block sparsity (the visited KV blocks from the block lists,
    full blocks unmasked, partial blocks through the mask_mod)."""
    sm90 = arch == "sm90"
    bsu = "block_sparse_utils.py"
    sparse_bwd = "consume_block_sparse_mma_bwd_sm90" if sm90 else "produce_block_sparse_q_loads_bwd_sm100_default"
    return [
        _cls(
            arch,
            "forward",
            "score_mod",
            "score_mod: the scores pass through the mod after the scale",
            "softmax.py: apply_score_mod_inner",
        ),
        _cls(
            arch,
            "forward",
            "mask_mod",
            "mask_mod: masked per element in every visited block; causal and the "
            "window dropped (_resolve_causal_local_window)",
            "mask.py: AttentionMask.apply_mask" if sm90 else "mask.py: AttentionMask.apply_mask_sm100",
        ),
        _cls(
            arch,
            "forward",
            "block_sparse",
            "block sparsity: KV blocks from the full / partial block lists",
            f"{bsu}: consume_block_sparse_loads" if sm90 else f"{bsu}: softmax_block_sparse_sm100",
        ),
        _cls(
            arch,
            "backward",
            "score_mod",
            "score_mod: scores recomputed through the mod, dS through score_mod_bwd",
            "softmax.py: apply_score_mod_bwd_inner",
        ),
        _cls(
            arch,
            "backward",
            "mask_mod",
            "mask_mod: masked per element in the recomputed P (causal and the window "
            "kept: _flash_attn_bwd resolves them without the mask_mod)",
            f"{_IF}: _flash_attn_bwd",
        ),
        _cls(
            arch,
            "backward",
            "block_sparse",
            "block sparsity: Q blocks per KV block from the backward's block lists",
            f"{bsu}: {sparse_bwd}",
        ),
        # runtime scalars are kernel parameters (utils.AuxData.scalars; the compile key holds their types only,
        # interface.py aux_scalar_metadata) handed to every mod by keyword (softmax.py call_score_mod's branch)
        _cls(
            arch,
            "forward",
            "aux_scalars",
            "aux_scalars: runtime scalars passed to the mods",
            "softmax.py: call_score_mod",
        ),
        _cls(
            arch,
            "backward",
            "aux_scalars",
            "aux_scalars: runtime scalars passed to score_mod_bwd",
            "softmax.py: call_score_mod_bwd",
        ),
    ]


_CLASSES = {a: _classes(a) for a in ARCHS}


#: the SM90 forward's tile classes (a block-sparse fit outside them is ``block_sparse.tile_fitted``)
_SM90_FWD_TILES = frozenset(c.name.split(".", 2)[2] for c in _CLASSES["sm90"] if c.name.startswith("sm90.fwd.tile"))


def _check_arch(arch: str) -> None:
    if arch not in ARCHS:
        raise ValueError(f"arch {arch!r} is not known; accepted: {', '.join(ARCHS)}")


def _check_direction(direction: str) -> None:
    if direction not in DIRECTIONS:
        raise ValueError(f"direction {direction!r} is not known; accepted: {', '.join(DIRECTIONS)}")


def classes(arch: str) -> tuple[PathClass, ...]:
    """Every code-path class production has on ``arch`` ("sm90" or "sm100"), forward and backward."""
    _check_arch(arch)
    return _CLASSES[arch]


def _fwd_pack_gqa(arch: str, call: Call) -> bool:
    """pack_gqa as ``interface._flash_attn_fwd`` resolves it: as given, else GQA; on SM100 hd256
    with 128 % qhead_per_kvhead != 0, off (2-CTA preferred) for long queries or a small grid
    (batch 1 assumed), not under varlen's seqused_q."""
    if call.pack_gqa is not None:
        return call.pack_gqa
    g = call.qhead_per_kvhead
    if (
        arch == "sm100"
        and (call.d, call.dv) == (256, 256)
        and SM100_TILE_M % g
        and (call.seqlen_q > SM100_TILE_M or (call.num_splits == 1 and 2 * call.heads_q <= _SM100_NUM_SMS))
    ):
        return False
    return g > 1


def classes_of(arch: str, call: Call, *, direction: str) -> tuple[str, ...]:
    """The names of the classes (of :func:`classes` ``(arch)``) that ``call`` falls in, in
    ``direction`` ("forward" or "backward").  A pure function of the call; whether production
    accepts the call at all is the domain's question (``audits.suites.domain``), not this one's."""
    _check_arch(arch)
    _check_direction(direction)
    short = "fwd" if direction == "forward" else "bwd"
    if direction == "forward" and call.mask_mod:  # _flash_attn_fwd: _resolve_causal_local_window(..., mask_mod)
        call = replace(call, causal=False, local=False)
    bs = tuple(call.block_sparse)
    mask = "causal" if call.causal else "local" if call.local else "none"
    names: list[str] = [f"mask.{mask}"]
    m = hdim_multiple(arch=arch, direction=direction, d=call.d, block_sparse=bs)
    padded = call.d % m != 0 or call.dv % m != 0
    if direction == "forward":
        pack = _fwd_pack_gqa(arch, call)
        names.append("mha" if call.qhead_per_kvhead == 1 else "gqa.packed" if pack else "gqa.unpacked")
        if call.paged:
            names.append("paged")
        names.append(f"hdim_padded{m}" if padded else "hdim_exact")
        if arch == "sm90":
            tm, tn = sm90_fwd_tile(d=call.d, dv=call.dv, causal=call.causal, local=call.local, block_sparse=bs)
            tile = f"tile{tm}x{tn}.hd{_band(call.d)}"
            names.append(tile if tile in _SM90_FWD_TILES else "block_sparse.tile_fitted")
        else:
            names += _sm100_fwd(call, pack)
    else:
        names.append("mha" if call.qhead_per_kvhead == 1 else "gqa")
        if arch == "sm90":
            names.append(f"hdim_padded{m}" if padded else "hdim_exact")
            wider = sm90_accum_wider(d=call.d, dv=call.dv, block_sparse=bs)
            names.append("accum.wider_than_tile" if wider else "accum.same_as_tile")
            t = sm90_bwd_tile(d=call.d, dv=call.dv, causal=call.causal, local=call.local, block_sparse=bs)
            if t.dq_swap_ab and pad_to(call.d, m) % 64:
                names.append("dq_swapab.hdim_not64")
            dv_part = ".dv256" if t.tile_n == 96 and t.stages_do == 1 else ""
            names.append(f"tile{t.tile_m}x{t.tile_n}{dv_part}.hd{_band(call.d)}")
            if call.deterministic:
                names.append("deterministic")
        else:
            _, _, two_cta, dedicated = sm100_bwd_tile(d=call.d, dv=call.dv, block_sparse=bs)
            names.append(f"hdim_padded{m}" if padded else "hdim_exact")
            names.append("hd256_dedicated" if dedicated else "2cta" if two_cta else "1cta")
            if call.deterministic and not dedicated:
                names.append("deterministic")
    if call.softcap:
        names.append("softcap")
    if call.sink:
        names.append("sink")
    if call.varlen:
        names.append("varlen")
    mods = (
        ("score_mod", call.score_mod),
        ("mask_mod", call.mask_mod),
        ("block_sparse", bs),
        ("aux_scalars", call.aux_scalars),
    )
    names += [k for k, on in mods if on]
    return tuple(f"{arch}.{short}.{n}" for n in names)


def _sm100_fwd(call: Call, pack: bool) -> list[str]:
    """The SM100 forward's head-dim shape, Q stages, 2-CTA and split-KV classes
    (``interface._get_fwd_config``, ``interface._flash_attn_fwd``)."""
    shape = "hd256" if (call.d, call.dv) == (256, 256) else "hd192" if call.d > 128 else "hd128"
    split = call.num_splits > 1
    names = [shape]
    if split and call.d != call.dv:
        # _get_fwd_config: the float32 partial O of split-KV at d != dv: tile_n 64 when there are
        # >= 64 KV blocks, else no split
        split = -(-call.seqlen_k // SM100_TILE_N) >= 64
        if split:
            names.append("splitkv.tile_n64")
    if split:
        names.append("splitkv")
    rows = call.seqlen_q * (call.qhead_per_kvhead if pack else 1)
    q_stage, two_cta = sm100_fwd_geometry(
        d=call.d,
        dv=call.dv,
        causal=call.causal,
        local=call.local,
        packed_rows=rows,
        qhead_per_kvhead=call.qhead_per_kvhead,
        pack_gqa=pack,
        split=split,
        varlen_q=call.varlen,
        paged=call.paged,
        block_sparse=bool(call.block_sparse),
    )
    names += [f"q_stage{q_stage}", "2cta" if two_cta else "1cta"]
    return names
