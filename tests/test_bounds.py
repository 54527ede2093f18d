"""numerics.bounds.ex2_error_bound: rigorous, above every measurement, and tight."""

import json
from pathlib import Path

import mpmath
import pytest
import torch

from audits.checks.ex2.sweep import sweep_ex2
from fa4.ex2 import DEGREES, POLY_EX2, ex2_emulation
from numerics import bounds

REPORT = Path(__file__).parents[1] / "reports" / "ex2" / "ex2.json"


@pytest.mark.parametrize("degree", DEGREES)
def test_bound_above_sampled_measurement_and_tight(degree):
    r = sweep_ex2(degree=degree, sample=1 << 14, seed=degree)
    measured = r["classes"]["normal"]["max_rel_error"]
    b = bounds.ex2_error_bound(POLY_EX2[degree])
    assert measured <= b
    assert b <= 1.25 * measured, f"bound {b:.4e} not within 1.25x of the measured {measured:.4e}"


def test_bound_above_exhaustive_h200_measurement():
    """The committed exhaustive report (all 2**32 inputs on the H200) against today's bound."""
    rep = json.loads(REPORT.read_text())
    assert rep["mode"].startswith("exhaustive")
    for r in rep["degrees"]:
        m = r["sweep"]["classes"]["normal"]["max_rel_error"]
        b = bounds.ex2_error_bound(POLY_EX2[r["degree"]])
        assert m <= b <= 1.25 * m, (r["degree"], m, b)


@pytest.mark.parametrize("degree", DEGREES)
def test_bound_holds_at_the_worst_fraction(degree):
    """Dense float32 grid around the argmax of the analysis: every x there obeys the bound."""
    d = bounds.ex2_bound_details(POLY_EX2[degree])
    t = d["argmax"]
    for base in (0.0, -1.0, 5.0, -100.0):
        x = torch.arange(0, 1 << 16, dtype=torch.int32) - (1 << 15)
        x = (torch.tensor([t + base], dtype=torch.float32).view(torch.int32) + x).view(torch.float32)
        y = ex2_emulation(x, degree).double()
        rel = (y / torch.exp2(x.double()) - 1).abs().max().item()
        assert rel <= d["bound"]


def test_eps_enclosure_contains_true_values():
    m = bounds._Ex2Model(POLY_EX2[3])
    old = mpmath.mp.prec
    mpmath.mp.prec = 200
    try:
        for a in (0.0, 0.1, 0.37, 0.9):
            T = mpmath.iv.mpf([a, a + 1 / 64])
            enc = m.eps(T)
            for k in range(9):
                tt = mpmath.mpf(a) + mpmath.mpf(k) / (8 * 64)
                v = sum(mpmath.mpf(c) * tt**i for i, c in enumerate(POLY_EX2[3])) * mpmath.power(2, -tt) - 1
                assert enc.a <= v <= enc.b
    finally:
        mpmath.mp.prec = old


def test_horner_error_bound_covers_actual_rounding():
    """H(T) must cover |p^(t) - p(t)| for the float32 Horner the model computes."""
    mod = bounds._Ex2Model(POLY_EX2[5])
    t = torch.rand(1 << 16, generator=torch.Generator().manual_seed(5)) * 0.25
    y = ex2_emulation(t, 5).double()  # t in [0, 1/4): fl = 0, the result is p^(t) itself
    exact = sum(c * t.double() ** i for i, c in enumerate(POLY_EX2[5]))
    H = float(mod.horner_error(mpmath.iv.mpf([0, 0.25])))
    assert (y - exact).abs().max().item() <= H


def test_precision_restored_and_bad_degree():
    old = mpmath.mp.prec
    with pytest.raises(ValueError, match="coefficients must be 2 to 6 finite floats"):
        bounds.ex2_bound_details((1.0,) * 9)
    bounds.ex2_bound_details(POLY_EX2[2], rel_tol=1e-2)
    assert mpmath.mp.prec == old and mpmath.iv.prec == old
