"""numerics.bounds.rescaling_analysis and `fa4-audit bounds`."""

import math

import pytest
import torch

from audits import cli
from fa4.knobs import PRODUCTION_RESCALING
from fa4.model import FA4Numerics, attention
from numerics.bounds import rescaling_analysis


@pytest.mark.parametrize("dtype", list(PRODUCTION_RESCALING))
def test_production_settings_are_safe(dtype):
    r = rescaling_analysis(dtype, *PRODUCTION_RESCALING[dtype])
    assert r.safe and r.headroom_log2 > 0 and r.p_max == 256.0


@pytest.mark.parametrize(
    "dtype,thr,off",
    [
        ("float8_e4m3fn", 4.0, 8),
        ("float8_e4m3fn", 1.0, 8),
        ("float16", 16.0, 0),
    ],  # #2716; 8+1 > log2 448; 16 > log2 65504
)
def test_unsafe_settings_are_flagged(dtype, thr, off):
    r = rescaling_analysis(dtype, thr, off)
    assert not r.safe and r.p_max > r.dtype_max and "UNSAFE" in r.explanation


def test_numbers():
    r = rescaling_analysis("float8_e4m3fn", 0.0, 8)
    assert r.headroom_log2 == pytest.approx(math.log2(448) - 8)
    assert r.p_min_after_cast == 2.0**-9
    assert r.flush_mass_bound(1024) == pytest.approx(1024 * 2.0**-10 / 256)
    assert r.row_sum_headroom_log2(1 << 15) == pytest.approx(math.log2(3.4028234663852886e38) - 15 - 8)
    assert r.o_accumulator_headroom_log2(1 << 15, 4.0) == pytest.approx(r.row_sum_headroom_log2(1 << 15) - 2)


@pytest.mark.parametrize(
    "bad",
    [
        ("bfloat16", -1.0, 0),
        ("float8_e4m3fn", 0.0, 9),
        ("float16", 0.0, 16),
        ("int8", 0.0, 0),
        ("float16", math.nan, 0),
    ],
)
def test_bad_settings(bad):
    with pytest.raises(ValueError):
        rescaling_analysis(*bad)


def test_unsafe_setting_really_shrinks_the_model_output():
    """The analysis's verdict against the model: e4m3 with threshold 4 saturates P, the output
    shrinks (#2716); production's threshold 0 does not."""
    g = torch.Generator().manual_seed(0)
    sk = 512
    q = torch.randn(1, 64, 1, 64, generator=g)
    k = torch.randn(1, sk, 1, 64, generator=g) + torch.linspace(0, 3, sk).view(1, sk, 1, 1)  # drifting max
    v = torch.ones(1, sk, 1, 64)  # every output is exactly 1 in exact arithmetic
    q, k, v = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
    prod = FA4Numerics.sm100(torch.float8_e4m3fn, 64)
    bad = FA4Numerics(**{**prod.__dict__, "rescale_threshold": 4.0})
    ok_out = attention(q, k, v, numerics=prod).float()
    bad_out = attention(q, k, v, numerics=bad).float()
    assert (ok_out - 1).abs().max() < 0.02
    assert bad_out.min() < 0.9  # saturated P: the output shrinks


def test_cli_bounds(capsys):
    assert cli.main(["bounds"]) == 0
    assert cli.main(["bounds", "--dtype", "float8_e4m3fn", "--threshold", "4", "--max-offset", "8"]) == 1
    assert cli.main(["bounds", "--dtype", "float16", "--threshold", "16"]) == 1
    assert cli.main(["bounds", "--dtype", "float8_e4m3fn", "--threshold", "1.0"]) == 1
    assert cli.main(["bounds", "--dtype", "bfloat16", "--threshold", "8"]) == 0
    capsys.readouterr()
    assert cli.main(["bounds", "--dtype", "int8"]) == 2
    assert "accepted: bfloat16, float16, float8_e4m3fn, float8_e5m2" in capsys.readouterr().err
    assert cli.main(["bounds", "--dtype", "bfloat16", "--threshold", "-1"]) == 2
    assert cli.main(["bounds", "--dtype", "float8_e4m3fn", "--max-offset", "9"]) == 2
    assert "max_offset must be an integer in [0, 8]" in capsys.readouterr().err
    assert cli.main(["bounds", "--threshold", "3"]) == 2
