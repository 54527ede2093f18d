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
    """On this GPU, production's own refusals are matched by ``fa4.refusals.REFUSALS`` (fp8
    before SM100), and a configuration it runs is judged with its LSE audited."""
    from audits.engine.evaluate import evaluate_case
    from audits.suites.cases import Case
    from audits.verdict.gate import load_thresholds
    from fa4.production import flash_attn

    th, dev = load_thresholds(), torch.device("cuda")
    rec = evaluate_case("fa4", flash_attn, Case(dtype="float8_e4m3fn", d=64, dv=64), dev, th)
    if torch.cuda.get_device_capability()[0] < 10:
        assert rec["verdict"] == "skipped" and "production refuses this configuration" in rec["reasons"][0]
    rec = evaluate_case("fa4", flash_attn, Case(d=64, dv=64, causal=True, sink=True), dev, th)
    assert rec["verdict"] == "pass" and rec["lse_returned"] and rec["lse"]["max_abs"] < 1e-3, rec["reasons"]


def test_tc_model_with_mufu_reproduces_the_recorded_production_samples():
    """``fa4-model-sm90-tc`` on CUDA (the H200's wgmma summation, MUFU itself) against the
    production SM90 outputs recorded on the H200 (tests/data/fa4_sm90_samples.*): every output
    and every LSE bit, on all eight cases — softcap (``div_rn``) and the sink (SM90's FMUL, FADD
    fold) included."""
    from audits.kernels import get_kernel
    from tests.test_model import CASES, load_case

    run = get_kernel("fa4-model-sm90-tc")
    differ = {}
    for name in CASES:
        _, q, k, v, o, lse, kw = load_case(name)
        kw = {n: (t.cuda() if isinstance(t, torch.Tensor) else t) for n, t in kw.items()}
        mo, ml = run(q.cuda(), k.cuda(), v.cuda(), return_lse=True, **kw)
        n_o = int((mo.cpu().view(torch.int16) != o.view(torch.int16)).sum())
        n_l = int((ml.cpu().view(torch.int32) != lse.view(torch.int32)).sum())
        if n_o or n_l:
            differ[name] = (n_o, n_l)
    assert differ == {}, f"(outputs, LSE values) differing per case: {differ}"


def test_softcap_division_on_cuda_is_ieee():
    """The softcap's ``div.rn`` on CUDA equals the CPU's IEEE quotient bit for bit, where torch's
    own ``x / c`` on CUDA (a multiply by 1/c) does not (fa4.primitives.div_rn)."""
    from fa4.primitives import div_rn

    x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(3)) * 40
    ieee = (x.double() / 15.0).float()
    assert torch.equal(div_rn(x.cuda(), 15.0).cpu().view(torch.int32), ieee.view(torch.int32))
    assert not torch.equal((x.cuda() / 15.0).cpu(), ieee)  # why div_rn exists


@pytest.mark.parametrize(
    "kw",
    [
        dict(d=64),
        dict(d=128, causal=True, hq=8, hk=2),
        dict(d=128, softcap=15.0),
        dict(d=128, sink=True, dtype="float16"),
        dict(d=256),
    ],
    ids=["d64", "d128_causal_gqa", "d128_softcap", "d128_sink_fp16", "d256"],
)
def test_tc_backward_matches_production_deterministic_bitwise(kw):
    """``fa4-model-sm90-tc``'s backward against production's SM90 backward, both with
    ``deterministic=True`` (the dQ / dK / dV reductions in the semaphores' order): every
    gradient bit (benchmarks/experiments/h200_backward.py --deterministic, docs/backward.md; head dim 256
    since the preprocess's element-major order, fa4.model_bwd.row_dot)."""
    from audits.kernels import get_kernel
    from audits.suites.cases import Case
    from audits.suites.inputs import make_inputs

    kw = dict(kw)
    d, hq, hk = kw.pop("d"), kw.pop("hq", 4), kw.pop("hk", 4)
    case = Case(kw.pop("dtype", "bfloat16"), d, d, 2, hq, hk, 256, 384, seed=21, **kw)
    x = make_inputs(case, device="cuda")
    do = torch.randn(2, 256, hq, d, generator=torch.Generator().manual_seed(22)).to(x["q"].dtype).cuda()
    grads = {}
    for name in ("fa4", "fa4-model-sm90-tc"):
        q, k, v = (x[n].detach().clone().requires_grad_(True) for n in ("q", "k", "v"))
        args = dict(x["kw"])
        wrt = [q, k, v]
        if args.get("learnable_sink") is not None:
            args["learnable_sink"] = args["learnable_sink"].detach().clone().requires_grad_(True)
            wrt.append(args["learnable_sink"])
        out = get_kernel(name)(q, k, v, deterministic=True, **args)
        grads[name] = torch.autograd.grad(out, wrt, do)
    for n, a, b in zip(("dq", "dk", "dv", "dsink"), grads["fa4"], grads["fa4-model-sm90-tc"], strict=False):
        assert torch.equal(a, b), f"{n}: {int((a != b).sum())} of {a.numel()} differ"
