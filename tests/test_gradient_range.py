"""A gradient whose exact value is beyond its dtype's range (numerics.metrics.rounded_overflow): the
correctly rounded result is that infinity, and a kernel returning it is right.  SDPA's fp16
backward on smoke's near_max cases returned exactly those infinities (2026-12-04, this machine) and
failed "the kernel returns +inf where the FP64 gradient is finite" until the comparison rounded the
reference's range."""

import math

import pytest
import torch

from audits.engine.backward import BackwardOptions
from audits.engine.evaluate import evaluate_case
from audits.kernels import KERNELS, kernel_domain
from audits.suites.cases import suite
from audits.verdict.gate import load_thresholds
from numerics.fp import FORMATS
from numerics.metrics import overflow_threshold, rounded_overflow

TH = load_thresholds()
#: SDPA's domain's fp16 near_max case: 227 dq and 352 dk elements whose exact values pass 65520
CASE = next(
    c for c in suite("smoke", kernel_domain("sdpa-math")) if c.name == "f16-d128-b2h4k1-s8x5-strided-near_max-seed0"
)


@pytest.mark.parametrize("name", ["float16", "bfloat16", "float32", "float8_e5m2"])
def test_the_threshold_is_where_round_to_nearest_overflows(name):
    """At the threshold the tie goes to infinity (the largest finite value's significand is odd),
    one float64 step below it the value rounds to that largest value; on 10,000 magnitudes around
    it, the same elements as torch's conversion, away from the threshold by more than float32's
    rounding (torch converts float64 through float32: 65519.99999999999 becomes 65520, then
    inf).  A result of each rounded infinity compares with it; a finite one (saturated) too."""
    dt, thr = FORMATS[name].dtype, overflow_threshold(name)
    edge = torch.tensor([math.nextafter(thr, 0), thr, math.nextafter(thr, math.inf)], dtype=torch.float64)
    for sign in (1, -1):
        got = torch.full((3,), sign * math.inf, dtype=torch.float64).to(dt)
        rounded, n = rounded_overflow(sign * edge, got)
        assert n == 2 and rounded[0] == sign * edge[0] and torch.equal(rounded[1:], got[1:].double())
    g = torch.Generator().manual_seed(0)
    around = thr * (1 + (torch.rand(10_000, generator=g, dtype=torch.float64) - 0.5) * 2**-6)
    around = around[(around - thr).abs() > thr * 2**-20]
    for r in (around, -around):
        want = r.to(dt)
        rounded, n = rounded_overflow(r, want)
        assert torch.equal(torch.isinf(rounded), torch.isinf(want.double())) and n == int(torch.isinf(want).sum())
        assert torch.equal(rounded[torch.isinf(want)], want.double()[torch.isinf(want)])
        saturated = torch.full_like(want, torch.finfo(dt).max if dt != torch.float8_e5m2 else 57344.0)
        assert torch.equal(rounded_overflow(r, saturated)[0], rounded)  # a finite result: the infinity too
    assert overflow_threshold("float16") == 65520.0
    assert overflow_threshold("float8_e4m3fn") is None  # no infinity: it saturates to NaN


def test_a_wrong_result_there_keeps_the_finite_reference():
    r = torch.tensor([1e5, -1e5, 1e5], dtype=torch.float64)
    got = torch.tensor([-math.inf, math.inf, math.nan]).half()
    assert torch.equal(rounded_overflow(r, got)[0], r)  # NaN or the other infinity: compared with 1e5


class _Saturate(torch.autograd.Function):
    """The identity whose backward clamps an infinite gradient to the dtype's largest finite value
    (a satfinite conversion)."""

    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        big = torch.finfo(g.dtype).max
        return torch.nan_to_num(g, posinf=big, neginf=-big)


class _Flip(torch.autograd.Function):
    """The identity whose backward negates infinite gradients (+inf for -inf)."""

    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        return torch.where(torch.isinf(g), -g, g)


def _sdpa(wrap=None):
    fn = KERNELS["sdpa-math"]
    if wrap is None:
        return fn
    return lambda q, k, v, **kw: fn(wrap.apply(q), wrap.apply(k), wrap.apply(v), **kw)


def _grads(fn) -> tuple[str, list[str], dict]:
    rec = evaluate_case("sdpa-math", fn, CASE, torch.device("cpu"), TH, BackwardOptions())
    return rec["verdict"], rec["reasons"], rec["backward"]["grads"]


def test_infinities_where_the_exact_gradient_is_beyond_float16_pass():
    verdict, reasons, grads = _grads(_sdpa())
    assert (grads["dq"]["beyond_range"], grads["dk"]["beyond_range"]) == (227, 352)
    assert "beyond_range" not in grads["dv"]
    assert all(g["nonfinite_where_ref_finite"] == 0 and g["nan_swallowed"] == 0 for g in grads.values())
    assert verdict == "warn" and reasons == ["LSE not returned: not audited"]  # SDPA returns no LSE


def test_a_saturated_gradient_there_is_a_deviation_said_as_the_range():
    verdict, reasons, grads = _grads(_sdpa(_Saturate))
    assert verdict == "warn" and grads["dq"]["nan_swallowed"] == 227 and grads["dk"]["nan_swallowed"] == 352
    assert (
        "116 dq elements: the kernel returns a finite value where the FP64 gradient is -inf (the exact gradient is "
        "beyond the dtype's range: it rounds to -inf) — a semantics deviation"
    ) in reasons, reasons
    assert all(
        g["nonfinite_where_ref_finite"] == 0 and not (g.get("bound") or {}).get("violations") for g in grads.values()
    )


def test_the_wrong_infinity_there_fails():
    verdict, reasons, grads = _grads(_sdpa(_Flip))
    assert verdict == "fail" and grads["dq"]["nonfinite_where_ref_finite"] == 227
    assert "227 dq elements: the kernel returns +inf (116) or -inf (111) where the FP64 gradient is finite" in reasons
