"""fa4.model: the Hopper configuration against production SM90 outputs recorded on the H200
(tests/data/fa4_sm90_samples.*), the SM100 configuration's knobs, and bad input."""

import dataclasses
import json

import numpy as np
import pytest
import torch

import fa4.forward_steps as fs
from fa4.model import FA4Numerics, attention, hardware_exp2
from fa4.primitives import LOG2_E, div_rn
from numerics.call import AttentionCall
from numerics.fp import fma_f32, to_f32
from numerics.metrics import row_scaled_ulp_diff, ulp_diff_histogram
from numerics.reference import attention_reference
from tests.conftest import DATA

META = json.loads((DATA / "fa4_sm90_samples.json").read_text())
CASES = [n for n in META if not n.startswith("_")]


def load_case(name):
    d = np.load(DATA / "fa4_sm90_samples.npz")
    m = META[name]
    dt = getattr(torch, m["dt"])
    q, k, v, o = (torch.from_numpy(d[f"{name}.{t}"]).view(dt) for t in ("q", "k", "v", "out"))
    kw = dict(m["kw"])
    if kw.pop("sink", False):
        kw["learnable_sink"] = torch.from_numpy(d[f"{name}.sink"])
    if "window_size" in kw:
        kw["window_size"] = tuple(kw["window_size"])
    return m, q, k, v, o, torch.from_numpy(d[f"{name}.lse"]), kw


# Measured on this data (CPU model vs the H200's production SM90 kernel): every case has >= 99.6%
# of outputs identical or 1 bf16/fp16 ULP apart and LSE within 2.9e-6 (4.2e-5 with softcap,
# whose tanh.approx the model evaluates correctly rounded).  The remaining differences come from
# MUFU.EX2 / MUFU.TANH not being correctly rounded (see fa4.model.hardware_exp2).
@pytest.mark.parametrize("name", CASES)
def test_sm90_model_matches_production_samples(name):
    m, q, k, v, o, lse, kw = load_case(name)
    nm = FA4Numerics.sm90(q.dtype, m["d"], causal=kw.get("causal", False), local="window_size" in kw)
    out, lse_m = attention(q, k, v, return_lse=True, numerics=nm, **kw)
    h = ulp_diff_histogram(out, o)
    assert h["fraction_within_1"] >= 0.99, h
    # in ULPs at the row's largest |reference| no output is more than 1 apart (measured max 1.0)
    ref = attention_reference(q, k, v, call=AttentionCall.from_kwargs(**kw))
    assert row_scaled_ulp_diff(out, o, ref)["max"] <= 1.0
    fin = torch.isfinite(lse)
    assert torch.equal(fin, torch.isfinite(lse_m))
    # LSE: within 4 float32 ULPs of its value plus 2**-20 absolute (lg2.approx has an absolute,
    # not relative, error of about 2**-22 in log2 units; ex2.approx is not correctly rounded
    # either); with softcap 5e-5 absolute (tanh.approx carries ~2**-11 relative error)
    ulp = 2.0 ** (torch.floor(torch.log2(lse.abs().clamp(min=1e-30))) - 23)
    tol = torch.full_like(lse, 5e-5) if kw.get("softcap") else 4 * ulp + 2.0**-20
    assert ((lse_m - lse).abs() <= tol)[fin].all(), (lse_m - lse)[fin].abs().max()
    # and the model's own error against FP64 is the production kernel's, to within 2%
    e_model, e_prod = (out.double() - ref).abs().max().item(), (o.double() - ref).abs().max().item()
    assert e_model <= 1.02 * e_prod


@pytest.mark.parametrize(
    "kw,freq,start",
    [
        (dict(head_dim=128), 10, 1),  # 2-CTA non-causal hd128: (T, F, 128)
        (dict(head_dim=128, seqlen_q=100), 16, 1),  # one m-block: 1-CTA, no key: default freq 16
        (dict(head_dim=128, causal=True), 16, 1),  # (F, T, 128)
        (dict(head_dim=192, causal=True), 32, 1),  # (F, T, 192)
        (dict(head_dim=192, head_dim_v=128), 16, 0),  # (T, F, 192); SM100 takes (192, 128) only
        (dict(head_dim=256, causal=True), 14, 0),  # (T, T, 256)
        (dict(head_dim=64), 16, 1),  # no key, hd <= 128: default 16
        (dict(head_dim=96, local=True), 16, 1),
        (dict(head_dim=128, seqlen_q=100, qhead_per_kvhead=4), 10, 1),  # 2-CTA again (400 packed rows)
        (dict(head_dim=96, qhead_per_kvhead=3), 10, 1),  # 1-CTA (hd 96), packed GQA override: 10
        (dict(head_dim=160), 0, 1),  # hd 160: no emulation
    ],
)
def test_sm100_interleave_resolution(kw, freq, start):
    nm = FA4Numerics.sm100(torch.bfloat16, **kw)
    assert (nm.emu_freq, nm.emu_start_frg if nm.emu_freq else 1) == (freq, start)


def test_sm100_defaults_follow_production_tables():
    bf = FA4Numerics.sm100(torch.bfloat16, 128)
    assert (bf.rescale_threshold, bf.max_offset, bf.emu_freq, bf.emu_start_frg) == (8.0, 0, 10, 1)
    fp8 = FA4Numerics.sm100(torch.float8_e4m3fn, 128, causal=True)
    assert (fp8.rescale_threshold, fp8.max_offset, fp8.emu_freq) == (0.0, 8, 8)
    assert FA4Numerics.sm100(torch.bfloat16, 256).emu_freq == 14
    sm90 = FA4Numerics.sm90(torch.bfloat16, 256)
    assert (sm90.exp2, sm90.tile_n, sm90.rescale_threshold) == ("hardware", 80, 0.0)


def _inputs(dt=torch.bfloat16, b=1, sq=200, sk=300, hq=2, hk=1, d=64, seed=0, drift=0.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, hq, d, generator=g)
    k = torch.randn(b, sk, hk, d, generator=g) + drift * torch.linspace(0, 1, sk).view(1, sk, 1, 1)
    v = torch.randn(b, sk, hk, d, generator=g)
    return q.to(dt), k.to(dt), v.to(dt)


@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_sm100_model_close_to_reference(dt):
    q, k, v = _inputs(dt)
    out, lse = attention(q, k, v, return_lse=True, causal=True)
    ref, rl = attention_reference(q, k, v, call=AttentionCall(causal=True), return_lse=True)
    assert out.dtype == (torch.bfloat16 if dt.itemsize == 1 else dt)
    tol = 0.08 if dt.itemsize == 1 else 0.01
    assert (out.double() - ref).abs().max().item() < tol
    fin = torch.isfinite(rl)
    assert (lse.double() - rl)[fin].abs().max().item() < 1e-4


def test_lazy_rescaling_threshold_changes_only_what_it_should():
    q, k, v = _inputs(torch.bfloat16, sk=512, drift=30.0, seed=3)  # the max moves at every block
    base = FA4Numerics.sm100(torch.bfloat16, 64)
    a = attention(q, k, v, numerics=base)
    b = attention(q, k, v, numerics=dataclasses.replace(base, rescale_threshold=0.0))
    ref = attention_reference(q, k, v, call=AttentionCall())
    assert not torch.equal(a, b)  # the knob is live
    for o in (a, b):
        assert (o.double() - ref).abs().max().item() < 0.02


def test_nan_score_swallowed_by_emulation_propagated_by_hardware():
    q, k, v = _inputs(torch.bfloat16, sq=4, sk=128, hq=1, hk=1)
    k[0, 40, 0, 0] = float("nan")  # one NaN key element: every query's score 40 is NaN
    base = FA4Numerics.sm100(torch.bfloat16, 64)
    emu = attention(q, k, v, numerics=dataclasses.replace(base, exp2="emulated"))
    hw = attention(q, k, v, numerics=dataclasses.replace(base, exp2="hardware"))
    assert torch.isfinite(emu.float()).all()  # ex2_emulation(NaN) = 0: the key is dropped
    assert torch.isnan(hw.float()).all()  # MUFU.EX2(NaN) = NaN: the whole row is NaN


def test_empty_rows_and_sink():
    q, k, v = _inputs(torch.bfloat16, sq=10, sk=4, hq=2, hk=2)
    out, lse = attention(q, k, v, causal=True, return_lse=True)
    assert (out[:, :6] == 0).all() and torch.isinf(lse[..., :6]).all()
    sink = torch.tensor([0.5, -1.0])
    out, lse = attention(q, k, v, causal=True, return_lse=True, learnable_sink=sink)
    assert (out[:, :6] == 0).all()
    assert torch.allclose(lse[0, :, 0], sink, atol=1e-6)


def test_hardware_exp2_model():
    t = torch.tensor([0.0, -1.0, -126.5, float("nan"), float("-inf"), 3.5, -126.0, float("inf")])
    y = hardware_exp2(t)
    assert y[0] == 1 and y[1] == 0.5 and y[2] == 0 and y[4] == 0
    assert y.view(torch.int32)[3].item() == 0x7FFFFFFF
    assert y[5].item() == pytest.approx(2**3.5, rel=2**-24)
    assert y[6] == 2.0**-126 and y[7] == float("inf")  # ftz flushes below the smallest normal only


def test_bad_input():
    q, k, v = _inputs()
    with pytest.raises(TypeError, match="accepted: bfloat16, float16"):
        attention(q.float(), k.float(), v.float())
    with pytest.raises(ValueError, match="multiple of heads_kv"):
        attention(q[:, :, :1].expand(-1, -1, 3, -1), k.expand(-1, -1, 2, -1), v.expand(-1, -1, 2, -1))
    with pytest.raises(ValueError, match="rescale_threshold must be >= 0"):
        FA4Numerics(rescale_threshold=-1.0)
    with pytest.raises(NotImplementedError, match="bf16 and fp16"):
        FA4Numerics.sm90(torch.float8_e4m3fn)


def test_tensor_core_mode_on_recorded_samples():
    """``mma="tensor_core"`` (the H200's wgmma summation, numerics.tensor_core) against the recorded
    production SM90 samples, on the CPU (MUFU by its correctly rounded stand-ins): measured
    245,181 of 245,504 outputs and 1,448 of 2,000 LSE values bit-identical, against 244,832 and
    1,150 with the exact-sum assumption.  The rest is MUFU: on the H200, with MUFU itself
    (fa4.mufu), all of them are identical, and every output and LSE bit of the 33 fidelity cases
    (tests/test_gpu.py, docs/tensor-cores.md)."""
    counts = {}
    for mode in ("exact", "tensor_core"):
        same_o = same_l = 0
        for name in CASES:
            m, q, k, v, o, lse, kw = load_case(name)
            nm = FA4Numerics.sm90(q.dtype, m["d"], causal=kw.get("causal", False), local="window_size" in kw)
            mo, ml = attention(q, k, v, return_lse=True, numerics=dataclasses.replace(nm, mma=mode), **kw)
            same_o += int((mo.view(torch.int16) == o.view(torch.int16)).sum())
            same_l += int((ml.view(torch.int32) == lse.view(torch.int32)).sum())
        counts[mode] = (same_o, same_l)
    assert counts == {"exact": (244832, 1150), "tensor_core": (245181, 1448)}


def test_mma_knob_is_validated():
    with pytest.raises(ValueError, match="mma must be 'exact' or 'tensor_core'"):
        FA4Numerics(mma="wgmma")


def test_sm90_sink_fold_rounds_the_product_before_the_subtraction(monkeypatch):
    """SM90 ``Softmax.finalize`` with a learnable sink: exp2's argument is ``fl(fl(sink * LOG2_E)
    - row_max_scaled)`` — FMUL, then FADD — not one FFMA (the sm_90a SASS: the product also
    feeds the select for rows that saw no key).  The fused form differs on these inputs; on the
    H200 this step took d128_sink's LSE from 93.0% to 100% bit-identical."""
    g = torch.Generator().manual_seed(2)
    sink = torch.randn(64, generator=g) * 4
    row_max = torch.randn(1, 64, 1, generator=g) * 4
    sl2 = torch.tensor(to_f32(0.125 * LOG2_E))
    seen = []
    real = fs.hardware_exp2
    monkeypatch.setattr(fs, "hardware_exp2", lambda t: seen.append(t.clone()) or real(t))
    nm = FA4Numerics.sm90(torch.bfloat16, 64)
    fs.finalize(
        nm, row_max, torch.ones(1, 64, 1), torch.ones(1, 64, 1, 8), sl2, torch.tensor(0.0), sink, torch.bfloat16
    )
    s_l2 = sink.view(1, -1, 1) * torch.tensor(to_f32(LOG2_E))
    want = s_l2 - row_max * sl2
    assert torch.equal(seen[0].view(torch.int32), want.view(torch.int32))
    fused = fma_f32(sink.view(1, -1, 1), torch.tensor(to_f32(LOG2_E)), -(row_max * sl2))
    assert not torch.equal(fused, want)


def test_div_rn_is_the_ieee_quotient():
    """``fa4.primitives.div_rn`` (the softcap's div.rn.f32): the float32 quotient correctly
    rounded — numpy's float32 division — on random values, and not the reciprocal product torch's
    CUDA division by a scalar computes (tests/test_gpu.py checks it on the device)."""
    x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(4)) * 40
    want = torch.from_numpy(x.numpy() / np.float32(15.0))
    assert torch.equal(div_rn(x, 15.0).view(torch.int32), want.view(torch.int32))
    assert not torch.equal(x * torch.tensor(1 / 15.0, dtype=torch.float32), want)
