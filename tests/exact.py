"""An independent exact-rational model of the PTX float32 operations, for the tests.

Pure Python on ``fractions.Fraction`` and integer bit patterns: no float arithmetic at all, so it
shares nothing with the vectorized implementations it checks (``numerics.fp``, ``fa4.ex2``).
Slow (microseconds per op) and exact by construction: every operation is computed exactly and
rounded once, by the rule PTX states.
"""

from __future__ import annotations

from fractions import Fraction

NAN = 0x7FFFFFFF  # PTX canonical NaN
FLT_MAX_BITS = 0x7F7FFFFF


def is_nan(b: int) -> bool:
    return (b & 0x7F800000) == 0x7F800000 and (b & 0x7FFFFF) != 0


def is_inf(b: int) -> bool:
    return (b & 0x7FFFFFFF) == 0x7F800000


def sign(b: int) -> int:
    return -1 if b & 0x80000000 else 1


def value(b: int) -> Fraction:
    """Exact value of a finite float32 bit pattern."""
    e, m = (b >> 23) & 0xFF, b & 0x7FFFFF
    v = (
        Fraction(m, 1 << 23) * Fraction(2) ** -126
        if e == 0
        else Fraction((1 << 23) | m, 1 << 23) * Fraction(2) ** (e - 127)
    )
    return -v if b & 0x80000000 else v


def is_subnormal(b: int) -> bool:
    return (b & 0x7F800000) == 0 and (b & 0x7FFFFF) != 0


def ftz(b: int) -> int:
    return b & 0x80000000 if is_subnormal(b) else b


def round_f32(q: Fraction, mode: str = "rn", *, zero_sign: int = 1) -> int:
    """Round an exact rational to a float32 bit pattern (``rn``: nearest-even, ``rm``: toward
    -inf), subnormals and overflow included.  ``zero_sign`` is the sign of an exact zero."""
    if q == 0:
        return 0 if zero_sign > 0 else 0x80000000
    neg = q < 0
    a = -q if neg else q
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:
        e -= 1
    e = max(e, -126)
    quantum = Fraction(2) ** (e - 23)
    n = a / quantum
    m = n.numerator // n.denominator
    rem = n - m
    if mode == "rn":
        if rem > Fraction(1, 2) or (rem == Fraction(1, 2) and m % 2 == 1):
            m += 1
    elif mode == "rm":
        if neg and rem > 0:
            m += 1
    else:
        raise ValueError(mode)
    v = m * quantum
    if v >= Fraction(2) ** 128:
        if mode == "rn" or neg:
            return 0xFF800000 if neg else 0x7F800000
        return FLT_MAX_BITS
    if m == 0:
        return 0x80000000 if neg else 0
    if m < (1 << 23):  # subnormal
        bits = m
    else:
        if m >= (1 << 24):
            m //= 2
            e += 1
        bits = ((e + 127) << 23) | (m - (1 << 23))
    return bits | (0x80000000 if neg else 0)


def add(a: int, b: int, mode: str = "rn", *, flush: bool = False) -> int:
    """PTX add.{mode}[.ftz].f32."""
    if flush:
        a, b = ftz(a), ftz(b)
    if is_nan(a) or is_nan(b):
        return NAN
    if is_inf(a) or is_inf(b):
        if is_inf(a) and is_inf(b) and sign(a) != sign(b):
            return NAN
        return a if is_inf(a) else b
    s = value(a) + value(b)
    if s == 0:
        both_neg = sign(a) < 0 and sign(b) < 0
        zs = -1 if (mode == "rm" and not (a == 0 and b == 0)) or both_neg else 1
        r = round_f32(s, mode, zero_sign=zs)
    else:
        r = round_f32(s, mode)
    return ftz(r) if flush else r


def sub(a: int, b: int) -> int:
    return add(a, b ^ 0x80000000)


def fma(a: int, b: int, c: int) -> int:
    """PTX fma.rn.f32 (no ftz), one rounding."""
    if is_nan(a) or is_nan(b) or is_nan(c):
        return NAN
    if is_inf(a) or is_inf(b) or is_inf(c):
        raise NotImplementedError("infinite fma operands do not occur in the exp2 emulation")
    s = value(a) * value(b) + value(c)
    return round_f32(s, "rn")


def fmax(a: int, b: int) -> int:
    """PTX max.f32: the non-NaN operand if one is NaN."""
    if is_nan(a):
        return b
    if is_nan(b):
        return a
    if is_inf(a):
        return a if sign(a) > 0 else b
    return a if value(a) >= value(b) else b


def bits_of(v: float) -> int:
    import struct

    return struct.unpack("<I", struct.pack("<f", v))[0]


def ex2_emulation(x_bits: int, coeffs: tuple[float, ...], *, ftz_round: bool) -> int:
    """``flash_attn.cute.utils.ex2_emulation`` (``ftz_round=True``: add.rm.ftz) or
    ``ex2_emulation_2`` (``ftz_round=False``: add.rm.f32x2), step by step, exactly."""
    C = bits_of(1.5 * 2.0**23)
    xc = fmax(x_bits, bits_of(-127.0))
    r = add(xc, C, "rm", flush=ftz_round)
    back = sub(r, C)
    f = sub(xc, back)
    cb = [bits_of(c) for c in coeffs]
    acc = cb[-1]
    for c in reversed(cb[:-1]):
        acc = fma(acc, f, c)
    return ((r << 23) + acc) & 0xFFFFFFFF
