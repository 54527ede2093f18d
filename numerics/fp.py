"""Float utilities, written once and used everywhere.

Everything here works on torch tensors (CPU or CUDA), elementwise and vectorized, and models
IEEE-754 binary32 operations the way NVIDIA PTX defines them where PTX and IEEE differ:

* **Canonical NaN.**  PTX f32 arithmetic returns the canonical NaN ``0x7FFFFFFF`` whenever the
  result is NaN (PTX ISA, "Floating Point Instructions": NaN payloads are not propagated).  x86
  returns ``0xFFC00000`` for an invalid operation, so every emulated op canonicalizes.
* **Flush to zero** (``.ftz``): subnormal inputs and results become a zero of the same sign.
* **Directed rounding** (``.rm``) is emulated from round-to-nearest plus the exact error term of
  Knuth's TwoSum; a correctly rounded ``fma`` is emulated in float64 with round-to-odd
  (Boldo & Melquiond, "Emulation of FMA and correctly rounded sums: proved algorithms using
  rounding to odd", IEEE TC 2008): rounding the exact value to odd at 53 bits and then to
  nearest at 24 bits equals rounding to nearest at 24 bits directly, because 53 >= 24 + 2.

ULP convention (used by :func:`ulp_error`): the error of an approximation ``y`` of an exact
value ``e`` is ``|y - e| / ulp(e)`` where ``ulp(e) = 2**(max(floor(log2|e|), emin) - p + 1)`` is
the spacing of the target format in the binade *containing the exact value* (at an exact power
of two, the spacing above it), ``p`` the format's precision and ``emin`` its smallest normal
exponent. This is the "ulp of the exact result" convention of glibc's and LLVM libc's
accuracy tests; it is a real number, not an integer count.  :func:`ulp_distance` is the other,
integer convention: the number of float32 values strictly between two floats plus one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "CANONICAL_NAN_BITS",
    "FloatFormat",
    "FORMATS",
    "format_of",
    "to_f32",
    "f32_bits",
    "f32_from_bits",
    "bit_view",
    "ordered_bits",
    "step_distance",
    "canonicalize_nan",
    "flush_to_zero",
    "add_rm",
    "fma_f32",
    "on_f32_midpoint",
    "round_to",
    "ulp_error",
    "ulp_distance",
]

#: The NaN every PTX f32 arithmetic instruction returns (sign 0, all exponent and fraction bits 1).
CANONICAL_NAN_BITS = 0x7FFFFFFF
_FLT_MIN_NORMAL = 2.0**-126


@dataclass(frozen=True)
class FloatFormat:
    """A binary floating-point format: precision ``p`` (significand bits, implicit bit
    included), smallest normal exponent ``emin``, largest finite value ``max``."""

    name: str
    dtype: torch.dtype
    p: int
    emin: int
    max: float

    @property
    def unit_roundoff(self) -> float:
        """u = 2**-p: the relative error bound of round-to-nearest for normal results."""
        return 2.0**-self.p

    @property
    def smallest_subnormal(self) -> float:
        return 2.0 ** (self.emin - self.p + 1)


FORMATS: dict[str, FloatFormat] = {
    f.name: f
    for f in (
        FloatFormat("float32", torch.float32, 24, -126, float(torch.finfo(torch.float32).max)),
        FloatFormat("bfloat16", torch.bfloat16, 8, -126, float(torch.finfo(torch.bfloat16).max)),
        FloatFormat("float16", torch.float16, 11, -14, 65504.0),
        FloatFormat("float8_e4m3fn", torch.float8_e4m3fn, 4, -6, 448.0),
        FloatFormat("float8_e5m2", torch.float8_e5m2, 3, -14, 57344.0),
    )
}
_BY_DTYPE = {f.dtype: f for f in FORMATS.values()}


def format_of(dtype: torch.dtype | str) -> FloatFormat:
    """The :class:`FloatFormat` of a torch dtype or its name (``"bfloat16"``, ``"float8_e4m3fn"``...)."""
    if isinstance(dtype, str):
        key = dtype.removeprefix("torch.")
        if key in FORMATS:
            return FORMATS[key]
    elif dtype in _BY_DTYPE:
        return _BY_DTYPE[dtype]
    raise ValueError(f"unsupported float format {dtype!r}; accepted: {', '.join(FORMATS)}")


def _check_f32(x: torch.Tensor, name: str) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"{name} must be a float32 torch.Tensor, got {got}; convert with .float()")


def to_f32(x: float) -> float:
    """A Python float rounded to the nearest float32 (the value a kernel's Float32 constant holds)."""
    return float(torch.tensor(x, dtype=torch.float32))


def f32_bits(x: torch.Tensor) -> torch.Tensor:
    """The IEEE bit patterns of a float32 tensor, as int32 (a view: no copy)."""
    _check_f32(x, "x")
    return x.view(torch.int32)


def f32_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """float32 values from bit patterns held in an int32 or uint32 tensor (a view for int32)."""
    if bits.dtype == torch.uint32:
        bits = bits.view(torch.int32)
    if bits.dtype != torch.int32:
        raise TypeError(f"bits must be int32 or uint32, got {bits.dtype}")
    return bits.view(torch.float32)


def canonicalize_nan(x: torch.Tensor) -> torch.Tensor:
    """Replace every NaN by the PTX canonical NaN ``0x7FFFFFFF``."""
    _check_f32(x, "x")
    nan = f32_from_bits(torch.tensor([CANONICAL_NAN_BITS], dtype=torch.int32, device=x.device))
    return torch.where(torch.isnan(x), nan, x)


def flush_to_zero(x: torch.Tensor) -> torch.Tensor:
    """PTX ``.ftz`` on float32: subnormals become a zero of the same sign; all else unchanged."""
    _check_f32(x, "x")
    sub = (x.abs() < _FLT_MIN_NORMAL) & (x != 0)
    return torch.where(sub, torch.zeros_like(x).copysign(x), x)


def _two_sum(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Knuth's TwoSum: s = fl(a + b) and the exact error e with a + b = s + e (when s is finite).

    Exact in any binary format with round-to-nearest and no overflow, subnormals included
    (Knuth, TAOCP vol. 2, 4.2.2, Theorem B)."""
    s = a + b
    a_ = s - b
    b_ = s - a_
    e = (a - a_) + (b - b_)
    return s, e


def add_rm(a: torch.Tensor, b: torch.Tensor, *, ftz: bool = False) -> torch.Tensor:
    """PTX ``add.rm[.ftz].f32``: a + b rounded toward -infinity.

    Round to nearest first; if the exact sum lies below the nearest float (TwoSum error < 0),
    the result is the float just below it.  IEEE 754 (6.3) makes an exact zero sum of operands
    of opposite sign -0 under roundTowardNegative; overflow rounds to the largest finite value on
    the positive side and to -inf on the negative side.
    """
    _check_f32(a, "a")
    _check_f32(b, "b")
    if ftz:
        a, b = flush_to_zero(a), flush_to_zero(b)
    s, e = _two_sum(a, b)
    finite = torch.isfinite(s)
    e = torch.where(finite, e, torch.zeros_like(e))
    out = torch.where(e < 0, torch.nextafter(s, torch.full_like(s, -math.inf)), s)
    # Exact zero: -0 unless both operands are +0.
    both_pos_zero = (f32_bits(a) == 0) & (f32_bits(b) == 0)
    out = torch.where((out == 0) & ~both_pos_zero, torch.full_like(out, -0.0), out)
    # Overflow toward +inf from finite operands rounds down to FLT_MAX.
    ovf = (s == math.inf) & torch.isfinite(a) & torch.isfinite(b)
    out = torch.where(ovf, torch.full_like(out, torch.finfo(torch.float32).max), out)
    if ftz:
        out = flush_to_zero(out)
    return canonicalize_nan(out)


def fma_f32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, *, ftz: bool = False) -> torch.Tensor:
    """PTX ``fma.rn[.ftz].f32``: a*b + c with a single rounding to nearest-even.

    a, b, c: float32 tensors of broadcastable shapes; the result has the broadcast shape.

    The product of two float32 is exact in float64 (24 + 24 <= 53 significand bits, exponents in
    range), so s = fl64(a*b + c) is one float64 rounding of the exact value.  Rounding s again
    to float32 can only differ from rounding the exact value when s lies exactly on a float32
    rounding boundary: every boundary m (a midpoint between neighbouring float32 values) is a
    float64 number, rounding is monotone, so exact < m implies s <= m, and s != m then gives
    s < m — s and the exact value are on the same side of every boundary and round alike.  In
    float32's normal binades the boundaries are the float64 values whose 29 fraction bits below
    float32's last are 1000...0 (:func:`on_f32_midpoint`); near float32's subnormal
    range (|result| <= 2**-126, zeros included) the grid is coarser.  Those elements — rare —
    take the proven path: s replaced by the exact value rounded *to odd* (s when exact or odd,
    else its neighbour toward the exact value, known from the TwoSum error), whose rounding to
    float32 is the correctly rounded result (module doc).
    """
    for t, n in ((a, "a"), (b, "b"), (c, "c")):
        _check_f32(t, n)
    if ftz:
        a, b, c = flush_to_zero(a), flush_to_zero(b), flush_to_zero(c)
    shape = torch.broadcast_shapes(a.shape, b.shape, c.shape)
    s = a.double().expand(shape) * b.double()  # exact
    s = s.add_(c.double())  # the one float64 rounding
    out = s.float()
    hard = on_f32_midpoint(s) | (out.abs() <= _FLT_MIN_NORMAL)
    if bool(hard.any()):
        idx = hard.nonzero(as_tuple=True)
        out[idx] = _fma_round_to_odd(*(t.expand(shape)[idx] for t in (a, b, c)))
    if ftz:
        out = flush_to_zero(out)
    return canonicalize_nan(out)


def on_f32_midpoint(s: torch.Tensor) -> torch.Tensor:
    """Where float64 values lie exactly on a float32 rounding boundary of float32's normal
    binades: the 29 fraction bits below float32's last are 1 then 28 zeros.  Only there can
    rounding an (inexact) float64 sum to float32 differ from rounding the exact value."""
    return (s.view(torch.int64) & ((1 << 29) - 1)) == 1 << 28


def _fma_round_to_odd(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fma_f32's proven path on equal-shape float32 tensors (Boldo & Melquiond, module doc)."""
    p = a.double() * b.double()
    s, e = _two_sum(p, c.double())
    e = torch.where(torch.isfinite(s), e, torch.zeros_like(e))
    even = (s.view(torch.int64) & 1) == 0
    toward = torch.where(e > 0, torch.full_like(s, math.inf), torch.full_like(s, -math.inf))
    return torch.where((e != 0) & even, torch.nextafter(s, toward), s).float()


def round_to(x: torch.Tensor, dtype: torch.dtype | str, *, saturate: bool = False) -> torch.Tensor:
    """Round float32 values to ``dtype`` (bf16, fp16, fp8 e4m3fn, fp8 e5m2) to nearest-even.

    Returns a tensor of ``dtype``.  Out-of-range values: without ``saturate`` they become +-inf
    (bf16, fp16, e5m2) or NaN (e4m3fn has no infinity), as torch's conversions do; with
    ``saturate`` finite values clamp to +-max first (PTX ``cvt.rn.satfinite``, which the FA4
    kernel uses for fp8 P), while NaN stays NaN.  Subnormals of the target are kept (PTX
    ``cvt`` to 16- and 8-bit floats does not flush).
    """
    fmt = format_of(dtype)
    _check_f32(x, "x")
    if saturate:
        x = torch.where(torch.isnan(x), x, x.clamp(-fmt.max, fmt.max))
    return x.to(fmt.dtype)


def ulp_of(exact: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Spacing of ``fmt`` in the binade containing |exact| (float64; see module doc).  Zero
    and subnormal exact values get the subnormal spacing."""
    e = exact.double().abs()
    _, exp = torch.frexp(e)  # e = m * 2**exp with m in [0.5, 1)
    binade = torch.clamp(exp.to(torch.float64) - 1, min=fmt.emin)
    return torch.exp2(binade - (fmt.p - 1))


def ulp_error(approx: torch.Tensor, exact: torch.Tensor, *, dtype: torch.dtype | str = torch.float32) -> torch.Tensor:
    """|approx - exact| in ULPs of ``dtype`` at the exact value (float64 tensor; module doc).

    Both NaN gives 0; NaN on one side only, or an infinity against a finite exact value, gives
    +inf; equal infinities give 0.
    """
    fmt = format_of(dtype)
    a, e = approx.double(), exact.double()
    err = (a - e).abs() / ulp_of(e, fmt)
    same = (a == e) | (torch.isnan(a) & torch.isnan(e))
    err = torch.where(same, torch.zeros_like(err), err)
    return torch.where(torch.isnan(err), torch.full_like(err, math.inf), err)


_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bit_view(x: torch.Tensor) -> torch.Tensor:
    """The bit patterns of a floating-point tensor of any width, as the signed integer type of
    that width (a view: no copy).  Equal views mean equal bits, NaN payloads and -0 included."""
    return x.view(_INT_OF_WIDTH[x.element_size()])


def ordered_bits(x: torch.Tensor) -> torch.Tensor:
    """int64 image of a floating-point tensor's bit patterns (any width) whose integer order is
    the float order, +0 and -0 coinciding: adjacent representable values are 1 apart."""
    b = bit_view(x).to(torch.int64)
    mag = b & ((1 << (8 * x.element_size() - 1)) - 1)
    return torch.where(b < 0, -mag, mag)


def step_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many representable steps of their (shared) format separate ``a`` and ``b`` (int64;
    +0 and -0 are 0 apart; -1 where either is NaN)."""
    d = (ordered_bits(a) - ordered_bits(b)).abs()
    nan = torch.isnan(a.float()) | torch.isnan(b.float())  # .float(): fp8 has no isnan kernel
    return torch.where(nan, torch.full_like(d, -1), d)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Integer ULP distance between float32 tensors: how many float32 steps separate them
    (int64; +0 and -0 are 0 apart; -1 where either is NaN)."""
    _check_f32(a, "a")
    _check_f32(b, "b")
    return step_distance(a, b)
