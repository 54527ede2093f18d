"""Bit-exact model of FA4's polynomial exp2 emulation (the Blackwell softmax's MUFU offload).

Models ``flash_attn/cute/utils.py`` of flash-attn-4 4.0.0b36:

* :func:`ex2_emulation` — ``utils.ex2_emulation(x, poly_degree=degree)``, the scalar device
  function.  Its PTX: ``max.f32`` (``cute.arch.fmax``, no ``.ftz``, NaN-quiet), the inline asm
  ``add.rm.ftz.f32`` of ``add_round_down``, two round-to-nearest subtractions (plain ``-`` on
  ``Float32``), Horner's rule in ``evaluate_polynomial`` (``out * x + c`` contracted to one
  ``fma.rn.f32``), and the integer splice of ``combine_int_frac_ex2``
  (``shl.b32`` by 23, ``add.s32``: wraps modulo 2**32).
* :func:`ex2_emulation_2` — ``utils.ex2_emulation_2``, the packed pair variant that the SM100
  forward kernel actually calls (``SoftmaxSm100.apply_exp2_convert``).  It goes through
  ``cute.arch.add_packed_f32x2(..., rnd="rm")``, ``sub_packed_f32x2`` and ``fma_packed_f32x2``,
  whose ``ftz`` argument defaults to ``None``: the PTX is ``add.rm.f32x2`` — **without**
  ``.ftz``.  The two lanes of a pair never interact, so the model is elementwise.  The only
  observable difference from the scalar function: a *negative subnormal* x.  Scalar: ``.ftz``
  flushes it to -0, ``floor`` is 0 and the result is 1.0.  Packed: the exact sum lies just below
  1.5*2**23, rounds down to 1.5*2**23 - 1, the fraction ``x + 1`` rounds to 1.0 and the result is
  ``p(1) / 2`` (0.99991... for degree 3, not 1.0).

The algorithm (x <= 127 assumed by production; the model reproduces what happens beyond):

1. ``xc = max(x, -127)``; PTX ``max`` returns the non-NaN operand, so NaN becomes -127 and the
   result for NaN is 2**-127 spliced to 0.0 (not NaN: production swallows NaN scores here).
2. ``r = RD(xc + 1.5*2**23)``: for |xc| < 2**22 the sum lies in [2**23, 2**24) where float32
   spacing is 1, so rounding down gives exactly ``1.5*2**23 + floor(xc)``, and the low bits of
   ``r``'s pattern hold ``floor(xc)`` in two's complement.
3. ``r - 1.5*2**23`` is then exact (= ``floor(xc)``); ``f = xc - floor(xc)`` is exact for
   |xc| >= 1 and rounds to nearest for xc in (-1, 0) (it can round up to 1.0).
4. ``p = c0 + f*(c1 + f*(c2 + ...))`` by fma, one rounding each.
5. result bits = ``(bits(r) << 23) + bits(p)`` modulo 2**32: adds floor(xc) to p's exponent.
   Correct when the result is normal; for xc in (-127, -126) the exponent field underflows and
   the sum borrows from p's fraction (a wrongly scaled subnormal); for xc >= 128 it carries into
   the sign bit.

Implementation: elements with xc < 2**22 (all the softmax ever sees) take a fast path that uses
steps 2-3 in closed form (``floor``) and evaluates Horner's fmas in float64; a float64 sum of an
exact product and a float32 can only double-round when it lands exactly on a float32 midpoint,
so every such landing is detected and recomputed with the proven ``numerics.fp.fma_f32``.
Everything else (xc >= 2**22, +inf) takes the literal path through ``numerics.fp``.
"""

from __future__ import annotations

import torch

from numerics.fp import CANONICAL_NAN_BITS, add_rm, f32_bits, f32_from_bits, fma_f32, on_f32_midpoint

__all__ = ["POLY_EX2", "PTX_MODEL", "ex2_emulation", "ex2_emulation_2", "emulated_columns", "DEGREES"]

#: Polynomial coefficients (c0, c1, ..., cN) of 2**f on [0, 1], lowest order first, as in
#: ``flash_attn.cute.utils.POLY_EX2`` (Sollya ``fpminimax(exp(x*log(2)), N, [|1,24...|], [0;1],
#: relative)``).  Every literal is exactly a float32 (24-bit significand), so the float32
#: constants the kernel compiles are these values with no rounding.
POLY_EX2: dict[int, tuple[float, ...]] = {
    1: (1.0, 0.922497093677520751953125),
    2: (1.0, 0.6657850742340087890625, 0.330107033252716064453125),
    3: (1.0, 0.695146143436431884765625, 0.227564394474029541015625, 0.077119089663028717041015625),
    4: (
        1.0,
        0.693042695522308349609375,
        0.2412912547588348388671875,
        5.2225358784198760986328125e-2,
        1.3434938155114650726318359375e-2,
    ),
    5: (
        1.0,
        0.693151414394378662109375,
        0.24016360938549041748046875,
        5.5802188813686370849609375e-2,
        9.01452265679836273193359375e-3,
        1.86810153536498546600341796875e-3,
    ),
}
DEGREES = tuple(sorted(POLY_EX2))

#: The PTX this model assumes, per call of each production function (checked against compiled
#: production code by ``audits.checks.ex2.ptx``): f32 instructions as (op, rounding, ftz, width) ->
#: count, where a subtraction counts as an addition (negation is exact) and ``fma`` counts are
#: per polynomial degree.  Seen in the sm_100a (and sm_90a, scalar) PTX of flash-attn-4 4.0.0b36:
#:   scalar: max.f32; add.rm.ftz.f32; add.f32 (x_rounded + -1.5*2**23); sub.f32; fma.rn.f32 x deg
#:   packed: max.f32 x 2; add.rm.f32x2; sub.rn.f32x2 x 2; fma.rn.f32x2 x deg
PTX_MODEL: dict[str, dict[tuple, int]] = {
    "scalar": {
        ("max", None, False, 1): 1,
        ("add", "rm", True, 1): 1,
        ("add", "rn", False, 1): 2,
        ("fma", "rn", False, 1): 1,
    },
    "packed": {
        ("max", None, False, 1): 2,
        ("add", "rm", False, 2): 1,
        ("add", "rn", False, 2): 2,
        ("fma", "rn", False, 2): 1,
    },
}

_ROUND_INT = 1.5 * 2.0**23  # 0x4B400000: ulp 1 in [2**23, 2**24) puts floor(x) in the low bits
_FAST_LIMIT = 2.0**22  # below it, RD(x + 1.5*2**23) == 1.5*2**23 + floor(x) exactly
_FLT_MIN = 2.0**-126
_NUMBA_MIN = 1 << 12  # below this the compiled loop's call overhead is not worth it


def _check(x: torch.Tensor, degree: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor of float32, got {type(x).__name__}")
    if x.dtype != torch.float32:
        raise TypeError(
            f"x must be float32 (the kernel applies exp2 to float32 scores), got {x.dtype}; convert with x.float()"
        )
    if degree not in POLY_EX2:
        raise ValueError(f"degree must be one of {list(DEGREES)} (production POLY_EX2), got {degree!r}")


def _horner_exact(f: torch.Tensor, coeffs: tuple[float, ...]) -> torch.Tensor:
    """Horner by correctly rounded float32 fma (``numerics.fp.fma_f32``)."""
    acc = torch.full_like(f, coeffs[-1])
    for c in reversed(coeffs[:-1]):
        acc = fma_f32(acc, f, torch.full_like(f, c))
    return acc


def _horner(f: torch.Tensor, coeffs: tuple[float, ...]) -> torch.Tensor:
    """Horner by float32 fma, computed in float64 with a double-rounding guard (module doc)."""
    f64 = f.double()
    acc64 = None
    suspect = torch.zeros(f.shape, dtype=torch.bool, device=f.device)
    for c in reversed(coeffs[:-1]):
        prod = f64 * coeffs[-1] if acc64 is None else acc64 * f64  # exact in float64
        s = prod + c  # one float64 rounding
        # Double rounding needs s on a float32 midpoint (bit 28 alone set below float32's last
        # fraction bit) *and* an inexact float64 sum.  The midpoint test alone is used here
        # (conservative: exact midpoints are redone too).  s is never float32-subnormal (a
        # coarser grid): f >= 0 and every c_k > 2**-126 give s >= c_k.
        suspect |= on_f32_midpoint(s)
        acc64 = s.float().double()
    acc = acc64.float()
    if bool(suspect.any()):
        idx = suspect.nonzero(as_tuple=True)
        acc[idx] = _horner_exact(f[idx], coeffs)
    # A NaN fraction (only from +inf input) gives the canonical NaN, as fma.rn.f32 does.
    return torch.where(
        torch.isnan(acc), f32_from_bits(torch.tensor(CANONICAL_NAN_BITS, dtype=torch.int32, device=f.device)), acc
    )


def _splice(r_bits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``combine_int_frac_ex2``: (r_bits << 23) + bits(p), 32-bit wraparound."""
    v = (r_bits.to(torch.int64) << 23) + f32_bits(p).to(torch.int64)
    return f32_from_bits(v.to(torch.int32))  # int64 -> int32 keeps the low 32 bits (mod 2**32)


def _literal(xc: torch.Tensor, coeffs: tuple[float, ...], ftz: bool) -> torch.Tensor:
    """Steps 2-5 exactly as the PTX does them, for any float32 (used where xc >= 2**22)."""
    c = torch.full_like(xc, _ROUND_INT)
    r = add_rm(xc, c, ftz=ftz)
    back = r - c
    f = xc - back
    return _splice(f32_bits(r), _horner_exact(f, coeffs))


def _ex2_torch(x: torch.Tensor, coeffs: tuple[float, ...], ftz_round: bool) -> torch.Tensor:
    """The vectorized torch implementation (any device)."""
    # PTX max.f32 returns the non-NaN operand.  (torch.fmax is not used: on CPU it returned NaN
    # for the signalling NaN 0xFFA09B7D in torch 2.13.)
    xc = torch.where(torch.isnan(x), torch.full_like(x, -127.0), x.clamp(min=-127.0))
    fast = xc < _FAST_LIMIT
    all_fast = bool(fast.all())
    xs = xc if all_fast else torch.where(fast, xc, torch.zeros_like(xc))
    fl = torch.floor(xs)
    if ftz_round:
        # add.rm.ftz flushes a negative subnormal to -0, whose floor is 0, not -1.
        fl = torch.where(xs > -_FLT_MIN, fl.clamp(min=0.0), fl)
    f = xs - fl  # round to nearest; exact unless xs in (-1, 0)
    out = _splice(fl.to(torch.int32), _horner(f, coeffs))
    if not all_fast:
        idx = (~fast).nonzero(as_tuple=True)
        out[idx] = _literal(xc[idx], coeffs, ftz_round)
    return out


def _ex2(x: torch.Tensor, degree: int, *, ftz_round: bool) -> torch.Tensor:
    _check(x, degree)
    coeffs = POLY_EX2[degree]
    if x.device.type == "cpu" and x.numel() >= _NUMBA_MIN:
        return _ex2_numba(x, coeffs, ftz_round)
    return _ex2_torch(x, coeffs, ftz_round)


def _ex2_numba(x: torch.Tensor, coeffs: tuple[float, ...], ftz_round: bool) -> torch.Tensor:
    """CPU fast path: the same algorithm fused into one compiled loop (``fa4.ex2_cpu``);
    elements it flags (xc >= 2**22, float64 midpoints) are redone by the torch path."""
    # lazy: importing numba costs about 0.15 s, which every fa4-audit command would pay (the CLI
    # reads fa4.ex2's tables) although only a CPU sweep or the CPU model runs this loop
    from fa4 import ex2_cpu

    xf = x.contiguous().view(-1)
    out = torch.empty_like(xf)
    flags = ex2_cpu.ex2_fast(xf.numpy(), out.numpy(), coeffs, ftz_round)
    if flags is not None:
        idx = torch.from_numpy(flags).nonzero(as_tuple=True)
        out[idx] = _ex2_torch(xf[idx], coeffs, ftz_round)
    return out.view(x.shape)


def ex2_emulation(x: torch.Tensor, degree: int = 3) -> torch.Tensor:
    """Production ``flash_attn.cute.utils.ex2_emulation(x, poly_degree=degree)``, bit for bit.

    x: float32 tensor of any shape, CPU or CUDA.  Returns a float32 tensor of the same shape.
    Degree 1-5.  Special inputs: NaN -> 0.0, -inf and x <= -127 -> 0.0, +inf -> NaN
    (0x7FFFFFFF), x in (-127, -126) -> a wrongly scaled subnormal, x >= 128 -> wrapped exponent.
    """
    return _ex2(x, degree, ftz_round=True)


def ex2_emulation_2(x: torch.Tensor, degree: int = 3) -> torch.Tensor:
    """Production ``flash_attn.cute.utils.ex2_emulation_2`` (packed pairs), per lane, bit for bit.

    Same contract as :func:`ex2_emulation`; differs only on negative subnormal inputs, because
    its round-down add has no ``.ftz`` (module doc).
    """
    return _ex2(x, degree, ftz_round=False)


def emulated_columns(
    n_cols: int = 128,
    *,
    ex2_emu_freq: int,
    ex2_emu_res: int = 4,
    ex2_emu_start_frg: int = 0,
) -> torch.Tensor:
    """Which columns of a softmax row tile production sends to the polynomial exp2.

    Models ``SoftmaxSm100.apply_exp2_convert`` (``flash_attn/cute/softmax.py``): a thread holds
    one row of the S tile (``tcgen05.copy.Ld32x32bOp`` gives each thread one TMEM lane and its
    32-bit columns in order, so register index = column).  The row is cut into fragments of 32;
    pairs (k, k+1), k even, are emulated iff ``k % freq >= freq - res``, the fragment index j is
    ``>= start_frg`` and j is not the last fragment.  ``freq == 0`` means all hardware.  The
    SM100 kernel passes ``freq`` and ``start_frg`` from ``_TUNING_CONFIG`` and leaves ``res``
    at its default 4.

    Returns a bool tensor of shape (n_cols,), True where the emulation is used.
    """
    if n_cols <= 0 or n_cols % 32:
        raise ValueError(f"n_cols must be a positive multiple of 32 (fragments of 32), got {n_cols}")
    if ex2_emu_freq < 0 or ex2_emu_res < 0 or ex2_emu_start_frg < 0:
        raise ValueError(
            f"ex2_emu_freq, ex2_emu_res, ex2_emu_start_frg must be >= 0, got "
            f"{ex2_emu_freq}, {ex2_emu_res}, {ex2_emu_start_frg}"
        )
    mask = torch.zeros(n_cols, dtype=torch.bool)
    if ex2_emu_freq == 0:
        return mask
    n_frg = n_cols // 32
    for j in range(ex2_emu_start_frg, n_frg - 1):
        for k in range(0, 32, 2):
            if k % ex2_emu_freq >= ex2_emu_freq - ex2_emu_res:
                mask[32 * j + k : 32 * j + k + 2] = True
    return mask
