"""GPU tests: the model against the production device functions run on this GPU.

Marked ``gpu``: skipped without CUDA and the production package (CI has neither).  Run on the
device machine with ``pytest -m gpu``.
"""

import numpy as np
import pytest
import torch

from fa4.ex2 import DEGREES, ex2_emulation, ex2_emulation_2

pytestmark = pytest.mark.gpu


def _inputs() -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    bits = torch.randint(-(2**31), 2**31, (1 << 22,), generator=g, dtype=torch.int64).to(torch.int32)
    dense = (torch.rand(1 << 22, generator=g) * 160 - 140).view(torch.int32)
    return torch.cat([bits, dense]).view(torch.float32).cuda()


@pytest.mark.parametrize("degree", DEGREES)
def test_scalar_production_matches_model_bitwise(degree):
    from fa4.production import ex2_kernel

    x = _inputs()
    y = ex2_kernel("scalar", degree)(x)
    assert torch.equal(y.view(torch.int32), ex2_emulation(x, degree).view(torch.int32))


def test_packed_production_matches_model_or_is_refused_before_sm100():
    from fa4.production import ex2_kernel

    x = _inputs()
    run = ex2_kernel("packed", 3)
    if torch.cuda.get_device_capability()[0] < 10:
        with pytest.raises(NotImplementedError, match="sm_100"):
            run(x)
    else:
        assert torch.equal(run(x).view(torch.int32), ex2_emulation_2(x, 3).view(torch.int32))


def test_hardware_exp2_reproduces_recorded_h200_outputs():
    from fa4.production import ex2_kernel
    from tests.conftest import DATA

    d = np.load(DATA / "ex2_production_sample.npz")
    x = torch.from_numpy(d["x_bits"].view(np.int32)).view(torch.float32).cuda()
    y = ex2_kernel("hardware")(x).view(torch.int32).cpu().numpy().view(np.uint32)
    assert (y == d["hw_ex2_approx_ftz"]).all()


def test_model_on_cuda_equals_model_on_cpu():
    x = _inputs()
    for degree in (1, 3, 5):
        assert torch.equal(
            ex2_emulation(x, degree).cpu().view(torch.int32), ex2_emulation(x.cpu(), degree).view(torch.int32)
        )


def test_production_refusals_match_the_rules_and_everything_else_is_judged():
    """On this GPU, production's own refusals are matched by ``fa4.production.REFUSALS`` (fp8
    before SM100), and a configuration it runs is judged with its LSE audited."""
    from audits.cases import Case
    from audits.runner.engine import evaluate_case
    from audits.runner.gate import load_thresholds
    from fa4.production import flash_attn

    th, dev = load_thresholds(), torch.device("cuda")
    rec = evaluate_case("fa4", flash_attn, Case(dtype="float8_e4m3fn", d=64, dv=64), dev, th)
    if torch.cuda.get_device_capability()[0] < 10:
        assert rec["verdict"] == "skipped" and "production refuses this configuration" in rec["reasons"][0]
    rec = evaluate_case("fa4", flash_attn, Case(d=64, dv=64, causal=True, sink=True), dev, th)
    assert rec["verdict"] == "pass" and rec["lse_returned"] and rec["lse"]["max_abs"] < 1e-3, rec["reasons"]
