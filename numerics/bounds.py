r"""Proven error bounds: the polynomial exp2 (below) and the range analysis of lazy rescaling
(``rescaling_analysis``, derivation beside it).

``ex2_error_bound(coefficients)`` — an upper bound, proven with interval arithmetic, on

    |ex2_emulation(x) / 2**x - 1|   over every float32 x in [-126, 127],

for FA4's polynomial exp2 (``fa4.ex2``; production ``flash_attn.cute.utils.ex2_emulation``).

Derivation
----------
Notation: ``p(t) = sum c_k t^k`` the polynomial with the float32 coefficients ``POLY_EX2``;
``u = 2**-24`` (float32 unit roundoff); ``fl = floor(x)``; ``f = x - fl`` in [0, 1).

1. *Range reduction.*  For x in [-126, 127], ``r = RD(x + 1.5*2**23) = 1.5*2**23 + fl`` exactly
   (the sum lies in [2**23, 2**24), where float32 spacing is 1, so rounding down is floor), and
   ``r - 1.5*2**23 = fl`` exactly.  The fraction ``f^ = RN(x - fl)`` is exact when x >= 0 (x and
   fl share x's binade grid, and x - fl < 1 has no more bits than x) and when x <= -1 (the
   result is a multiple of ulp(x) >= 2**-23 below 1).  For x in (-1, -1/2] it is exact too
   (multiple of 2**-24 in [0, 1/2)).  Only for x in (-1/2, 0) is it rounded: the result lies in
   [1/2, 1], spacing 2**-24, so |f^ - f| <= 2**-25.  Hence
   ``2**x = 2**fl * 2**f^ * 2**(f - f^)`` with ``|f - f^| <= d``, d = 2**-25 when f^ >= 1/2 and
   d = 0 otherwise.

2. *Polynomial evaluation.*  Horner by fma: ``a_n = c_n``, ``a_k = fl(a_{k+1} t + c_k)`` with
   one rounding, ``a_k = a_{k+1} t + c_k + e_k``.  Unrolling this linear recurrence gives exactly
   ``a_0 = p(t) + sum_{k<n} e_k t^k``.  Round-to-nearest gives
   ``|e_k| <= ulp(v_k)/2 <= 2**(floor(log2 |v_k|) - 24)`` where ``v_k = a_{k+1} t + c_k`` is the
   exact fma result (all quantities are positive here: t >= 0 and every c_k > 0, so no
   cancellation and no subnormals).  For t in an interval T we enclose ``v_k`` by interval
   arithmetic (carrying the previous errors), giving E_k(T) >= |e_k| and
   ``|p^(t) - p(t)| <= H(T) = sum_k E_k(T) * sup(T)**k``.

3. *Exponent splice.*  ``p^(t)`` lies in [1, 2] (p is increasing, p(0) = 1, and fma rounding
   preserves [1, 2]), so adding fl in [-126, 127] to its exponent field is exact:
   ``y = 2**fl * p^(f^)`` (x = 127 has f^ = 0, p^ = 1: no overflow).

4. *Combination.*  ``y / 2**x = (1 + eps(f^) + (p^ - p)(f^) / 2**f^) * 2**(f^ - f)`` with
   ``eps(t) = p(t) 2**-t - 1`` the approximation error.  On each interval T of a subdivision of
   [0, 1] we enclose eps(T) by the mean-value form ``eps(m) + eps'(T) (T - m)``,
   ``eps'(t) = (p'(t) - ln2 p(t)) 2**-t``, evaluated in mpmath interval arithmetic (plain
   interval evaluation of eps over-estimates by orders of magnitude: the two terms cancel to 1e-7),
   and bound ``|y/2**x - 1| <= max(|(1 + eps(T) +- H(T)/2**inf T) * 2**(+-d)| - 1)``.  The
   bound is the maximum over T.  Subdivision is adaptive: the interval with the largest upper
   bound is bisected until that bound is within ``rel_tol`` of the same expression evaluated
   at the interval's midpoint, so the result is within ``rel_tol`` of the best bound this
   error model can give.

What the bound does not cover: x in (-127, -126) (the splice underflows into a wrongly scaled
subnormal, by design), x <= -127 (0), x > 127, NaN and infinities; ``fa4-audit ex2`` reports
those separately.
"""

from __future__ import annotations

import functools
import heapq
import math
from dataclasses import asdict, dataclass

import mpmath
from mpmath import iv

from numerics.fp import format_of

__all__ = ["ex2_error_bound", "ex2_bound_details", "RescalingAnalysis", "rescaling_analysis"]

_U_EXP = -24  # float32: |RN(v) - v| <= 2**(floor(log2|v|) - 24)


def _ulp_half(v_sup: mpmath.mpf) -> mpmath.mpf:
    """2**(floor(log2 v_sup) - 24): bounds |RN(v) - v| for every 0 < v <= v_sup (float32)."""
    _, e = mpmath.frexp(v_sup)  # v_sup = m * 2**e, m in [1/2, 1)
    return mpmath.ldexp(1, int(e) - 1 + _U_EXP)


class _Ex2Model:
    """Interval enclosures of the pieces of the error of one polynomial degree."""

    def __init__(self, coeffs: tuple[float, ...]):
        self.c = [iv.mpf(c) for c in coeffs]  # exact: the coefficients are float32 values
        self.ln2 = iv.log(2)

    def p(self, t):
        acc = self.c[-1]
        for c in reversed(self.c[:-1]):
            acc = acc * t + c
        return acc

    def dp(self, t):
        n = len(self.c) - 1
        acc = self.c[-1] * n
        for k in range(n - 1, 0, -1):
            acc = acc * t + self.c[k] * k
        return acc

    def eps(self, T):
        """Enclosure of eps(t) = p(t) 2**-t - 1 over the interval T (mean-value form)."""
        m = iv.mpf(T.mid)
        eps_m = self.p(m) * iv.exp(-self.ln2 * m) - 1
        deps = (self.dp(T) - self.ln2 * self.p(T)) * iv.exp(-self.ln2 * T)
        return eps_m + deps * (T - m)

    def horner_error(self, T):
        """H(T) >= |p^(t) - p(t)| for t in T: the rounding errors of the fma chain."""
        t_sup = T.b
        acc = self.c[-1]
        total = mpmath.mpf(0)
        n = len(self.c) - 1
        for k in range(n - 1, -1, -1):
            v = acc * T + self.c[k]
            ek = _ulp_half(v.b)
            total += ek * t_sup**k
            acc = v + iv.mpf([-ek, ek])
        return total

    def bound_on(self, T) -> mpmath.mpf:
        """Upper bound of |y/2**x - 1| for every x whose computed fraction f^ lies in T."""
        e = self.eps(T)
        h = self.horner_error(T) * iv.exp(-self.ln2 * iv.mpf(T.a)).b  # / 2**t, t >= inf T
        d = mpmath.ldexp(1, -25) if T.b > 0.5 else 0
        shift = iv.exp(self.ln2 * iv.mpf([-d, d]))  # 2**(f^ - f), |f^ - f| <= d
        lo = (1 + iv.mpf(e.a) - h) * shift
        hi = (1 + iv.mpf(e.b) + h) * shift
        return max(abs(lo.a - 1), abs(hi.b - 1), abs(lo.b - 1), abs(hi.a - 1))

    def point_value(self, t: mpmath.mpf) -> mpmath.mpf:
        """The same bound expression at a single point (a lower reference for the adaptivity)."""
        return self.bound_on(iv.mpf([t, t]))


@functools.cache
def ex2_bound_details(coefficients: tuple[float, ...], rel_tol: float = 1e-3, prec: int = 96) -> dict:
    """The bound of :func:`ex2_error_bound` with how it was obtained.

    Returns a dict: ``bound`` (float, rounded up), ``argmax`` (midpoint of the worst interval of
    the fraction t), ``approx_error`` (enclosure of sup |eps| over the worst interval),
    ``intervals`` (subdivision size), ``rel_tol``, ``prec`` (mpmath bits).
    """
    coefficients = tuple(coefficients)
    if not 2 <= len(coefficients) <= 6 or not all(isinstance(c, float) and math.isfinite(c) for c in coefficients):
        raise ValueError(
            f"coefficients must be 2 to 6 finite floats (degree 1-5, constant term first), got {coefficients!r}"
        )
    old_prec, old_iv_prec = mpmath.mp.prec, iv.prec
    try:
        mpmath.mp.prec = iv.prec = prec
        model = _Ex2Model(coefficients)
        heap: list = []
        n0 = 64
        for i in range(n0):
            T = iv.mpf([mpmath.mpf(i) / n0, mpmath.mpf(i + 1) / n0])
            heapq.heappush(heap, (-model.bound_on(T), i, T))
        counter = n0
        while True:
            neg_ub, _, T = heap[0]
            ub = -neg_ub
            ref = model.point_value(T.mid)
            if ub - ref <= rel_tol * ub or T.delta < mpmath.ldexp(1, -40):
                break
            heapq.heappop(heap)
            m = T.mid
            for half in (iv.mpf([T.a, m]), iv.mpf([m, T.b])):
                counter += 1
                heapq.heappush(heap, (-model.bound_on(half), counter, half))
        # Round the bound up to a float (outward: never below the proven value).
        bound = float(ub)
        if bound < ub:
            bound = float(mpmath.mpf(bound) + mpmath.ldexp(abs(mpmath.mpf(bound)), -52))
        eps = model.eps(T)
        return {
            "bound": bound,
            "argmax": float(T.mid),
            "approx_error": float(max(abs(eps.a), abs(eps.b))),
            "intervals": len(heap),
            "rel_tol": rel_tol,
            "prec": prec,
        }
    finally:
        mpmath.mp.prec, iv.prec = old_prec, old_iv_prec


def ex2_error_bound(coefficients: tuple[float, ...]) -> float:
    """Proven upper bound on |ex2_emulation(x)/2**x - 1| over every float32 x in [-126, 127]
    for the polynomial with these float32 coefficients (production's: ``fa4.ex2.POLY_EX2[degree]``).
    See the module docstring for the derivation."""
    return ex2_bound_details(tuple(coefficients))["bound"]


# ---------------------------------------------------------------------------------------------
# Range analysis of lazy rescaling (SoftmaxSm100.update_row_max + scale_subtract_rowmax)
# ---------------------------------------------------------------------------------------------
#
# Production keeps a *reference* row max m_ref and replaces it by the running max m only when
# (m_ref - m) * scale_log2 < -threshold; otherwise P = exp2((s - m_ref) * scale_log2 + max_offset).
# Every visible score satisfies s <= m, and the reference is kept only while
# (m - m_ref) * scale_log2 <= threshold, so the exponent is at most threshold + max_offset and
#     P <= 2**(threshold + max_offset)                                                    (R1)
# (up to the float32 rounding of the fma and exp2, relative 2**-22, which cannot carry a power of
# two past the next representable value of an 8/16-bit format).  The largest element of the block
# that set m_ref had exponent exactly max_offset, and later elements never push the exponent
# below the reference, so the row sum of the *float32* P (the denominator) is at least
#     D >= 2**max_offset.                                                                 (R2)
# P is cast to the input dtype before P.V: values above the format's largest finite value
# saturate (cvt.rn.satfinite), so (R1) must stay below it — production asserts
# max_offset + threshold < log2(dtype max) (flash_fwd_sm100.py, Note [Low Precision Scaling]).
# Below, P rounds to the format's grid: a P smaller than half the smallest positive value rounds
# to 0 (flush), and any P loses at most half a subnormal step in absolute terms; before that the
# hardware exp2 (ex2.approx.ftz) already flushed float32 results below 2**-126.  So a row of
# seqlen_k keys loses at most
#     seqlen_k * max(min_positive / 2, 2**-126) / 2**max_offset                          (R3)
# of its probability mass to underflow, relative to D (the cast's share is lost by the numerator
# only: the float32 denominator keeps it).
# The float32 row sum and the O accumulator are bounded by seqlen_k * 2**(threshold+max_offset)
# and seqlen_k * 2**(threshold+max_offset) * max|V|: their float32 headroom (log2 of FLT_MAX over
# that) is what `RescalingAnalysis` reports.

_LOG2_FLT_MAX = math.log2(3.4028234663852886e38)


@dataclass(frozen=True)
class RescalingAnalysis:
    """Range analysis of FA4's lazy rescaling for one (dtype, rescale_threshold, max_offset)."""

    dtype: str
    rescale_threshold: float
    max_offset: int
    safe: bool
    p_max: float  # (R1): largest P before the cast
    dtype_max: float
    headroom_log2: float  # log2(dtype_max) - (threshold + max_offset); must be > 0
    p_min_after_cast: float  # smallest positive value of the format (subnormal)
    explanation: str

    def flush_mass_bound(self, seqlen_k: int) -> float:
        """(R3): upper bound on the fraction of a row's probability mass lost to underflow."""
        return min(1.0, seqlen_k * max(self.p_min_after_cast / 2, 2.0**-126) / 2.0**self.max_offset)

    def row_sum_headroom_log2(self, seqlen_k: int) -> float:
        """log2(FLT_MAX) - log2(seqlen_k * P_max): float32 headroom of the denominator."""
        return _LOG2_FLT_MAX - math.log2(seqlen_k * self.p_max)

    def o_accumulator_headroom_log2(self, seqlen_k: int, max_abs_v: float) -> float:
        """log2(FLT_MAX) - log2(seqlen_k * P_max * max|V|): float32 headroom of O."""
        return _LOG2_FLT_MAX - math.log2(seqlen_k * self.p_max * max(max_abs_v, 2.0**-149))

    def as_dict(self, seqlen_k: int = 32768, max_abs_v: float = 1.0) -> dict:
        d = asdict(self)
        d.update(
            seqlen_k=seqlen_k,
            max_abs_v=max_abs_v,
            flush_mass_bound=self.flush_mass_bound(seqlen_k),
            row_sum_headroom_log2=self.row_sum_headroom_log2(seqlen_k),
            o_accumulator_headroom_log2=self.o_accumulator_headroom_log2(seqlen_k, max_abs_v),
        )
        return d


def rescaling_analysis(dtype, rescale_threshold: float, max_offset: int) -> RescalingAnalysis:
    """Range analysis of lazy rescaling for P cast to ``dtype`` (name or torch dtype); see the
    derivation above this function.  ``safe`` is False when P can exceed the dtype's largest
    finite value (it then saturates and the output shrinks while the LSE stays exact, #2716).
    Production's settings: ``fa4.knobs.PRODUCTION_RESCALING``."""
    fmt = format_of(dtype)
    if fmt.name == "float32":
        raise ValueError("P is cast to the input dtype: one of bfloat16, float16, float8_e4m3fn, float8_e5m2")
    if not (isinstance(rescale_threshold, (int, float)) and math.isfinite(rescale_threshold)) or rescale_threshold < 0:
        raise ValueError(f"rescale_threshold must be a finite number >= 0 (log2 units), got {rescale_threshold!r}")
    log2_max = math.log2(fmt.max)
    if not isinstance(max_offset, int) or max_offset < 0 or max_offset >= log2_max:
        raise ValueError(
            f"max_offset must be an integer in [0, {math.floor(log2_max)}] for {fmt.name} "
            f"(log2 of its largest value {fmt.max:g} is {log2_max:.3f}), got {max_offset!r}"
        )
    expo = rescale_threshold + max_offset
    headroom = log2_max - expo
    safe = headroom > 0
    p_min = fmt.smallest_subnormal
    if safe:
        why = (
            f"P <= 2^({rescale_threshold:g}+{max_offset}) = {2.0**expo:g} fits {fmt.name} (max {fmt.max:g}) with "
            f"{headroom:.3f} log2 units to spare; the smallest positive P after the cast is {p_min:.3g}, so a row "
            f"of n keys loses at most n*{max(p_min / 2, 2.0**-126) / 2.0**max_offset:.3g} of its mass to underflow."
        )
    else:
        why = (
            f"UNSAFE: P can reach 2^({rescale_threshold:g}+{max_offset}) = {2.0**expo:g} > {fmt.name} max {fmt.max:g}: "
            f"the largest probabilities saturate at {fmt.max:g} in P.V while the float32 denominator counts them in "
            f"full, so the output shrinks silently and the LSE stays exact (flash-attention #2716); production "
            f"asserts max_offset + threshold < log2(dtype max) = {log2_max:.3f}."
        )
    return RescalingAnalysis(
        fmt.name, float(rescale_threshold), max_offset, safe, 2.0**expo, fmt.max, headroom, p_min, why
    )
