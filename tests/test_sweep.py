"""audits.checks.ex2.sweep: input classes, and the numba and torch statistics backends agree."""

import pytest
import torch

from audits.checks.ex2 import stats_cpu as _ex2_stats_cpu
from audits.checks.ex2 import sweep as ex2_sweep
from audits.checks.ex2.sweep import ULP_BIN_EDGES, class_ranges, sweep_ex2


def test_classes_partition_all_bit_patterns():
    ranges = sorted(r for rs in class_ranges().values() for r in rs)
    assert ranges[0][0] == 0 and ranges[-1][1] == 2**32
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


def test_class_boundaries_are_the_documented_values():
    f = lambda b: torch.tensor([b - 2**32 if b >= 2**31 else b], dtype=torch.int32).view(torch.float32).item()
    r = class_ranges()
    assert f(r["normal"][0][1] - 1) == 127.0 and f(r["normal"][1][1] - 1) == -126.0
    assert f(r["subnormal"][0][0]) > -127.0 and f(r["clamped"][0][0]) == -127.0


def test_numba_and_torch_statistics_agree():
    g = torch.Generator().manual_seed(2)
    x = torch.rand(1 << 16, generator=g) * 250 - 125
    y = torch.exp2(x) * (1 + (torch.rand(1 << 16, generator=g) - 0.5) * 1e-4)
    a = ex2_sweep._chunk_stats_torch(x, y, envelope=True)
    b = _ex2_stats_cpu.chunk_stats(
        x.numpy(), y.numpy(), envelope=True, frac_bins=ex2_sweep.FRAC_BINS, n_hist=len(ULP_BIN_EDGES) - 1
    )
    assert a["argmax"] == b["argmax"] and a["hist"] == b["hist"]
    # the two exp2 references (SLEEF in torch, glibc in numba) may differ by a float64 ulp
    for k in ("max_rel", "sum_rel", "max_ulp"):
        assert a[k] == pytest.approx(b[k], rel=1e-12)
    assert torch.allclose(a["env_lo"], b["env_lo"], rtol=1e-9) and torch.allclose(a["env_hi"], b["env_hi"], rtol=1e-9)
    assert sum(a["hist"]) == x.numel()


def test_sample_sweep_counts_and_outside_classes():
    r = sweep_ex2(degree=3, sample=4096)
    c = r["classes"]
    assert c["clamped"]["results"] == {"+0.0": c["clamped"]["count"]}
    assert c["nan"]["results"] == {"+0.0": c["nan"]["count"]}
    assert c["inf"]["results"] == {"nan": 1}
    assert c["subnormal"]["results"] == {"subnormal": c["subnormal"]["count"]}
    assert c["subnormal"]["max_rel_error"] > 0.1  # the splice underflow: wrongly scaled
    assert sum(c["normal"]["ulp_histogram"].values()) == c["normal"]["count"]
    assert r["inputs"] == ex2_sweep.planned_inputs(exhaustive=False, sample=4096)


def test_production_mismatch_is_counted():
    from fa4.ex2 import ex2_emulation

    def broken(x):  # a "production" that differs on inputs above 100
        y = ex2_emulation(x, 3)
        return torch.where(x > 100, y * 2, y)

    r = sweep_ex2(degree=3, sample=2000, production=broken)
    assert r["production"]["mismatches"] > 0 and r["production"]["examples"]
    ok = sweep_ex2(degree=3, sample=2000, production=lambda x: ex2_emulation(x, 3))
    assert ok["production"]["mismatches"] == 0
