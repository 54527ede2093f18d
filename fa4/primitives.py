"""The primitives the FA4 forward model (``fa4.model``) and backward model (``fa4.model_bwd``)
share, stated once: the hardware exp2 (MUFU.EX2), the mask rule, the float32 scales, and the
broadcasting FFMA both build on.  ``fa4.model`` imports ``fa4.model_bwd`` (its autograd hook), so
they live here rather than in either; this module imports only torch, math and ``numerics``.

Production citations are flash-attn-4 4.0.0b36, ``flash_attn/cute``.
"""

from __future__ import annotations

import math

import torch

from numerics.fp import CANONICAL_NAN_BITS, fma_f32
from numerics.fp import to_f32 as _f32

__all__ = [
    "FP8", "LOG2_E", "div_rn", "softcap_tanh", "fma", "hardware_exp2", "hardware_rcp", "hardware_lg2", "hardware_tanh",
    "scales", "visible", "visible_bounds",
]  # fmt: skip

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
    from fa4 import mufu

    return mufu.available(t.device)


def _gpu(op: str, t: torch.Tensor) -> torch.Tensor:
    from fa4 import mufu

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
    2026-12-01).  That reciprocal was the model's one difference from production on the H200's
    softcap case (docs/model-and-fidelity.md)."""
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


def fma(a: torch.Tensor, b, c) -> torch.Tensor:
    """fma.rn.f32 with broadcasting; b and c may be Python floats (float32 values)."""
    b, c = (torch.as_tensor(x, dtype=torch.float32, device=a.device) for x in (b, c))
    return fma_f32(a, b, c)
