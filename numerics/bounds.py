r"""Proven error bounds.

``ex2_error_bound(degree)`` — an upper bound, proven with interval arithmetic, on

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

import mpmath
from mpmath import iv

__all__ = ["ex2_error_bound", "ex2_bound_details"]

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


@functools.lru_cache(maxsize=None)
def ex2_bound_details(degree: int, rel_tol: float = 1e-3, prec: int = 96) -> dict:
    """The bound of :func:`ex2_error_bound` with how it was obtained.

    Returns a dict: ``bound`` (float, rounded up), ``argmax`` (midpoint of the worst interval of
    the fraction t), ``approx_error`` (enclosure of sup |eps| over the worst interval),
    ``intervals`` (subdivision size), ``rel_tol``, ``prec`` (mpmath bits).
    """
    from fa4.ex2 import POLY_EX2  # the thing bounded: numerics reads fa4's constants, nothing else

    if degree not in POLY_EX2:
        raise ValueError(f"degree must be one of {sorted(POLY_EX2)}, got {degree!r}")
    old_prec, old_iv_prec = mpmath.mp.prec, iv.prec
    try:
        mpmath.mp.prec = iv.prec = prec
        model = _Ex2Model(POLY_EX2[degree])
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


def ex2_error_bound(degree: int) -> float:
    """Proven upper bound on |ex2_emulation(x)/2**x - 1| over every float32 x in [-126, 127].

    Degrees 1-5 (``fa4.ex2.POLY_EX2``).  See the module docstring for the derivation.
    """
    return ex2_bound_details(degree)["bound"]
