"""The primitives the FA4 forward model (``fa4.model``) and backward model (``fa4.model_bwd``)
share, stated once: the hardware exp2 (MUFU.EX2), the mask rule, the float32 scales, the
broadcasting FFMA both build on, and how a call's mods apply (``apply_score_mod``,
``apply_mask_mod``, the checks of ``check_mods`` / ``check_block_sparse``).  The forward's
modules (``fa4.forward_loop``, ``fa4.forward_steps``) and ``fa4.model_bwd`` both build on them, so
they live here rather than in either; this module imports only torch, math, ``numerics`` and
``fa4.mufu`` (the MUFU instructions themselves on CUDA).

Production citations are flash-attn-4 4.0.0b36, ``flash_attn/cute``.
"""

from __future__ import annotations

import math

import torch

from fa4 import mufu
from numerics.call import AttentionCall
from numerics.fp import CANONICAL_NAN_BITS, fma_f32
from numerics.fp import to_f32 as _f32
from numerics.mods import bind_aux_scalars

__all__ = [
    "FP8",
    "LOG2_E",
    "div_rn",
    "softcap_tanh",
    "fma",
    "hardware_exp2",
    "hardware_rcp",
    "hardware_lg2",
    "hardware_tanh",
    "scales",
    "visible",
    "visible_bounds",
    "apply_score_mod",
    "apply_mask_mod",
    "check_mods",
    "check_block_sparse",
    "MODEL_FORM_KEYS",
    "bind_model_scalars",
]

#: the model's own forms of a mod (``fa4.mod_forms``): they take the call's aux_scalars as the
#: reference forms do, where the kernel forms ("cute", "cute_bwd") get them from production itself
MODEL_FORM_KEYS = ("model", "model_bwd")

#: the float8 input formats: P and dS round to them saturating, and the forward's output is bfloat16
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
#: math.log2(math.e); a Float32 constant in the kernels, rounded to float32 where they use it
LOG2_E = 1.4426950408889634


def hardware_exp2(t: torch.Tensor) -> torch.Tensor:
    """Model of ``ex2.approx.ftz.f32`` (MUFU.EX2): 2**t correctly rounded to float32, results
    below 2**-126 flushed to +0, NaN -> canonical NaN.  MUFU.EX2 itself is not correctly
    rounded: measured over all 2**32 inputs on the H200 (reports/ex2) its relative error is at
    most 1.46e-7 (2.05 float32 ULP), so it can differ from this model by about 2 ULP.

    The forward's hardware exp2 (``fa4.model`` step 6, the accumulator rescale, the sink) and
    the backward's P and dsink (``flash_bwd_sm90.py`` ``mma_one_m_block``, ``flash_bwd_sm100.py``
    ``compute_loop``, ``flash_bwd_postprocess.py``: always MUFU.EX2, never the polynomial)."""
    if t.is_cuda and _on_gpu(t):  # the instruction itself (fa4.mufu)
        return _gpu("ex2", t)
    y = t.to(torch.float64, copy=True).exp2_().float()
    y.masked_fill_(y < 2.0**-126, 0.0)
    y.view(torch.int32).masked_fill_(torch.isnan(t), CANONICAL_NAN_BITS)
    return y


def _on_gpu(t: torch.Tensor) -> bool:
    return mufu.available(t.device)


def _gpu(op: str, t: torch.Tensor) -> torch.Tensor:
    return mufu.apply(op, t.float())


def hardware_rcp(x: torch.Tensor) -> torch.Tensor:
    """``rcp.approx.ftz.f32`` (MUFU.RCP): the instruction on CUDA (``fa4.mufu``), else 1/x
    correctly rounded (MUFU.RCP's relative error: at most 9.83e-8, measured on the H200)."""
    if x.is_cuda and _on_gpu(x):
        return _gpu("rcp", x)
    return (1.0 / x.double()).float()


def hardware_lg2(x: torch.Tensor) -> torch.Tensor:
    """``lg2.approx.ftz.f32`` (MUFU.LG2): the instruction on CUDA, else log2 correctly rounded
    (MUFU.LG2: absolute error at most 7.78e-6, relative 2.3e-7 where |log2 x| >= 1, measured)."""
    if x.is_cuda and _on_gpu(x):
        return _gpu("lg2", x)
    return torch.log2(x.double()).float()


def hardware_tanh(x: torch.Tensor) -> torch.Tensor:
    """``tanh.approx.f32`` (MUFU.TANH): the instruction on CUDA, else tanh correctly rounded
    (MUFU.TANH: absolute error at most 7.99e-6, measured)."""
    if x.is_cuda and _on_gpu(x):
        return _gpu("tanh", x)
    return torch.tanh(x.double()).float()


def div_rn(x: torch.Tensor, c: float) -> torch.Tensor:
    """``div.rn.f32`` of float32 ``x`` by a float32 constant ``c``: the IEEE quotient, computed
    in float64 and rounded once (correct: float64's 53 bits are at least 2 * 24 + 2, so the
    double rounding of a quotient is innocuous).  Not ``x / c``: torch on CUDA divides by a
    Python scalar as ``x * (1 / c)`` (``BinaryDivTrueKernel.cu``, ``div_true_kernel_cuda``: "may
    lose one bit of precision"), which production does not do: its softcap division
    (``utils.create_softcap_scoremod``) is ``div.rn.f32`` in the PTX and the full-range
    FCHK / FFMA sequence with the ``div_rn_noftz`` slow path in the SASS (sm_90a, compiled on
    2026-12-01).  The reciprocal product differs from production on the H200's softcap case
    (docs/model-and-fidelity.md)."""
    return (x.double() / float(c)).float()


def softcap_tanh(s: torch.Tensor, scale: float, softcap: float) -> torch.Tensor:
    """``tanh(fl(s * scale) / softcap)`` on float32 scores as ``utils.create_softcap_scoremod``
    via ``apply_score_mod_inner`` computes it: FMUL, ``div.rn`` (:func:`div_rn`), MUFU.TANH
    (:func:`hardware_tanh`).  The capped score is this times ``softcap`` (one more FMUL: the
    forward, ``fa4.model`` step 2, and the backward's S); the backward also keeps it for
    ``create_softcap_scoremod_bwd``'s ``1 - t*t``."""
    return hardware_tanh(div_rn(s * scale, softcap))


def visible_bounds(
    sq: int, sk: int, causal: bool, window: tuple, device, *, rows: tuple[int, int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query row: the keys production keeps are the columns in [lo, hi) (int64 tensors of
    shape (rows,); ``mask.py`` ``AttentionMask.apply_mask``, in global indices; the forward and
    backward kernels share it): with ``offset = sk - sq``, causal keeps ``col < row + offset +
    1``; a local window keeps ``row + offset - left <= col < row + offset + 1 + right``; a side
    given as None is unbounded (lo 0, hi sk).  ``rows`` = (start, stop): those rows only.
    Written from production's column limits, independently of ``numerics.reference`` (which
    states the same rule mathematically) so that the audit compares two implementations."""
    left, right = window
    if causal:
        right = 0
    r0, r1 = rows or (0, sq)
    row = torch.arange(r0, r1, device=device)
    hi = torch.full_like(row, sk) if right is None else row + (sk - sq) + 1 + right
    lo = torch.zeros_like(row) if left is None else row + (sk - sq) - left
    return lo, hi


def visible(
    sq: int,
    sk: int,
    causal: bool,
    window: tuple,
    device,
    *,
    rows: tuple[int, int] | None = None,
    cols: tuple[int, int] | None = None,
) -> torch.Tensor:
    """(sq, sk) bool, True where production keeps the score: the columns in
    :func:`visible_bounds`'s [lo, hi) of each row.  ``rows`` / ``cols`` = (start, stop) return
    that block of it only."""
    lo, hi = visible_bounds(sq, sk, causal, window, device, rows=rows)
    c0, c1 = cols or (0, sk)
    col = torch.arange(c0, c1, device=device).view(1, -1)
    return (col >= lo.view(-1, 1)) & (col < hi.view(-1, 1))


def scales(d: int, softmax_scale: float | None, softcap: float) -> tuple[float, float, float]:
    """(scale, softcap, scale_log2) as the kernels hold them, float32 values: ``softmax_scale``
    a Float32 argument (default ``1 / sqrt(head_dim)``), ``scale_log2 = softmax_scale *
    LOG2_E`` in float32, or ``LOG2_E`` with softcap (which applies the scale itself:
    ``utils.create_softcap_scoremod``).  Forward: ``fa4.model`` step 2; backward:
    ``FlashAttentionBackwardSm90.__call__``, ``FlashAttentionBackwardSm100.__call__``."""
    scale = _f32(1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale))
    softcap = float(softcap or 0.0)
    if softcap > 0:
        sl2 = _f32(LOG2_E)
    else:
        sl2 = _f32(scale * _f32(LOG2_E))
    return scale, softcap, sl2


def check_mods(softcap: float, score_mod, mask_mod, aux_tensors, block_sparse_tensors) -> None:
    """Reject what production rejects, and what the model cannot hold, before any work:
    ``softcap`` with a ``score_mod`` (``interface._flash_attn_fwd`` / ``_flash_attn_bwd``: "softcap and
    score_mod cannot be used together"; production's softcap *is* a score_mod), a mod that is not
    a ``numerics.mods`` object, aux tensors not a list / tuple of tensors (those checked by
    ``numerics.call.AttentionCall``, the one place the references check them too)."""
    AttentionCall(
        score_mod=score_mod, mask_mod=mask_mod, aux_tensors=aux_tensors, block_sparse_tensors=block_sparse_tensors
    )
    if score_mod is not None and softcap:
        raise ValueError("softcap and score_mod cannot be used together (interface._flash_attn_fwd asserts it)")


def bind_model_scalars(aux_scalars, score_mod, mask_mod, block_sparse_tensors):
    """(score_mod, mask_mod, block_sparse_tensors) with the call's runtime scalars bound for the
    model (``numerics.mods.bind_aux_scalars``, the model forms too): production hands them to the
    mods through ``AuxData(tensors, scalars)`` (``interface._flash_attn_fwd`` / ``_flash_attn_bwd``)
    and ``softmax.py`` ``call_score_mod`` / ``call_score_mod_bwd`` / ``mask.py`` ``call_mask_mod``
    pass them on only when there are any; ``FlashAttnFunc.backward`` keeps ``ctx.aux_scalars`` for
    the backward, as :func:`fa4.model.attention` keeps the bound mods for its backward."""
    return bind_aux_scalars(
        aux_scalars,
        score_mod=score_mod,
        mask_mod=mask_mod,
        block_sparse=block_sparse_tensors,
        form_keys=MODEL_FORM_KEYS,
    )


def apply_score_mod(s: torch.Tensor, scale: float, score_mod, idx: tuple, aux) -> tuple[torch.Tensor, torch.Tensor]:
    """``softmax.py`` ``apply_score_mod_inner`` on float32 scores ``s`` (the QK^T accumulator):
    ``x = s * softmax_scale`` (one FMUL, rounded to float32), then the mod's reference form in
    float32, ``f = score_mod.fn(x, b, h, q_idx, kv_idx, aux)`` (each torch operation one rounding,
    the order the mod's docstring gives: ``numerics.mods``) — or, when the mod has a model form
    (``forms["model"]``, ``fa4.mod_forms``), that form on the unscaled ``s``: the compiled code
    contracts the FMUL with the mod's first addition (one FFMA), which the reference form cannot
    say.  ``idx`` = (b, h, q_idx, kv_idx)
    int64 index tensors broadcasting to ``s`` (logical indices: production divides pack_gqa's
    packed row back to (row, head) before calling the mod).  Returns (x, f): the backward's
    ``apply_score_mod_bwd_inner`` hands ``x`` (it rescales the saved pre-mod S the same way,
    ``score_tensor * softmax_scale``) to ``score_mod_bwd``.  Used by the forward (``fa4.model``
    step 2) and the backward (``fa4.model_bwd`` step 3) alike."""
    x = s * _f32(scale)
    model = score_mod.forms.get("model")
    if model is not None:  # production's contraction (fa4.mod_forms): e.g. fma(scale, acc, bias)
        f = model(s, scale, *idx, list(aux or ()))
    else:
        f = score_mod.fn(x, *idx, list(aux or ()))
    if not isinstance(f, torch.Tensor) or f.dtype != torch.float32:
        raise TypeError(
            f"score_mod {score_mod.name!r} returned {getattr(f, 'dtype', type(f))} on float32 scores: a reference "
            "form must compute in its input's dtype (numerics.mods: the model evaluates it in float32)"
        )
    return x, f.expand(x.shape).contiguous()


def apply_mask_mod(mask_mod, idx: tuple, aux) -> torch.Tensor:
    """``mask.py`` ``AttentionMask.apply_mask`` / ``apply_mask_sm100``'s mask_mod branch: the
    mod's kept keys (True) at the index tensors ``idx`` = (b, h, q_idx, kv_idx), a bool tensor of
    their broadcast shape (the caller intersects seqlen_k: production's ``mask_seqlen``)."""
    return mask_mod.fn(*idx, list(aux or ())).to(torch.bool)


def check_block_sparse(bs, batch: int, heads: int, sq: int, sk: int, tile_m: int, tile_n: int, arch: str):
    """What ``block_sparsity.normalize_block_sparse_config`` (forward; ``normalize_block_sparse_config_bwd``
    with the backward's tiles) accepts, with its reasons: block masks (1|batch, 1|heads,
    ceil(sq / block_q), ceil(sk / block_k)); block_q a multiple of the tile's rows (``q_stage *
    tile_m``), block_k a multiple of tile_n (SM90: ``kv_subtile_factor`` must be 1, block_k ==
    tile_n).  Returns (q_subtile_factor, kv_subtile_factor)."""
    bq, bk = bs.block_size
    want = (math.ceil(sq / bq), math.ceil(sk / bk))
    B, H = bs.full.shape[:2]
    if B not in (1, batch) or H not in (1, heads) or tuple(bs.full.shape[2:]) != want:
        raise ValueError(
            f"block masks of shape {tuple(bs.full.shape)} do not fit batch {batch}, heads {heads}, block size "
            f"{(bq, bk)} and seqlens ({sq}, {sk}): expected (1|{batch}, 1|{heads}, {want[0]}, {want[1]})"
        )
    # production refuses these (fa4.refusals.REFUSALS maps its ValueErrors to refusals): so does
    # the model, with production's words, and the audit reports the case skipped, not an error
    if bq % tile_m:
        raise NotImplementedError(
            f"Block sparse tensors have block size {bq}, which must be a multiple of {tile_m} (q_stage * tile_m: "
            "block_sparsity.infer_block_sparse_expected_shapes)"
        )
    if bk % tile_n or (arch == "sm90" and bk != tile_n):
        raise NotImplementedError(
            f"Block sparsity requires sparse_block_size[1]={bk} to "
            + ("match" if arch == "sm90" else "be a multiple of")
            + f" tile_n={tile_n} (block_sparsity.normalize_block_sparse_config)"
        )
    return bq // tile_m, bk // tile_n


def fma(a: torch.Tensor, b, c) -> torch.Tensor:
    """fma.rn.f32 with broadcasting; b and c may be Python floats (float32 values)."""
    b, c = (torch.as_tensor(x, dtype=torch.float32, device=a.device) for x in (b, c))
    return fma_f32(a, b, c)
