"""Production FA4's refusals, decided from a call's features (issue 33: by rule, not wording).

Each :class:`Refusal` mirrors one of production's validation checks (``flash_attn/cute/interface.py``
``_flash_attn_fwd``, ``_validate_head_dims``, ``_flash_attn_bwd``, ``config.py`` and friends) for
every release in :data:`SUPPORTED_VERSIONS`, and cites the file and the raising line per release.
:func:`production_refusal` says, from :class:`CallFeatures` (:func:`call_features` of the call),
which rule predicts an exception; the message only confirms it.  An exception that no rule
predicts stays an ``error``, never a skip.  :func:`production_domain` is the domain these rules
leave a kernel on one GPU architecture (``audits.suites.domain``).  Pure Python: no GPU, no
production package needed.
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = [
    "REFUSALS",
    "Refusal",
    "refusal_of",
    "SUPPORTED_VERSIONS",
    "CallFeatures",
    "RefusalMatch",
    "call_features",
    "head_dims_supported",
    "predicted_refusals",
    "production_refusal",
    "production_version",
    "refusal_in_call",
    "ProductionRefusal",
    "SM90_HEAD_DIMS",
    "SM100_HEAD_DIMS",
    "production_domain",
    "PRODUCTION_MODS",
    "device_arch",
]


#: The flash-attn-4 releases whose validation the refusal rules below mirror: each rule cites, per
#: release, the file and the raising line (``tests/test_refusal_rules.py`` checks that every cited
#: line exists in that release's source when the wheels are present: ``pip download --no-deps
#: flash-attn-4==VERSION``).  ``fa4-audit[gpu]`` accepts both (``fa4.releases``); 4.0.0b40 is the
#: newest release audited on the H200 (issue 33).
SUPPORTED_VERSIONS = ("4.0.0b36", "4.0.0b40")
_B36, _B40 = SUPPORTED_VERSIONS
_BOTH = SUPPORTED_VERSIONS


@dataclass(frozen=True)
class CallFeatures:
    """What production's validation reads of one call, and where it runs: the input to the
    refusal rules (:data:`REFUSALS`), built by :func:`call_features` from the call's arguments.

    ``version``: the flash-attn-4 release imported (None: unknown); ``arch``: the GPU's compute
    capability major (None: no CUDA device); ``itemsize``: bytes per input element (1: fp8);
    ``d``, ``dv``: head dims of Q/K and of V; ``causal``, ``local``: the mask after production's
    ``_resolve_causal_local_window`` (a mask_mod drops both); ``softcap``, ``sink``: given;
    ``backward``: the inputs require grad (``_flash_attn_fwd``'s ``requires_grad``; the backward
    itself runs under the same call); ``deterministic``: the backward's flag; ``varlen``:
    cu_seqlens or seqused given; ``num_splits``: split-KV (1: none); ``score_mod``, ``mask_mod``,
    ``block_sparse``: the mods given; ``hd256_generic_bwd``: ``FLASH_ATTENTION_HD256_GENERIC_BWD=1``
    (``utils._get_hd256_generic_bwd``, 4.0.0b36: the generic kernel replaces the dedicated one)."""

    version: str | None
    arch: int | None
    itemsize: int
    d: int
    dv: int
    causal: bool = False
    local: bool = False
    softcap: bool = False
    sink: bool = False
    backward: bool = False
    deterministic: bool = False
    varlen: bool = False
    num_splits: int = 1
    score_mod: bool = False
    mask_mod: bool = False
    block_sparse: bool = False
    hd256_generic_bwd: bool = False


@dataclass(frozen=True)
class Refusal:
    """One documented refusal of production.  ``applies``: whether production refuses a call of
    these :class:`CallFeatures`, mirroring its validation (decided before the call);
    ``exc_type``: what it raises then; ``pattern``: a regex of its message, which only confirms
    (every release's wording); ``source``: the production code that raises it; ``name``: a stable
    id; ``cited``: per release, (file under ``flash_attn/cute``, a verbatim fragment of the raising
    line) — the rule holds for exactly these releases."""

    exc_type: type
    pattern: str
    source: str
    name: str = ""
    applies: Callable[[CallFeatures], bool] | None = None
    cited: tuple[tuple[str, str, str], ...] = ()

    @property
    def versions(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(v for v, _, _ in self.cited))


def head_dims_supported(*, d: int, dv: int, arch: int, alignment: int) -> bool:
    """Production's ``_validate_head_dims`` (flash_attn/cute/interface.py, the same function in
    4.0.0b36 and 4.0.0b40): SM90 takes both in 8..256; SM100/SM110 take both in 8..128, (192, 128),
    (256, 256), dv 512 with d 64 or d == dv; each a multiple of ``alignment`` (``_flash_attn_fwd``
    and ``_flash_attn_bwd``: 16 // element size).  Other archs are not checked there (True)."""
    aligned = d % alignment == 0 and dv % alignment == 0
    if arch == 9:
        return 8 <= d <= 256 and 8 <= dv <= 256 and aligned
    if arch in (10, 11):
        standard = 8 <= d <= 128 and 8 <= dv <= 128
        special = (d, dv) in ((192, 128), (256, 256)) or (dv == 512 and d in (64, dv))
        return (standard or special) and aligned
    return True


# The rules' predicates: module-level functions (a rule travels to worker processes by reference).
def _fp8_not_sm100(f: CallFeatures) -> bool:
    return f.itemsize == 1 and f.arch is not None and f.arch != 10


def _bad_head_dims(f: CallFeatures) -> bool:
    return f.arch is not None and not head_dims_supported(d=f.d, dv=f.dv, arch=f.arch, alignment=16 // f.itemsize)


def _bad_arch(f: CallFeatures) -> bool:
    return f.arch is not None and f.arch not in ((9, 10, 11, 12) if f.backward else (8, 9, 10, 11, 12))


def _sm90_split(f: CallFeatures) -> bool:
    return f.arch == 9 and f.num_splits > 1


def _fp8_backward(f: CallFeatures) -> bool:
    return f.itemsize == 1 and f.backward


def _sm100_dedicated_hd256_bwd(f: CallFeatures) -> bool:
    return f.backward and f.arch in (10, 11) and (f.d, f.dv) == (256, 256) and not f.hd256_generic_bwd


def _hd256_bwd_sink_softcap(f: CallFeatures) -> bool:
    return _sm100_dedicated_hd256_bwd(f) and (f.sink or f.softcap)


def _hd256_bwd_local(f: CallFeatures) -> bool:
    return _sm100_dedicated_hd256_bwd(f) and f.local


def _softcap_score_mod(f: CallFeatures) -> bool:
    return f.softcap and f.score_mod


def _sm8x_score_mod(f: CallFeatures) -> bool:
    return f.arch == 8 and f.score_mod


def _sm120_bwd_mods(f: CallFeatures) -> bool:
    return f.arch == 12 and f.backward and (f.block_sparse or f.score_mod or f.mask_mod)


def _sm90_deterministic_block_sparse_bwd(f: CallFeatures) -> bool:
    return f.arch == 9 and f.backward and f.deterministic and f.block_sparse


def _varlen_block_sparse_bwd(f: CallFeatures) -> bool:
    return f.backward and f.varlen and f.block_sparse


# The block-size rules: production checks the sparse block against the tiles its version's
# heuristics pick for the call (tile_m, tile_n, q_stage: ``_tile_size_fwd_sm90`` and
# ``_get_fwd_config`` in 4.0.0b36, ``config.select_initial_fwd_tile`` in 4.0.0b40), so a rule
# predicts "this block-sparse call may be refused for its block size" and the message names the
# tile it failed (the confirmation).  A call without block sparsity is never refused by them.
def _block_sparse(f: CallFeatures) -> bool:
    return f.block_sparse


def _varlen_block_sparse(f: CallFeatures) -> bool:
    return f.block_sparse and f.varlen


def _block_sparse_bwd(f: CallFeatures) -> bool:
    return f.block_sparse and f.backward


def _sm100_block_sparse_hd192_bwd(f: CallFeatures) -> bool:
    return f.block_sparse and f.backward and f.arch in (10, 11) and f.d == 192


_IFACE = "interface.py"
_BSP = "block_sparsity.py"

#: Production's documented refusals: the only exceptions that make a case ``skipped``.  A call's
#: exception is a refusal when a rule of the imported release predicts it from the call's
#: features (:func:`predicted_refusals`) and the exception has the rule's type
#: (:func:`production_refusal`); the message pattern confirms (each release's wording).  Anything
#: else is an ``error`` verdict.
REFUSALS: tuple[Refusal, ...] = (
    Refusal(
        AssertionError,
        r"FP8 is only supported on SM100",
        "flash_attn/cute/interface.py, _flash_attn_fwd: assert arch // 10 == 10 for fp8 inputs",
        "fp8-needs-sm100",
        _fp8_not_sm100,
        tuple((v, _IFACE, 'assert arch // 10 == 10, "FP8 is only supported on SM100') for v in _BOTH),
    ),
    Refusal(
        AssertionError,
        r"\(head_dim, head_dim_v\)=\(\d+, \d+\) is not supported on SM(90|100/SM110)",
        "flash_attn/cute/interface.py, _validate_head_dims: SM90 takes 8..256; SM100 takes 8..128, (192, 128), "
        "(256, 256) and dv 512 (so (192, 192) is refused)",
        "head-dims",
        _bad_head_dims,
        tuple((v, _IFACE, "def _validate_head_dims(head_dim: int, head_dim_v: int, compute_capability") for v in _BOTH),
    ),
    Refusal(
        AssertionError,
        r"Unsupported compute capability",
        "flash_attn/cute/interface.py, _flash_attn_fwd: assert arch // 10 in [8, 9, 10, 11, 12]; _flash_attn_bwd: "
        "in [9, 10, 11, 12]",
        "compute-capability",
        _bad_arch,
        tuple(
            (v, _IFACE, frag)
            for v in _BOTH
            for frag in ("assert arch // 10 in [8, 9, 10, 11, 12]", "assert arch // 10 in [9, 10, 11, 12]")
        ),
    ),
    Refusal(
        AssertionError,
        r"SplitKV not supported on SM 9\.0",
        "flash_attn/cute/interface.py, _flash_attn_fwd: assert not is_split_kv on arch 9.x (num_splits > 1)",
        "sm90-split-kv",
        _sm90_split,
        ((_B36, _IFACE, 'assert not is_split_kv, "SplitKV not supported on SM 9.0"'),),
    ),
    Refusal(
        ValueError,
        r"SM9 forward does not support SM100-only options: .*num_splits=\d+",
        "flash_attn/cute/config.py, validate_fwd_config: on capacity 9 every field of _FWD_SM100_ONLY_NEUTRAL_FIELDS "
        "must keep its neutral value (num_splits=1); a requested num_splits > 1 is kept (select_fwd_config) and "
        "refused here",
        "sm90-split-kv",
        _sm90_split,
        (
            (_B40, "config.py", 'f"SM{capacity} forward does not support SM100-only options: "'),
            (_B40, "config.py", "num_splits=1,"),
        ),
    ),
    Refusal(
        NotImplementedError,
        r"FA4 CuTe FP8 backward is not supported",
        "flash_attn/cute/interface.py, _flash_attn_fwd: fp8 with requires_grad (forward-only)",
        "fp8-backward",
        _fp8_backward,
        tuple((v, _IFACE, 'raise NotImplementedError("FA4 CuTe FP8 backward is not supported yet') for v in _BOTH),
    ),
    # the backward's own (raised inside torch.autograd.grad; the head-dim rule above covers its
    # _validate_head_dims call too).  4.0.0b40 dropped the dedicated hdim-256 backward kernel and
    # with it these refusals: there the generic kernel runs these calls.
    Refusal(
        AssertionError,
        r"SM100 backward with head_dim=256 does not support (learnable_sink|softcap)",
        "flash_attn/cute/interface.py, _flash_attn_bwd: use_dedicated_hd256_kernel asserts learnable_sink is None "
        "and softcap == 0.0",
        "sm100-hd256-backward-sink-softcap",
        _hd256_bwd_sink_softcap,
        (
            (_B36, _IFACE, '"SM100 backward with head_dim=256 does not support learnable_sink"'),
            (_B36, _IFACE, 'assert softcap == 0.0, "SM100 backward with head_dim=256 does not support softcap"'),
        ),
    ),
    Refusal(
        AssertionError,
        r"SM100 backward with head_dim=256 does not support local attention",
        "flash_attn/cute/sm100_hd256_2cta_fmha_backward.py, BlackwellFusedMultiHeadAttentionBackward.__init__: "
        "assert not is_local",
        "sm100-hd256-backward-local",
        _hd256_bwd_local,
        (
            (
                _B36,
                "sm100_hd256_2cta_fmha_backward.py",
                'assert not is_local, "SM100 backward with head_dim=256 does not support local attention"',
            ),
        ),
    ),
    # the programmable surface (docs/mods.md): what production refuses of a mod configuration
    Refusal(
        AssertionError,
        r"softcap and score_mod(/score_mod_bwd)? cannot be used together",
        "flash_attn/cute/interface.py, _flash_attn_fwd: assert score_mod is None when softcap is set (softcap is "
        "itself a score_mod, utils.create_softcap_scoremod); _flash_attn_bwd: the same for score_mod_bwd",
        "softcap-with-score-mod",
        _softcap_score_mod,
        tuple(
            (v, _IFACE, frag)
            for v in _BOTH
            for frag in (
                '"softcap and score_mod cannot be used together"',
                '"softcap and score_mod/score_mod_bwd cannot',
            )
        ),
    ),
    Refusal(
        NotImplementedError,
        r"Custom user-provided score_mod is not supported on SM8x",
        "flash_attn/cute/interface.py, _flash_attn_fwd / _flash_attn_bwd: arch 8.x raises for a score_mod",
        "sm8x-score-mod",
        _sm8x_score_mod,
        tuple((v, _IFACE, '"Custom user-provided score_mod is not supported on SM8x architectures."') for v in _BOTH),
    ),
    Refusal(
        AssertionError,
        r"(Block sparsity|score_mod|mask_mod) backward not supported on SM 12\.0",
        "flash_attn/cute/interface.py, _flash_attn_bwd: SM120 asserts no block sparsity, score_mod or mask_mod",
        "sm120-backward-mods",
        _sm120_bwd_mods,
        tuple((v, _IFACE, '"Block sparsity backward not supported on SM 12.0"') for v in _BOTH),
    ),
    Refusal(
        AssertionError,
        r"Deterministic not implemented for block-sparse backward",
        "flash_attn/cute/flash_bwd_sm90.py, FlashAttentionBackwardSm90.dQaccum_store: asserts not deterministic "
        "with block sparsity (seen on the H200, 2026-12-02: run --backward --deterministic on a block-sparse case)",
        "sm90-deterministic-block-sparse-backward",
        _sm90_deterministic_block_sparse_bwd,
        tuple((v, "flash_bwd_sm90.py", '"Deterministic not implemented for block-sparse backward"') for v in _BOTH),
    ),
    Refusal(
        AssertionError,
        r"Varlen backward with block sparsity is not yet supported",
        "flash_attn/cute/interface.py, _flash_attn_bwd: asserts no cu_seqlens/seqused with block sparsity",
        "varlen-block-sparse-backward",
        _varlen_block_sparse_bwd,
        tuple((v, _IFACE, '), "Varlen backward with block sparsity is not yet supported"') for v in _BOTH),
    ),
    Refusal(
        ValueError,
        r"Varlen block sparsity requires sparse_block_size\[0\]=\d+ \(= q_stage \* tile_m\)",
        "flash_attn/cute/block_sparsity.py, normalize_block_sparse_config: a varlen call's query block must be "
        "q_stage * tile_m of the forward (no query subtiles on varlen)",
        "varlen-block-size",
        _varlen_block_sparse,
        tuple((v, _BSP, 'f"Varlen block sparsity requires sparse_block_size[0]={base_m_block} "') for v in _BOTH),
    ),
    Refusal(
        ValueError,
        r"Block sparsity requires sparse_block_size\[1\](=\d+)? (to match|to be a multiple of) tile_n=\d+",
        "flash_attn/cute/block_sparsity.py, normalize_block_sparse_config: the key block must be a multiple of the "
        "forward's tile_n, and equal to it on SM90 (no KV subtiles: allow_kv_subtile only on SM100/110)",
        "block-size-kv",
        _block_sparse,
        tuple(
            (v, _BSP, frag)
            for v in _BOTH
            for frag in (
                'f"Block sparsity requires sparse_block_size[1] to be a multiple of tile_n={n_block_size}."',
                'f"Block sparsity requires sparse_block_size[1]={sparse_block_size_kv} to match "',
            )
        ),
    ),
    Refusal(
        ValueError,
        r"Block sparse tensors\w* have block size \d+, which must be a multiple of \d+",
        "flash_attn/cute/block_sparsity.py, infer_block_sparse_expected_shapes: the query block must be a multiple "
        "of q_stage * tile_m of the forward",
        "block-size-q",
        _block_sparse,
        tuple((v, _BSP, 'f"which must be a multiple of {base_m_block}."') for v in _BOTH),
    ),
    Refusal(
        ValueError,
        r"Block sparse tensors\w* require BLOCK_SIZE_KV to be a multiple of \d+",
        "flash_attn/cute/block_sparsity.py, infer_block_sparse_expected_shapes: the key block must be a multiple "
        "of tile_n",
        "block-size-kv-tensors",
        _block_sparse,
        tuple((v, _BSP, "require BLOCK_SIZE_KV to be a multiple of {base_n_block}.") for v in _BOTH),
    ),
    Refusal(
        ValueError,
        r"Block sparsity requires sparse_block_size\[0\] to be a multiple of tile_m=\d+",
        "flash_attn/cute/interface.py, _flash_attn_bwd (4.0.0b36); flash_attn/cute/config.py, validate_bwd_config "
        "(4.0.0b40): the query block must be a multiple of the backward's tile_m",
        "block-size-q-backward",
        _block_sparse_bwd,
        (
            (_B36, _IFACE, '"Block sparsity requires sparse_block_size[0] to be a multiple of "'),
            (_B40, "config.py", '"Block sparsity requires sparse_block_size[0] to be a multiple of "'),
        ),
    ),
    Refusal(
        ValueError,
        r"Block sparsity expects sparse_block_size(_q=\d+ for q_subtile_factor|\[1\]=\d+ for kv_subtile_factor"
        r"|\[1\] to be a multiple of tile_n)",
        "flash_attn/cute/block_sparsity.py, normalize_block_sparse_config_bwd / get_kv_subtile_factor (4.0.0b40: "
        "config.py): the blocks must be whole multiples of the backward's tiles",
        "block-size-backward",
        _block_sparse_bwd,
        tuple(
            (v, _BSP, frag)
            for v in _BOTH
            for frag in (
                'f"Block sparsity expects sparse_block_size_q={q_subtile_factor * m_block_size} "',
                'f"Block sparsity expects sparse_block_size[1]={expected_sparse_block_size_kv} "',
            )
        )
        + (
            (_B36, _BSP, '"Block sparsity expects sparse_block_size[1] "'),
            (_B40, "config.py", '"Block sparsity expects sparse_block_size[1] "'),
        ),
    ),
    Refusal(
        ValueError,
        r"SM100 block-sparse backward with head_dim=192 requires 2CTA",
        "flash_attn/cute/interface.py, _flash_attn_bwd (4.0.0b40: config.py): block-sparse hdim 192 needs 2CTA, "
        "which needs an even number of tile_n tiles per key block",
        "sm100-block-sparse-hd192-backward",
        _sm100_block_sparse_hd192_bwd,
        (
            (_B36, _IFACE, 'raise ValueError(f"{needs_2cta} requires 2CTA; {reason}.")'),
            (_B40, "config.py", 'raise ValueError(f"{needs_2cta} requires 2CTA; {reason}.")'),
        ),
    ),
)


def predicted_refusals(features: CallFeatures, rules: tuple[Refusal, ...] = REFUSALS) -> tuple[Refusal, ...]:
    """The rules of ``rules`` that predict a refusal of a call of these ``features``, decided from
    the features alone (before the call): those of the imported release (``features.version``),
    or of every supported release when the version is not one of :data:`SUPPORTED_VERSIONS`
    (then :func:`production_refusal` also demands the message's confirmation)."""
    known = features.version in SUPPORTED_VERSIONS
    return tuple(
        r
        for r in rules
        if r.applies is not None and (not known or features.version in r.versions) and r.applies(features)
    )


@dataclass(frozen=True)
class RefusalMatch:
    """An exception production raised, recognised as a refusal: the ``rule`` that predicted it
    and whether its message has the rule's known wording (``confirmed``)."""

    rule: Refusal
    confirmed: bool

    def reason(self, exc: BaseException) -> str:
        """The ``skipped`` reason: the rule, its source, whether the message confirms, the message."""
        how = "its message confirms" if self.confirmed else "its message is not in the rule's known wording"
        return (
            f"production refuses this configuration (rule {self.rule.name}, predicted from the call's features; "
            f"{how}; {self.rule.source}): {exc}"
        )


def production_refusal(
    exc: BaseException, features: CallFeatures, rules: tuple[Refusal, ...] = REFUSALS
) -> RefusalMatch | None:
    """Whether ``exc``, raised by production on a call of ``features``, is a documented refusal: a
    rule of :func:`predicted_refusals` with ``exc``'s exact type; its message pattern confirms
    (required when the release is not a supported one, whose rules were not checked against its
    source).  None: no rule predicts it, an ``error`` verdict, whatever the message says."""
    cands = [r for r in predicted_refusals(features, rules) if type(exc) is r.exc_type]
    confirmed = [r for r in cands if re.search(r.pattern, str(exc))]
    if confirmed:
        return RefusalMatch(confirmed[0], True)
    if cands and features.version in SUPPORTED_VERSIONS:
        return RefusalMatch(cands[0], False)
    return None


#: the mod kinds production takes (``audits.suites.cases.MOD_KINDS``; ``audits.suites.domain`` key ``mods``):
#: ``flash_attn_func``'s score_mod / score_mod_bwd, mask_mod (with aux_tensors) and
#: block_sparse_tensors / block_sparse_tensors_bwd (flash_attn/cute/interface.py)
PRODUCTION_MODS = ("score_mod", "mask_mod", "block_sparse", "aux_scalars")


def _steps(lo: int, hi: int, step: int) -> dict:
    return {"min": lo, "max": hi, "step": step}


#: SM90's head dims (flash_attn/cute/interface.py, ``_validate_head_dims``, compute capability 9:
#: ``is_sm90_range``, both in 8..256, each a multiple of ``alignment``, which ``_flash_attn_fwd``
#: sets to 16 // element size: 8 for the 16-bit dtypes, SM90's only ones): every pair of
#: multiples of 8, 1,024 pairs, in the ``head_dims`` forms of ``audits.suites.domain`` (docs/runner.md).
SM90_HEAD_DIMS = [{"d": _steps(8, 256, 8), "dv": _steps(8, 256, 8)}]
#: SM100/SM110's head dims (``_validate_head_dims``, compute capability 10 or 11): both in
#: 8..128 (``is_standard_range``), (192, 128) (``is_deepseek_shape``), (256, 256)
#: (``is_hdim256_shape``), dv 512 with d 64 or d == dv (``is_deepseek_mla_absorbed_shape``:
#: (64, 512), (512, 512)), each a multiple of the alignment: 260 pairs at the 16-bit dtypes'
#: alignment of 8.  fp8's alignment is 16 (``_flash_attn_fwd``: 16 // 1 byte), which keeps the
#: special shapes and multiples of 16 in 16..128 for the standard range; a domain has no
#: per-dtype head dims, so fp8 at d or dv 8 mod 16 stays a run-time refusal (the head-dim rule
#: of :data:`REFUSALS`).
SM100_HEAD_DIMS = [{"d": _steps(8, 128, 8), "dv": _steps(8, 128, 8)}, [192, 128], 256, [64, 512], 512]


def production_domain(major: int | None = None) -> dict:
    """What production supports on a GPU of compute capability ``major`` (this machine's when
    None), as a domain declaration (``audits.suites.domain``), derived from production's own checks in
    flash-attn-4 4.0.0b36, ``flash_attn/cute/interface.py``:

    * SM90 (9.x): bf16 and fp16 (``_flash_attn_fwd``: ``assert arch // 10 == 10`` for fp8, "FP8
      is only supported on SM100"); head dims :data:`SM90_HEAD_DIMS` (``_validate_head_dims``);
    * SM100 (10.x): every dtype; head dims :data:`SM100_HEAD_DIMS`, so (192, 192) is outside;
    * SM110 (11.x): the same head dims (``_validate_head_dims`` treats 10 and 11 alike), bf16
      and fp16 only (the fp8 assertion above admits 10.x alone);
    * no GPU, other generations: nothing declared (production cannot run; 8.x and 12.x skip
      ``_validate_head_dims`` and are not modelled here).

    Masks, softcap, the sink, GQA, layouts, the backward and ``deterministic`` are supported on
    both, and so is the programmable surface (``mods``: :data:`PRODUCTION_MODS`, score_mod with
    score_mod_bwd, mask_mod and block sparsity in ``flash_attn_func``'s signature on SM90 and
    SM100/110; SM8x refuses a score_mod, SM120's backward all of them, not declared here); what
    depends on several axes at once (fp8's head-dim alignment of 16, SM100's head-dim-256
    backward without softcap, sink or windows, block sizes that are no multiple of the tiles)
    stays a run-time refusal matched by :data:`REFUSALS`.  ``tests/test_production_domain.py``
    checks the head dims against ``_validate_head_dims`` itself, read from production's source,
    for every (d, dv) in 1..520."""
    if major is None:
        if not torch.cuda.is_available():
            return {}
        major = torch.cuda.get_device_capability()[0]
    declared = {
        9: {"dtypes": ["bfloat16", "float16"], "head_dims": SM90_HEAD_DIMS, "mods": list(PRODUCTION_MODS)},
        10: {"head_dims": SM100_HEAD_DIMS, "mods": list(PRODUCTION_MODS)},
        11: {"dtypes": ["bfloat16", "float16"], "head_dims": SM100_HEAD_DIMS, "mods": list(PRODUCTION_MODS)},
    }.get(major, {})
    return copy.deepcopy(declared)  # the caller's to change


def refusal_of(exc: BaseException, rules: tuple[Refusal, ...] = REFUSALS) -> Refusal | None:
    """The rule of ``rules`` (:data:`REFUSALS`) whose type and wording ``exc`` has, or None: the
    message's confirmation alone, for what has no call to read features from (a compile of
    ``fa4.sm100_compile``); the adapters decide by :func:`production_refusal`."""
    for rule in rules:
        if type(exc) is rule.exc_type and re.search(rule.pattern, str(exc)):
            return rule
    return None


def production_version() -> str | None:
    """The installed flash-attn-4 release (its distribution metadata), or None when absent."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("flash-attn-4")
    except PackageNotFoundError:
        return None


def device_arch(device: torch.device) -> int | None:
    """The compute capability major of a CUDA ``device`` (production's ``arch // 10``); None elsewhere."""
    return torch.cuda.get_device_capability(device)[0] if device.type == "cuda" else None


#: the keywords by which a call is varlen (``flash_attn_varlen_func``; ``_flash_attn_bwd``'s check)
_VARLEN_MARKS = ("cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k")


def call_features(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, backward: bool, **kw) -> CallFeatures:
    """The :class:`CallFeatures` of a production call with these arguments (the adapters' keywords:
    the contract's mods, ``numerics.mods``, before ``fa4.mods.production_kwargs``), on ``q``'s
    device with the imported release (:func:`production_version`).  ``backward``: the call is the
    forward of a backward (its inputs require grad)."""
    window = tuple(kw.get("window_size") or (None, None))
    bs = kw.get("block_sparse_tensors")
    blocks = [b for b in (bs if isinstance(bs, list | tuple) else [bs]) if b is not None]
    mask_mod = kw.get("mask_mod") is not None or any(getattr(b, "mask_mod", None) is not None for b in blocks)
    # _resolve_causal_local_window (interface.py, the same in 4.0.0b36 and 4.0.0b40)
    left, right = window
    causal, local = bool(kw.get("causal")), False
    if not mask_mod:
        if left is not None and right is not None and left < 0 and right < 0:
            left = right = None
        if causal:
            right = 0
        if left is not None or right is not None:
            causal, local = (True, False) if left is None and right == 0 else (False, True)
    return CallFeatures(
        version=production_version(),
        arch=device_arch(q.device),
        itemsize=v.element_size(),
        d=q.shape[-1],
        dv=v.shape[-1],
        causal=causal,
        local=local,
        softcap=bool(kw.get("softcap")),
        sink=kw.get("learnable_sink") is not None,
        backward=backward,
        deterministic=bool(kw.get("deterministic")),
        varlen=any(kw.get(n) is not None for n in _VARLEN_MARKS),
        num_splits=int(kw.get("num_splits") or 1),
        score_mod=kw.get("score_mod") is not None,
        mask_mod=mask_mod,
        block_sparse=bool(blocks),
        hd256_generic_bwd=os.environ.get("FLASH_ATTENTION_HD256_GENERIC_BWD", "0") == "1",
    )


def refusal_in_call(exc: BaseException, q, k, v, *, backward: bool, **kw) -> RefusalMatch | None:
    """:func:`production_refusal` of ``exc`` for the call of these arguments (:func:`call_features`):
    the adapters' and the backward runner's decision (``fa4_audit_refusal`` of a production kernel)."""
    return production_refusal(exc, call_features(q, k, v, backward=backward, **kw))


class ProductionRefusal(NotImplementedError):
    """Production refused the call by a documented rule (:data:`REFUSALS`): verdict ``skipped``."""
