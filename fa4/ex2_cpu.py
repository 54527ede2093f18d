"""Compiled CPU loops (numba): the fast path of ``fa4.ex2``'s model fused into one pass, and the
forward model's softmax step (``fa4.forward_loop``'s fast loop, steps 3-8 and step 9's
accumulator).

**The exp2 emulation.**  Same algorithm and the same proof obligations as
``fa4.ex2._ex2_torch`` (see that module's docstring); it exists because a chain of ~40 torch
elementwise ops is memory-bound on a CPU.  Per element:

* NaN -> -127, else max(x, -127) (PTX ``max.f32``);
* xc < 2**22: ``fl = floor(xc)`` (``.ftz`` flushes negative subnormals: floor 0, not -1),
  ``bits(r) = 0x4B400000 + fl`` and ``f = xc - fl`` in float32 (numba keeps float32 - float32
  in float32: one IEEE rounding);
* xc >= 2**22 (also +inf): the literal sequence, the round-down add by float32 TwoSum;
* Horner: each fma as an exact float64 product plus one float64 addition; a sum that lands
  exactly on a float32 midpoint (the 29 float64 fraction bits below float32's last are
  1000...0) is the only case where rounding again to float32 can differ from a single
  rounding, and only if the float64 sum was inexact (TwoSum error nonzero): flagged;
* the splice ``(fl << 23) + bits(p)`` modulo 2**32, through LLVM bitcasts.

:func:`ex2_elem` is that per element; :func:`_ex2_vec` the branch-free form LLVM vectorizes,
which flags xc >= 2**22 and every midpoint landing (the TwoSum test stops the vectorizer) for
its caller to redo with :func:`ex2_elem`.

**The softmax step** (:func:`softmax_block`, :func:`o_update`): per row, the operations of
``fa4.forward_steps``' torch functions in their order and precision, each float32 operation an IEEE
one, the float32 fma correctly rounded (:func:`_fma32`), MUFU.EX2's model (correctly rounded
float64 exp2, flushed) by a float64 polynomial with an error bound (:func:`_exp2_hw`), P's
rounding to p_dtype exact (:func:`_round_bf16`, :func:`_round_lp`).  A row with a NaN anywhere,
or a float64 intermediate too close to a float32 rounding boundary to be sure of the rounding,
gets status 2 (3 for the accumulator) and ``fa4.forward_loop`` recomputes it with torch.  Each
primitive was checked against its torch model over all 2**32 float32 inputs
(``docs/performance.md``).

numba compiles without ``fastmath``: no reassociation, no contraction of a*b + c into an fma.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os

import numba
import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

__all__ = ["ex2_fast", "padded", "softmax_block", "o_update"]

_FAST_LIMIT = np.float32(2.0**22)
_FLT_MIN = np.float32(2.0**-126)
_ROUND_INT = np.float32(1.5 * 2.0**23)
_FLT_MIN64 = 2.0**-126
#: 2**f = sum (ln 2)**k / k! f**k, k = 0..14, each coefficient correctly rounded to float64 (mpmath)
_EXP2_TAYLOR = np.array([
    1.0, 0.6931471805599453, 0.24022650695910072, 0.05550410866482158, 0.009618129107628477,
    0.0013333558146428443, 0.0001540353039338161, 1.5252733804059841e-05, 1.321548679014431e-06,
    1.01780860092397e-07, 7.054911620801123e-09, 4.4455382718708116e-10, 2.5678435993488206e-11,
    1.3691488853904128e-12, 6.778726354822545e-14,
])  # fmt: skip
_EXP2_WINDOW = 64  # float64 ulps around a float32 midpoint where _exp2_hw defers to torch
#: below this, float32(2**t) < 2**-126 for any float64 value within 64 ulps (flushed to 0):
#: the rounding boundary 2**-126 - 2**-150 less a margin
_FLUSH_SURE = 2.0**-126 - 2.0**-150 - 2.0**-170


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


@intrinsic
def _float64(typingctx, x):  # pragma: no cover - compiled
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.float64))

    return types.float64(types.int64), codegen


@numba.njit(fastmath=False, cache=True, nogil=True)
def _split_fast(xc, ftz):  # pragma: no cover - compiled
    """Steps 2-3 for xc < 2**22: (bits of r, f)."""
    # RD(xc + 1.5*2**23) == 1.5*2**23 + floor(xc): bits 0x4B400000 + floor(xc)
    fl = np.floor(xc)  # float32 floor (math.floor would round-trip through int64)
    # add.rm.ftz sees -0 for a negative subnormal: floor 0
    fl = max(fl, np.float32(0.0)) if ftz and xc > -_FLT_MIN else fl
    return np.int64(0x4B400000) + np.int64(fl), np.float32(xc - fl)


@numba.njit(fastmath=False, cache=True, nogil=True)
def _split_literal(xc):  # pragma: no cover - compiled
    """Steps 2-3, the literal sequence (xc >= 2**22 or +inf): RD via float32 TwoSum."""
    s32 = xc + _ROUND_INT
    bb = s32 - xc
    e = (xc - (s32 - bb)) + (_ROUND_INT - bb)
    rbits = np.int64(_bits32(s32))
    if e < 0 and not math.isinf(s32):
        rbits -= 1  # s > 0: the float just below
    r = _float32(np.int32(rbits))
    return rbits, np.float32(xc - np.float32(r - _ROUND_INT))


@numba.njit(fastmath=False, cache=True, nogil=True)
def _splice(rbits, acc):  # pragma: no cover - compiled
    """Step 5: ``(rbits << 23) + bits(p)`` modulo 2**32 (NaN p: the canonical NaN's bits)."""
    p = np.float32(acc)
    pbits = np.int64(0x7FFFFFFF) if p != p else np.int64(_bits32(p)) & 0xFFFFFFFF
    w = ((rbits << 23) + pbits) & 0xFFFFFFFF
    return _float32(np.int32(w - ((w >> 31) << 32)))


@numba.njit(fastmath=False, cache=True, nogil=True)
def _horner_splice(rbits, f, c5):  # pragma: no cover - compiled
    """Steps 4-5: Horner and the splice; (float32 result, flag).  ``c5``: the coefficients
    zero-padded to degree 5 (for the f >= 0 of steps 2-3 a zero leading coefficient changes
    nothing: 0*f + 0 = +0 and 0*f + c = c exactly).  The flag marks a step whose float64 sum
    landed inexactly (TwoSum error nonzero) on a float32 midpoint: the caller redoes it."""
    f64 = np.float64(f)
    acc = c5[5]
    mid = np.int32(0)
    for k in range(4, -1, -1):
        prod = acc * f64  # exact
        s = prod + c5[k]  # one float64 rounding
        if (_bits64(s) & 0x1FFFFFFF) == 0x10000000:
            a_ = s - c5[k]
            b_ = s - a_
            mid |= np.int32(((prod - a_) + (c5[k] - b_)) != 0.0)
        acc = np.float64(np.float32(s))
    return _splice(rbits, acc), mid


@numba.njit(fastmath=False, cache=True, nogil=True)
def _horner_splice_vec(rbits, f, c5):  # pragma: no cover - compiled
    """:func:`_horner_splice` with every midpoint landing flagged, exact or not (the TwoSum
    test keeps LLVM from vectorizing the caller's loop; the caller sorts the landings out
    with :func:`ex2_elem`)."""
    f64 = np.float64(f)
    acc = c5[5]
    mid = np.int32(0)
    for k in range(4, -1, -1):
        s = acc * f64 + c5[k]
        mid |= np.int32((_bits64(s) & 0x1FFFFFFF) == 0x10000000)
        acc = np.float64(np.float32(s))
    return _splice(rbits, acc), mid


@numba.njit(fastmath=False, cache=True, nogil=True)
def ex2_elem(xi, c5, ftz):  # pragma: no cover - compiled
    """One element of the emulation, every input: (float32 result, flag)."""
    xc = np.float32(-127.0) if math.isnan(xi) else max(xi, np.float32(-127.0))
    if xc < _FAST_LIMIT:
        rbits, f = _split_fast(xc, ftz)
    else:
        rbits, f = _split_literal(xc)
    return _horner_splice(rbits, f, c5)


@numba.njit(fastmath=False, cache=True, nogil=True)
def _ex2_vec(xi, c5, ftz):  # pragma: no cover - compiled
    """:func:`ex2_elem` without branches (it vectorizes): (result, flag); the flag marks
    xc >= 2**22 (+inf) and every midpoint landing — redo those with :func:`ex2_elem`."""
    xc = np.float32(-127.0) if xi != xi else max(xi, np.float32(-127.0))
    big = xc >= _FAST_LIMIT
    rbits, f = _split_fast(np.float32(0.0) if big else xc, ftz)
    p, mid = _horner_splice_vec(rbits, f, c5)
    return p, mid | np.int32(big)


@numba.njit(parallel=True, fastmath=False, cache=True, nogil=True)
def _kernel(x, out, flags, coeffs, ftz, want_flags):  # pragma: no cover - compiled
    n = x.shape[0]
    nflag = 0
    for i in numba.prange(n):
        out[i], mid = ex2_elem(x[i], coeffs, ftz)
        if want_flags:
            flags[i] = mid
        nflag += mid
    return nflag


# ---- the forward model's softmax step (fa4.model steps 3-8 and 9's accumulator update) ----


@numba.njit(fastmath=False, cache=True, nogil=True)
def _fma32(a, b, c):  # pragma: no cover - compiled
    """fma.rn.f32 of float32 a, b, c, correctly rounded: the exact product in float64, one
    float64 addition, the sum rounded to odd at 53 bits where the addition was inexact (its
    TwoSum error), then to float32 — ``numerics.fp.fma_f32``'s proven path, taken for every
    element (it equals the plain rounding wherever that one is right).  NaN: any payload
    (the caller falls back)."""
    p = np.float64(a) * np.float64(b)
    cd = np.float64(c)
    s = p + cd
    a_ = s - cd
    b_ = s - a_
    e = (p - a_) + (cd - b_)
    bits = _bits64(s)
    odd = (e != 0.0) & ((bits & 1) == 0) & (abs(s) < np.inf)
    step = np.int64(1) if (e > 0.0) == (s > 0.0) else np.int64(-1)
    return np.float32(_float64(bits + (step if odd else np.int64(0))))


@numba.njit(fastmath=False, cache=True, nogil=True)
def _exp2_hw(t):  # pragma: no cover - compiled
    """``fa4.primitives.hardware_exp2`` of one float32: (result, flag).  2**t in float64 by
    t = n + f (|f| <= 1/2, exact), Taylor's degree-14 polynomial of 2**f (truncation below
    2**-62 relative) by Horner, times 2**n (exact): Horner's rounding error is at most
    gamma_28 * p(|f|) <= 28 * 2**0.5 * 2**-53, the coefficients' own rounding 2**0.5 * 2**-53:
    under 42 float64 ulps of the result.  torch's float64 exp2 (Sleef u10, or libm) is within
    1 ulp of 2**t, so the two round to the same float32 unless a float32 rounding boundary
    lies within 43 ulps: the flag marks results within 64 ulps of a midpoint, in the sliver
    just below the flush limit where rounding up to 2**-126 is possible, and NaN.  (Checked
    exhaustively over all 2**32 float32 t against ``hardware_exp2``: no unflagged difference;
    this polynomial within 1 ulp of torch's exp2 wherever finite.)"""
    td = np.float64(t)
    tc = min(max(td, -160.0), 130.0)
    n = np.floor(tc + 0.5)
    f = tc - n
    y = _EXP2_TAYLOR[14]
    for k in range(13, -1, -1):
        y = y * f + _EXP2_TAYLOR[k]
    y = y * _float64((np.int64(n) + 1023) << 52)
    d = (_bits64(y) & 0x1FFFFFFF) - 0x10000000  # int flags: a bool reduction would not vectorize
    flag = np.int32((d <= _EXP2_WINDOW) & (d >= -_EXP2_WINDOW)) | np.int32(td != td)
    flag |= np.int32((y >= _FLUSH_SURE) & (y < _FLT_MIN64))
    r = np.float32(y)
    return (np.float32(0.0) if y < _FLT_MIN64 else r), flag


@numba.njit(fastmath=False, cache=True, nogil=True)
def _round_bf16(x):  # pragma: no cover - compiled
    """``round_to(x, bfloat16)`` as float64, for one float32: (value, NaN flag) — round to
    nearest even on the bits, as c10 does (overflow carries into inf)."""
    u = np.int64(_bits32(x)) & 0xFFFFFFFF
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return np.float64(_float32(np.int32(u - ((u >> 31) << 32)))), np.int32(x != x)


@numba.njit(fastmath=False, cache=True, nogil=True)
def _round_lp(x, lp, maxv):  # pragma: no cover - compiled
    """``numerics.fp.round_to(x, p_dtype, saturate=...)`` as float64, for one float32:
    (value, flag).  lp = (kind, precision, emin, saturate, has_inf): the significand is
    rounded to ``precision`` bits at the element's exponent (at least emin: subnormals) by
    rint, beyond ``maxv`` it overflows to inf; saturate clamps to +-maxv first.  NaN, or an
    overflow of a format without inf: flagged."""
    xd = np.float64(x)
    xd = min(max(xd, -maxv), maxv) if lp[3] else xd
    e = max(((_bits64(abs(xd)) >> 52) & 0x7FF) - 1023, lp[2])
    q = e - lp[1] + 1
    r = np.rint(xd * _float64((1023 - q) << 52)) * _float64((1023 + q) << 52)
    ovf = abs(r) > maxv
    r = (np.inf if xd > 0 else -np.inf) if ovf else r
    return r, np.int32(x != x) | np.int32(ovf & (lp[4] == 0))


@numba.njit(fastmath=False, cache=True, nogil=True)
def _load_scores(s, i, a, b, buf):  # pragma: no cover - compiled
    """Steps 1-3 for row i: the float32 scores into buf, -inf outside its visible columns
    [a, b) and beyond the block's keys; returns their NaN-quiet max (step 4's block max)."""
    nc = s.shape[1]
    ninf = np.float32(-np.inf)
    m = ninf
    for j in range(nc):
        x = np.float32(s[i, j])
        x = x if (j >= a) & (j < b) else ninf
        buf[j] = x
        m = x if x > m else m
    for j in range(nc, buf.shape[0]):
        buf[j] = ninf
    return m


@numba.njit(fastmath=False, cache=True, nogil=True)
def _row_max(bm, mo, first, sl2, neg_thr, lazy):  # pragma: no cover - compiled
    """Step 4: (new max, the max subtracted, accumulator scale, flag), with SM100's lazy
    rescaling (a kept max scales by 1)."""
    new = bm if first else (mo if mo > bm else bm)
    safe = np.float32(0.0) if new == -np.inf else new
    sa = np.float32(mo - safe) * sl2
    if first:
        return new, safe, np.float32(0.0), np.int32(0)
    if lazy and sa >= neg_thr:
        return mo, mo, np.float32(1.0), np.int32(0)
    acc, flag = _exp2_hw(sa)
    return new, safe, acc, flag


@numba.njit(fastmath=False, cache=True, nogil=True)
def _exp2_row(buf, tbuf, ebuf, mbuf, sl2, bias, poly, hw_all, hw_any):  # pragma: no cover - compiled
    """Steps 5-6: t = fma(s, scale_log2, bias) into tbuf, P into buf: the hardware exp2 on
    every column (hw_any), then the polynomial on the columns listed in poly = (columns,
    coefficients) unless hw_all.  Returns a nonzero flag where a result is too close to call
    (the caller falls back)."""
    idx, c5 = poly
    flag = np.int32(0)
    for j in range(buf.shape[0]):
        tbuf[j] = _fma32(buf[j], sl2, bias)
    if hw_any:
        for j in range(buf.shape[0]):
            p, hz = _exp2_hw(tbuf[j])
            buf[j] = p
            flag |= hz
    if not hw_all:
        for k in range(idx.shape[0]):  # gather the emulated columns
            ebuf[k] = tbuf[idx[k]]
        redo = np.int32(0)
        for k in range(idx.shape[0]):  # vectorized
            p, mid = _ex2_vec(ebuf[k], c5, False)
            mbuf[k] = mid
            redo |= mid
            ebuf[k] = p
        if redo:  # rare: the exact test
            for k in range(idx.shape[0]):
                if mbuf[k]:
                    ebuf[k], mid = ex2_elem(tbuf[idx[k]], c5, False)
                    flag |= mid
        for k in range(idx.shape[0]):
            buf[idx[k]] = ebuf[k]
    return flag


@numba.njit(fastmath=False, cache=True, nogil=True)
def _sum_sm100(buf, first, init):  # pragma: no cover - compiled
    """Step 7, SM100 (``utils.fadd_reduce``): eight lanes over the groups of 8 columns,
    ``init`` added to lane 0 first, then ((0+2), (1+3)) + ((4+6), (5+7)) and the pair."""
    l0, l1, l2, l3, l4, l5, l6, l7 = buf[0], buf[1], buf[2], buf[3], buf[4], buf[5], buf[6], buf[7]
    if not first:
        l0 = init + l0
    for g in range(8, buf.shape[0], 8):
        l0, l1, l2, l3 = l0 + buf[g], l1 + buf[g + 1], l2 + buf[g + 2], l3 + buf[g + 3]
        l4, l5, l6, l7 = l4 + buf[g + 4], l5 + buf[g + 5], l6 + buf[g + 6], l7 + buf[g + 7]
    a0, a1, c0, c1 = l0 + l2, l1 + l3, l4 + l6, l5 + l7
    a0, a1 = a0 + c0, a1 + c1
    return a0 + a1


@numba.njit(fastmath=False, cache=True, nogil=True)
def _sum_sm90(buf, first, part, acc, out4):  # pragma: no cover - compiled
    """Step 7, SM90: thread q's sequential chain over columns 8j+2q, 8j+2q+1, started by
    0 + p (first block) or fma(partial, scale, p).  Returns whether a partial is NaN."""
    nan = False
    for q in range(4):
        c = 2 * q
        a = np.float32(0.0) + buf[c] if first else _fma32(part[q], acc, buf[c])
        a = a + buf[c + 1]
        for g in range(8, buf.shape[0], 8):
            a = a + buf[g + c]
            a = a + buf[g + c + 1]
        out4[q] = a
        nan |= a != a
    return nan


@numba.njit(fastmath=False, cache=True, nogil=True)
def _round_row(buf, p_out, i, nc, lp, maxv):  # pragma: no cover - compiled
    """Step 8 on the block's real columns: P rounded to p_dtype, as float64 (the MMA's A)."""
    flag = np.int32(0)
    if lp[0] == 0:  # bfloat16 (kind 0)
        for j in range(nc):
            p_out[i, j], f = _round_bf16(buf[j])
            flag |= f
    else:
        for j in range(nc):
            p_out[i, j], f = _round_lp(buf[j], lp, maxv)
            flag |= f
    return flag


@numba.njit(fastmath=False, cache=True, nogil=True)
def _softmax_row(s, i, geo, tab, poly, fp, lp, maxv, state, p_out, bufs):  # pragma: no cover - compiled
    """Steps 1-8 of window row i; returns its status (0 inactive, 1 done, 2 fall back) and,
    for status 1, (new max, row sum, accumulator scale, first); SM90's partials are written
    here, the rest by the caller."""
    lo, hi, nmin, nmax, mhi, mlo = tab
    row_max, row_sum, started, part = state
    buf, tbuf, ebuf, mbuf, p4 = bufs
    rows, r0, hq, n = geo[0], geo[1], geo[2], geo[3]
    bh = i // rows
    row = r0 + i - bh * rows
    h = bh % hq
    z = np.float32(0.0)
    if not (nmin[h, row] <= n and n < nmax[h, row]):
        return 0, z, z, z, False
    first = not started[bh, row]
    bm = _load_scores(s, i, lo[row] - geo[10], hi[row] - geo[10], buf)  # steps 1-3
    mo = row_max[bh, row]
    new, safe, acc, flag = _row_max(bm, mo, first, fp[0], fp[2], geo[6] != 0)  # step 4
    bias = _fma32(-safe, fp[0], fp[1])  # step 5
    flag |= np.int32(bias != bias)
    hw_row = geo[4] != 0 and (n >= mhi[h, row] or n < mlo[h, row] or geo[5] != 0)
    flag |= _exp2_row(buf, tbuf, ebuf, mbuf, fp[0], bias, poly, hw_row or geo[8] != 0, hw_row or geo[9] != 0)
    if geo[7] == 0:  # step 7
        tot = _sum_sm100(buf, first, np.float32(row_sum[bh, row] * acc))
        flag |= np.int32(tot != tot)
    else:
        tot = z
        flag |= np.int32(_sum_sm90(buf, first, part[bh, row], acc, p4))
    flag |= _round_row(buf, p_out, i, s.shape[1], lp, maxv)  # step 8
    if flag:
        return 2, z, z, z, first
    if geo[7] != 0:
        part[bh, row, :] = p4
    return 1, new, tot, acc, first


@numba.njit(fastmath=False, cache=True, nogil=True)
def _softmax_kernel(lo, hi, s, geo, tab, poly, fp, lp, maxv, state, out):  # pragma: no cover - compiled
    """Rows [lo, hi) of :func:`softmax_block`."""
    p_out, acc_out, first_out, status = out
    row_max, row_sum, started, _ = state
    tn = p_out.shape[1]
    rows, r0 = geo[0], geo[1]
    bufs = (
        np.empty(tn, np.float32),
        np.empty(tn, np.float32),
        np.empty(tn, np.float32),
        np.empty(tn, np.int32),
        np.empty(4, np.float32),
    )
    for i in range(lo, hi):
        stt, new, tot, acc, first = _softmax_row(s, i, geo, tab, poly, fp, lp, maxv, state, p_out, bufs)
        status[i] = stt
        if stt != 1:
            p_out[i, :] = 0.0
            continue
        bh = i // rows
        row = r0 + i - bh * rows
        row_max[bh, row] = new
        if geo[7] == 0:
            row_sum[bh, row] = tot
        started[bh, row] = True
        acc_out[i] = acc
        first_out[i] = first


@numba.njit(fastmath=False, cache=True, nogil=True)
def _o_row(pv, acc_o, i, bh, row, a, first, obuf):  # pragma: no cover - compiled
    """One row of :func:`_o_kernel` into obuf; returns nonzero if a result is NaN."""
    bad = np.int32(0)
    if first:
        for d in range(obuf.shape[0]):
            obuf[d] = np.float32(pv[i, d])
            bad |= np.int32(obuf[d] != obuf[d])
    else:
        for d in range(obuf.shape[0]):
            obuf[d] = np.float32(np.float64(acc_o[bh, row, d] * a) + pv[i, d])
            bad |= np.int32(obuf[d] != obuf[d])
    return bad


@numba.njit(fastmath=False, cache=True, nogil=True)
def _o_kernel(lo, hi, pv, acc_o, geo, acc_scale, first, status):  # pragma: no cover - compiled
    """Rows [lo, hi) of :func:`o_update`."""
    rows, r0 = geo[0], geo[1]
    obuf = np.empty(pv.shape[1], np.float32)
    for i in range(lo, hi):
        if status[i] != 1:
            continue
        bh = i // rows
        row = r0 + i - bh * rows
        if _o_row(pv, acc_o, i, bh, row, acc_scale[i], first[i], obuf):
            status[i] = 3
        else:
            acc_o[bh, row, :] = obuf


# ---- running the softmax step's loops on torch's OpenMP team ----


@intrinsic
def _call_i32(typingctx, addr):  # pragma: no cover - compiled
    """Call the C function ``int f(void)`` at address ``addr`` (omp_get_thread_num & co.)."""

    def codegen(context, builder, signature, args):
        fnty = ir.FunctionType(ir.IntType(32), [])
        return builder.call(builder.inttoptr(args[0], fnty.as_pointer()), [])

    return types.int32(types.int64), codegen


@intrinsic
def _voidptr(typingctx, addr):  # pragma: no cover - compiled
    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], ir.IntType(8).as_pointer())

    return types.voidptr(types.int64), codegen


@numba.njit(cache=True, nogil=True)
def _arg1(a, k, dtype):  # pragma: no cover - compiled
    """Array k of an argument block (``_Team.run``), 1-d C-contiguous."""
    return numba.carray(_voidptr(a[3 + 4 * k]), (a[4 + 4 * k],), dtype=dtype)


@numba.njit(cache=True, nogil=True)
def _arg2(a, k, dtype):  # pragma: no cover - compiled
    return numba.carray(_voidptr(a[3 + 4 * k]), (a[4 + 4 * k], a[5 + 4 * k]), dtype=dtype)


@numba.njit(cache=True, nogil=True)
def _arg3(a, k, dtype):  # pragma: no cover - compiled
    return numba.carray(_voidptr(a[3 + 4 * k]), (a[4 + 4 * k], a[5 + 4 * k], a[6 + 4 * k]), dtype=dtype)


@numba.njit(cache=True, nogil=True)
def _my_rows(a):  # pragma: no cover - compiled
    """This thread's share [lo, hi) of the a[2] rows."""
    tid, nth = np.int64(_call_i32(a[0])), np.int64(_call_i32(a[1]))
    return a[2] * tid // nth, a[2] * (tid + 1) // nth


@numba.njit(cache=True, nogil=True)
def _softmax_team(a, s):  # pragma: no cover - compiled
    i64, f32, f64, b1 = np.int64, np.float32, np.float64, np.bool_
    tab = (_arg1(a, 2, i64), _arg1(a, 3, i64), _arg2(a, 4, i64), _arg2(a, 5, i64), _arg2(a, 6, i64), _arg2(a, 7, i64))
    poly = (_arg1(a, 8, i64), _arg1(a, 9, f64))
    state = (_arg2(a, 12, f32), _arg2(a, 13, f32), _arg2(a, 14, b1), _arg3(a, 15, f32))
    out = (_arg2(a, 16, f64), _arg1(a, 17, f32), _arg1(a, 18, b1), _arg1(a, 19, np.uint8))
    lo, hi = _my_rows(a)
    maxv = _float64(a[3 + 4 * 20])
    _softmax_kernel(lo, hi, s, _arg1(a, 1, i64), tab, poly, _arg1(a, 10, f32), _arg1(a, 11, i64), maxv, state, out)


def _softmax_team64(data):  # pragma: no cover - compiled
    a = numba.carray(data, 3 + 4 * 20 + 1, dtype=np.int64)  # 20 arrays, maxv
    _softmax_team(a, _arg2(a, 0, np.float64))


def _softmax_team32(data):  # pragma: no cover - compiled
    a = numba.carray(data, 3 + 4 * 20 + 1, dtype=np.int64)  # 20 arrays, maxv
    _softmax_team(a, _arg2(a, 0, np.float32))


def _o_team(data):  # pragma: no cover - compiled
    a = numba.carray(data, 3 + 4 * 6, dtype=np.int64)
    lo, hi = _my_rows(a)
    _o_kernel(
        lo,
        hi,
        _arg2(a, 0, np.float64),
        _arg3(a, 1, np.float32),
        _arg1(a, 2, np.int64),
        _arg1(a, 3, np.float32),
        _arg1(a, 4, np.bool_),
        _arg1(a, 5, np.uint8),
    )


def padded(coeffs) -> np.ndarray:
    """The polynomial's coefficients as float64, zero-padded to degree 5 (``_horner_splice``)."""
    c = np.zeros(6, dtype=np.float64)
    c[: len(coeffs)] = coeffs
    return c


def ex2_fast(x: np.ndarray, out: np.ndarray, coeffs: tuple[float, ...], ftz: bool) -> np.ndarray | None:
    """Fill ``out`` (float32) for every element of float32 ``x`` that needs no recomputation.
    Returns None when no element does (the common case), else a bool mask of those that do."""
    c = padded(coeffs)
    no_flags = np.empty(0, dtype=np.uint8)
    if _kernel(x, out, no_flags, c, bool(ftz), False) == 0:
        return None
    flags = np.zeros(x.shape, dtype=np.uint8)
    _kernel(x, out, flags, c, bool(ftz), True)
    return flags.astype(bool)


class _Team:
    """The OpenMP runtime torch loaded (its libgomp), to run a compiled loop on torch's own
    thread team: right after a torch GEMM that team's threads spin for some milliseconds
    (libgomp's default wait policy), so any other thread found the cores taken — measured, a
    2-thread pool ran no faster than 1 thread within ~10 ms of a GEMM, while a parallel region
    of torch's team ran twice as fast."""

    def __init__(self, path: str):
        lib = ctypes.CDLL(path)
        self.parallel = lib.GOMP_parallel
        self.parallel.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
        self.parallel.restype = None
        self.tid = ctypes.cast(lib.omp_get_thread_num, ctypes.c_void_p).value
        self.nth = ctypes.cast(lib.omp_get_num_threads, ctypes.c_void_p).value
        sig = types.void(types.voidptr)
        self.bodies = {
            "softmax64": numba.cfunc(sig, cache=True)(_softmax_team64),
            "softmax32": numba.cfunc(sig, cache=True)(_softmax_team32),
            "o": numba.cfunc(sig, cache=True)(_o_team),
        }

    def run(self, body: str, nrow: int, arrays: tuple, scalars: tuple = ()) -> None:
        """bodies[body] on every thread of the team, rows split evenly: the argument block is
        (omp_get_thread_num, omp_get_num_threads, rows, then address and shape of each array,
        then each float64 scalar's bits)."""
        slots = [self.tid, self.nth, nrow]
        for x in arrays:
            slots += [x.ctypes.data, *x.shape, *[0] * (3 - x.ndim)]
        slots += [int(np.float64(v).view(np.int64)) for v in scalars]
        argv = np.array(slots, dtype=np.int64)
        self.parallel(self.bodies[body].address, argv.ctypes.data, 0, 0)


_TEAM: list = []


def _team() -> _Team | None:
    """The team runner when torch's OpenMP library is a libgomp found in torch's own lib folder
    (a Linux pip wheel), else None: the loops then run in the calling thread."""
    if not _TEAM:
        path = None
        with contextlib.suppress(OSError):
            with open("/proc/self/maps") as maps:
                paths = {line.split()[-1] for line in maps if "libgomp" in line}
            path = next((x for x in sorted(paths) if f"{os.sep}torch{os.sep}lib{os.sep}" in x), None)
        _TEAM.append(_Team(path) if path else None)
    return _TEAM[0]


_I, _F, _D, _B = (np.dtype(x) for x in (np.int64, np.float32, np.float64, np.bool_))
#: the (dtype, ndim) of each array a team body reads from its argument block, in order
_LAYOUT = {
    "softmax": [(_I, 1)] * 3 + [(_I, 2)] * 4 + [(_I, 1), (_D, 1), (_F, 1), (_I, 1)]
    + [(_F, 2), (_F, 2), (_B, 2), (_F, 3), (_D, 2), (_F, 1), (_B, 1), (np.dtype(np.uint8), 1)],
    "o": [(_D, 2), (_F, 3), (_I, 1), (_F, 1), (_B, 1), (np.dtype(np.uint8), 1)],
}  # fmt: skip


def _run(kernel, body: str, nrow: int, args: tuple, arrays: tuple, scalars: tuple = ()) -> None:
    """kernel(0, nrow, *args) — on torch's OpenMP team when there is one, the work is worth it
    and ``arrays`` (the same arguments flattened) are C-contiguous with the dtypes and ranks
    the team body reads them as (``_LAYOUT``; the first softmax array, S, is checked by the
    body's name); else here."""
    team = _team() if nrow >= 512 else None
    layout = _LAYOUT["o" if body == "o" else "softmax"]
    rest = arrays if body == "o" else arrays[1:]
    ok = team is not None and all(x.flags.c_contiguous for x in arrays)
    ok = ok and [(x.dtype, x.ndim) for x in rest] == layout
    if ok:
        team.run(body, nrow, arrays, scalars)
    else:
        kernel(0, nrow, *args)


def softmax_block(s, geo, tab, poly, fp, lp, maxv: float, state, out) -> None:
    """The forward model's steps 1-8 for one KV block on the rows of a window (``fa4.forward_loop``).

    s: (rows, nc) float64 S, or float32 softcapped scores, rows flat over (b, heads_q, window).
    geo: int64 (window rows, first row, heads_q, block, masked_exp2 hardware, partial block,
    lazy rescaling, sm90, no emulated column, some hardware column, first key).
    tab: (lo, hi) the visible keys of each query row (``fa4.primitives.visible_bounds``) and
    n_min, n_max, m_hi, m_lo (heads_q, seqlen_q): the block ranges and masked blocks.
    poly: (emulated columns as int64 indices, the polynomial's coefficients (:func:`padded`)).
    fp: float32 (scale_log2, max_offset, -threshold); lp: (kind 0 for bf16, precision, emin,
    saturate, has inf) of p_dtype and maxv its largest value.
    state: (row_max, row_sum, started, partial) as (b * heads_q, seqlen_q[, 4]), updated in
    place on the rows it completes.  out: (P as float64 (rows, tile_n), accumulator scale,
    first, status), status 0 for inactive rows, 1 done, 2 for the rows the caller must redo
    (a NaN, a rounding too close to call)."""
    arrays = (s, geo, *tab, *poly, fp, lp, *state, *out)
    body = "softmax64" if s.dtype == np.float64 else "softmax32"
    _run(_softmax_kernel, body, s.shape[0], (s, geo, tab, poly, fp, lp, maxv, state, out), arrays, (maxv,))


def o_update(pv, acc_o, geo, acc_scale, first, status) -> None:
    """Step 9's accumulator update in place on the status-1 rows of a window (acc_o: (b * heads_q,
    seqlen_q, dv) float32; pv: (rows, dv) float64); a row whose result has a NaN gets status 3
    and is left to the caller."""
    args = (pv, acc_o, geo, acc_scale, first, status)
    _run(_o_kernel, "o", pv.shape[0], args, args)
