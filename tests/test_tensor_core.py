"""numerics.tensor_core against wgmma outputs recorded on the H200 (benchmarks/experiments/mma_probe.py;
tests/data/wgmma_h200.*): bf16 and fp16, K = 16 to 128, crafted probes and random inputs of
wide exponent spread, every output bit for bit; and the alternatives the measurement ruled out
fail on the same data (so the test can tell the model from its near misses)."""

import json

import numpy as np
import pytest
import torch

from numerics.tensor_core import rz_to_f32, tc_dot
from tests.conftest import DATA

META = json.loads((DATA / "wgmma_h200.json").read_text())


def _load(name: str):
    d = np.load(DATA / "wgmma_h200.npz")
    dt = getattr(torch, name.split(".")[0])
    a, b = (torch.from_numpy(d[f"{name}.{t}"]).view(dt) for t in "ab")
    c, out = (torch.from_numpy(d[f"{name}.{t}"]).view(torch.float32) for t in "cd")
    return a, b, c, out


def _mma(a, b, c, **kw):
    p = b.shape[0]
    return tc_dot(a.view(p, 64, 1, -1), b.permute(0, 2, 1).unsqueeze(1), c.view(p, 64, 64), **kw).view(-1, 64)


@pytest.mark.parametrize("name", META["sets"])
def test_wgmma_model_is_bit_exact(name):
    a, b, c, out = _load(name)
    got = _mma(a, b, c)
    assert torch.equal(got.view(torch.int32), out.view(torch.int32))


def test_the_near_misses_fail():
    """3 extra bits, or 1, or summing in exact arithmetic rounded once (the model's ``exact``
    MMA) each disagree with the recorded outputs somewhere."""
    a, b, c, out = _load("bfloat16.k128.random2")
    for kw in ({"extra_bits": 3}, {"extra_bits": 1}, {"block": 8}):
        assert not torch.equal(_mma(a, b, c, **kw).view(torch.int32), out.view(torch.int32)), kw
    p = b.shape[0]
    exact = (a.view(p, 64, 1, -1).double() * b.permute(0, 2, 1).unsqueeze(1).double()).sum(-1).view(-1, 64)
    assert not torch.equal((exact + c.double()).float().view(torch.int32), out.view(torch.int32))


def test_probe_findings():
    """The crafted probes' verdicts, spelled out: 1 + 4 x 2**-25 keeps them (2 extra bits) and
    1 + 8 x 2**-26 drops them; 1 + 2**-24 + 2**-25 truncates to 1; 1 - 2**-25 truncates to
    1 - 2**-24 (round-to-nearest-even would give 1)."""
    one = torch.tensor([1.0])
    row = lambda vals: torch.tensor(vals + [0.0] * (16 - len(vals))).bfloat16().view(1, 16)
    ones = torch.ones(1, 16).bfloat16()
    assert tc_dot(row([2.0**-25] * 4), ones, one).item() == 1 + 2.0**-23
    assert tc_dot(row([2.0**-26] * 8), ones, one).item() == 1.0
    assert tc_dot(row([2.0**-24, 2.0**-25]), ones, one).item() == 1.0
    assert tc_dot(row([-(2.0**-25)]), ones, one).item() == 1 - 2.0**-24


def test_rz_to_f32():
    x = torch.tensor([1 + 2.0**-24 + 2.0**-30, -(1 + 2.0**-24 + 2.0**-30), 1e300, float("nan")], dtype=torch.float64)
    y = rz_to_f32(x)
    assert y[0].item() == 1.0 and y[1].item() == -1.0 and torch.isnan(y[3])
    assert y[2].item() == float(torch.finfo(torch.float32).max)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_compiled_cpu_loop_equals_the_torch_form(dtype, monkeypatch):
    """The compiled CPU loop (``_tc_compiled``) gives the torch form's bits: exponent spreads up
    to 2**60, zeros and -0, a subnormal and a -0 accumulator, broadcast operands, and (fp16)
    inf / NaN, which take the torch form's IEEE path."""
    import numerics.tensor_core as tc

    g = torch.Generator().manual_seed(11)

    def gen(shape, spread):
        return torch.randn(shape, generator=g) * torch.exp2(
            torch.randint(-spread, spread + 1, shape, generator=g).float()
        )

    got, want = [], []
    for spread in (0, 4, 12, 30, 60):
        a, b = gen((3, 5, 7, 1, 48), spread).to(dtype), gen((3, 5, 1, 9, 48), spread).to(dtype)
        if dtype != torch.float8_e4m3fn:
            a[0, 0, 0, 0, :5], b[1, 1, 0, 2, 3] = 0.0, -0.0
        c = gen((3, 5, 7, 9), spread).float()
        c[0, 0, 0, 0], c[0, 0, 0, 1] = -0.0, 1e-40
        if dtype == torch.float16:
            a[2, 2, 2, 0, 7], c[1, 1, 1, 1] = float("inf"), float("nan")
        for cc in (c, None):
            got.append(tc.tc_dot(a, b, cc).view(torch.int32))
            with monkeypatch.context() as m:
                m.setattr(tc, "_FAST_CPU", False)
                want.append(tc.tc_dot(a, b, cc).view(torch.int32))
    assert torch.equal(torch.cat([x.flatten() for x in got]), torch.cat([x.flatten() for x in want]))
