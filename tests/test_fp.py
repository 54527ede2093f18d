"""numerics.fp against the exact-rational reference (tests/exact.py)."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from numerics import fp
from tests import exact

f32_bits = st.integers(min_value=0, max_value=2**32 - 1)
finite_bits = f32_bits.filter(lambda b: (b & 0x7F800000) != 0x7F800000)


def t(bits):
    return torch.tensor([b if b < 2**31 else b - 2**32 for b in bits], dtype=torch.int32).view(torch.float32)


def u(x):
    return [int(v) & 0xFFFFFFFF for v in x.view(torch.int32).tolist()]


def _edge_bits():
    vals = [
        0.0,
        -0.0,
        1.0,
        -1.0,
        2.0**-149,
        -(2.0**-149),
        2.0**-126,
        1.5 * 2**23,
        -1.5 * 2**23,
        3.4028234663852886e38,
        -127.0,
    ]
    return [exact.bits_of(v) for v in vals] + [0x7F800000, 0xFF800000, 0x7FC00000, 0x007FFFFF, 0x807FFFFF]


@pytest.mark.parametrize("flush", [False, True])
@given(a=f32_bits, b=f32_bits)
def test_add_rm_matches_exact(a, b, flush):
    got = u(fp.add_rm(t([a]), t([b]), ftz=flush))[0]
    assert got == exact.add(a, b, "rm", flush=flush), (hex(a), hex(b))


def test_add_rm_edges():
    E = _edge_bits()
    for a in E:
        for b in E:
            for flush in (False, True):
                assert u(fp.add_rm(t([a]), t([b]), ftz=flush))[0] == exact.add(a, b, "rm", flush=flush), (
                    hex(a),
                    hex(b),
                    flush,
                )


@given(a=finite_bits, b=finite_bits, c=finite_bits)
def test_fma_matches_exact(a, b, c):
    got = u(fp.fma_f32(t([a]), t([b]), t([c])))[0]
    want = exact.fma(a, b, c)
    assert got == want, (hex(a), hex(b), hex(c), hex(got), hex(want))


def test_fma_avoids_double_rounding():
    # a*b = (2**32 + 1) * 2**-56 = 2**-24 + 2**-56, c = 1: exact sum 1 + 2**-24 + 2**-56 lies just
    # above the float32 midpoint 1 + 2**-24.  Rounding to float64 first lands on the midpoint and
    # ties to even (1.0); the correctly rounded fma is 1 + 2**-23.
    a, b, c = 641 * 2.0**-28, 6700417 * 2.0**-28, 1.0
    naive = np.float32(np.float64(a) * np.float64(b) + np.float64(c))
    assert naive == np.float32(1.0)  # the trap is real
    got = fp.fma_f32(torch.tensor([a]), torch.tensor([b]), torch.tensor([c]))
    assert got.item() == 1.0 + 2.0**-23


def test_fma_redoes_every_midpoint_landing_in_one_broadcast_call():
    # a*b = 2**(e-24) * (1 + 2**-23) * (1 - 2**-23) = half an ulp of c minus 2**(e-70): the float64
    # sum lands on c's upper midpoint, the exact value lies below it, so the answer is c; the
    # naive double rounding gives c + ulp for odd c.  Mixed with ordinary elements, c near
    # float32's subnormal range, and b broadcast from a scalar-shaped tensor.
    g = torch.Generator().manual_seed(5)
    c = torch.randint(0x00800000, 0x7E000000, (400,), generator=g, dtype=torch.int32).view(torch.float32)
    c = torch.cat([c, -c, torch.tensor([2.0**-126, 3 * 2.0**-149, 2.0**-125 - 2.0**-148])])
    e = torch.floor(torch.log2(c.abs().double()))
    a = (torch.exp2(torch.clamp(e - 24, min=-149)) * (1 + 2.0**-23) * torch.sign(c)).float()
    a[::7] = 0.37  # ordinary elements in between
    b = torch.tensor([1 - 2.0**-23])
    got = u(fp.fma_f32(a, b, c))
    want = [exact.fma(x, exact.bits_of(1 - 2.0**-23), z) for x, z in zip(u(a), u(c))]
    assert got == want
    naive = (a.double() * b.double() + c.double()).float()
    assert (naive != fp.fma_f32(a, b, c)).sum() > 100  # the trap is real on many elements


def test_canonical_nan_and_ftz():
    x = fp.fma_f32(torch.tensor([math.inf]), torch.tensor([0.0]), torch.tensor([1.0]))
    assert u(x) == [fp.CANONICAL_NAN_BITS]
    y = fp.flush_to_zero(torch.tensor([2.0**-140, -(2.0**-140), 2.0**-126, -3.0]))
    assert u(y) == [0, 0x80000000, exact.bits_of(2.0**-126), exact.bits_of(-3.0)]


@pytest.mark.parametrize("name", ["bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"])
def test_round_to_is_nearest_even_and_saturates(name):
    fmt = fp.format_of(name)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(20000, generator=g) * fmt.max / 4
    got = fp.round_to(x, name, saturate=True).float().double()
    # reference: nearest representable value (ties to even) found exactly from the sorted table
    table = torch.arange(256 if fmt.p <= 4 else 65536, dtype=torch.int32)
    vals = (
        (table.to(torch.uint8 if fmt.p <= 4 else torch.int16) if fmt.p <= 4 else table.to(torch.int16))
        .view(fmt.dtype)
        .double()
    )
    vals = vals[torch.isfinite(vals)].unique()
    xd = x.double().clamp(-fmt.max, fmt.max)
    idx = torch.searchsorted(vals, xd).clamp(1, len(vals) - 1)
    lo, hi = vals[idx - 1], vals[idx]
    pick_hi = (xd - lo > hi - xd) | (
        (xd - lo == hi - xd)
        & (fp.round_to(hi.float(), name).view(torch.uint8 if fmt.p <= 4 else torch.int16).to(torch.int32) % 2 == 0)
    )
    want = torch.where(pick_hi, hi, lo)
    assert torch.equal(got, want)
    big = fp.round_to(torch.tensor([fmt.max * 4, -fmt.max * 4]), name, saturate=True).float()
    assert big.tolist() == [fmt.max, -fmt.max]


def test_format_of_rejects_unknown():
    with pytest.raises(ValueError, match="accepted: float32, bfloat16"):
        fp.format_of("float7")


def test_ulp_error_convention():
    # ulp of the exact value: at 1.0 (and just above) the float32 spacing is 2**-23; just below 1.0, 2**-24
    e = torch.tensor([1.0, 1.0 - 2.0**-30, 2.0**-140], dtype=torch.float64)
    a = torch.tensor([1.0 + 2.0**-23, 1.0, 0.0], dtype=torch.float64)
    err = fp.ulp_error(a, e, dtype=torch.float32)
    assert err[0].item() == 1.0
    assert err[1].item() == pytest.approx(2.0**-30 / 2.0**-24)
    assert err[2].item() == pytest.approx(2.0**-140 / 2.0**-149)  # subnormal spacing
    bf = fp.ulp_error(torch.tensor([1.0 + 2**-7]), torch.tensor([1.0]), dtype="bfloat16")
    assert bf.item() == 1.0  # bf16 spacing at 1.0 is 2**-7
    nan = fp.ulp_error(torch.tensor([math.nan, math.nan]), torch.tensor([1.0, math.nan]))
    assert nan.tolist() == [math.inf, 0.0]


def test_ulp_distance():
    a = torch.tensor([1.0, 0.0, -(2.0**-149), 1.0])
    b = torch.tensor([1.0 + 2.0**-23, -0.0, 2.0**-149, math.nan])
    assert fp.ulp_distance(a, b).tolist() == [1, 0, 2, -1]


def test_bad_dtype_message():
    with pytest.raises(TypeError, match="float32.*float64"):
        fp.add_rm(torch.zeros(1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64))


def test_step_distance_counts_representable_steps_in_every_width():
    """numerics.fp.step_distance, the one ordering of bit patterns (ulp_distance, the metrics'
    16/8-bit histogram, the invariance audit): adjacent values 1 apart, +0 = -0, -1 at NaN."""
    from numerics.fp import bit_view, step_distance

    for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2):
        one = torch.ones(1, dtype=dtype)
        up = (bit_view(one) + 1).view(dtype)  # the next value above 1
        neg = (-one.float()).to(dtype)
        zero, nzero = torch.zeros(1, dtype=dtype), (-torch.zeros(1)).to(dtype)
        assert int(step_distance(one, up)) == 1, dtype
        assert int(step_distance(zero, nzero)) == 0, dtype
        assert int(step_distance(one, neg)) == 2 * int(bit_view(one).to(torch.int64)), dtype
    nan = torch.tensor([float("nan")], dtype=torch.bfloat16)
    assert int(step_distance(nan, torch.ones(1, dtype=torch.bfloat16))) == -1
