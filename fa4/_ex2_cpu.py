"""Compiled CPU loop for ``fa4.ex2`` (numba): the fast path of the model fused into one pass.

Same algorithm and the same proof obligations as ``fa4.ex2._ex2_torch`` (see that module's
docstring); this file only exists because a chain of ~40 torch elementwise ops is memory-bound
on a CPU.  Per element:

* NaN -> -127, else max(x, -127) (PTX ``max.f32``);
* xc < 2**22: ``fl = floor(xc)`` (``.ftz`` flushes negative subnormals: floor 0, not -1),
  ``bits(r) = 0x4B400000 + fl`` and ``f = xc - fl`` in float32 (numba keeps float32 - float32
  in float32: one IEEE rounding);
* xc >= 2**22 (also +inf): the literal sequence, the round-down add by float32 TwoSum;
* Horner: each fma as an exact float64 product plus one float64 addition; a sum that lands
  exactly on a float32 midpoint (the 29 float64 fraction bits below float32's last are
  1000...0) *after rounding* (TwoSum error nonzero) is the only case where rounding again
  to float32 can differ from a single rounding, so it is flagged;
* the splice ``(fl << 23) + bits(p)`` modulo 2**32, through LLVM bitcasts.

The loop body is branch-free so that LLVM can vectorize it.

numba compiles without ``fastmath``: no reassociation, no contraction of a*b + c into an fma.
"""

from __future__ import annotations

import math

import numpy as np

try:  # optional: without numba the torch path is used
    import numba
except ImportError:  # pragma: no cover - exercised when numba is absent
    numba = None

__all__ = ["available", "ex2_fast"]

_FAST_LIMIT = np.float32(2.0**22)
_FLT_MIN = np.float32(2.0**-126)
_ROUND_INT = np.float32(1.5 * 2.0**23)


def available() -> bool:
    return numba is not None


if numba is not None:
    from numba.core import types
    from numba.extending import intrinsic

    @intrinsic
    def _bits64(typingctx, x):  # pragma: no cover - compiled
        """Reinterpret a float64 as int64 (an LLVM bitcast: no memory round trip)."""

        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], context.get_value_type(types.int64))

        return types.int64(types.float64), codegen

    @intrinsic
    def _bits32(typingctx, x):  # pragma: no cover - compiled
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], context.get_value_type(types.int32))

        return types.int32(types.float32), codegen

    @intrinsic
    def _float32(typingctx, x):  # pragma: no cover - compiled
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], context.get_value_type(types.float32))

        return types.float32(types.int32), codegen

    @numba.njit(parallel=True, fastmath=False, cache=True, nogil=True)
    def _kernel(x, out, flags, coeffs, ftz, want_flags):  # pragma: no cover - compiled
        n = x.shape[0]
        deg = coeffs.shape[0] - 1
        nflag = 0
        for i in numba.prange(n):
            xi = x[i]
            xc = np.float32(-127.0) if math.isnan(xi) else max(xi, np.float32(-127.0))
            if xc < _FAST_LIMIT:
                # RD(xc + 1.5*2**23) == 1.5*2**23 + floor(xc): bits 0x4B400000 + floor(xc)
                fl = np.floor(xc)  # float32 floor (math.floor would round-trip through int64)
                if ftz and xc > -_FLT_MIN:
                    fl = max(fl, np.float32(0.0))  # add.rm.ftz sees -0 for a negative subnormal
                rbits = np.int64(0x4B400000) + np.int64(fl)
                f = np.float32(xc - fl)
            else:
                # The literal sequence (xc >= 2**22 or +inf): RD via float32 TwoSum.
                s32 = xc + _ROUND_INT
                bb = s32 - xc
                e = (xc - (s32 - bb)) + (_ROUND_INT - bb)
                rbits = np.int64(_bits32(s32))
                if e < 0 and not math.isinf(s32):
                    rbits -= 1  # s > 0: the float just below
                r = _float32(np.int32(rbits))
                f = np.float32(xc - np.float32(r - _ROUND_INT))
            f64 = np.float64(f)
            acc = coeffs[deg]
            mid = False
            for k in range(deg - 1, -1, -1):
                prod = acc * f64
                s = prod + coeffs[k]
                if (_bits64(s) & 0x1FFFFFFF) == 0x10000000:
                    # on a float32 midpoint: harmless only if the float64 sum was exact (TwoSum)
                    a_ = s - coeffs[k]
                    b_ = s - a_
                    mid |= ((prod - a_) + (coeffs[k] - b_)) != 0.0
                acc = np.float64(np.float32(s))
            p = np.float32(acc)
            pbits = np.int64(0x7FFFFFFF) if math.isnan(p) else np.int64(_bits32(p)) & 0xFFFFFFFF
            w = ((rbits << 23) + pbits) & 0xFFFFFFFF
            out[i] = _float32(np.int32(w - ((w >> 31) << 32)))
            if want_flags:
                flags[i] = mid
            nflag += mid
        return nflag


def ex2_fast(x: np.ndarray, out: np.ndarray, coeffs: tuple[float, ...], ftz: bool) -> np.ndarray | None:
    """Fill ``out`` (float32) for every element of float32 ``x`` that needs no recomputation.
    Returns None when no element does (the common case), else a bool mask of those that do."""
    c = np.asarray(coeffs, dtype=np.float64)
    no_flags = np.empty(0, dtype=np.uint8)
    if _kernel(x, out, no_flags, c, bool(ftz), False) == 0:
        return None
    flags = np.zeros(x.shape, dtype=np.uint8)
    _kernel(x, out, flags, c, bool(ftz), True)
    return flags.astype(bool)
