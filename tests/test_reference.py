"""numerics.reference (FP64, certified by mpmath) and numerics.metrics."""

import math

import mpmath
import pytest
import torch

from numerics.call import AttentionCall
from numerics.metrics import fa_criterion, lse_errors, output_errors, row_scaled_ulp_diff, ulp_diff_histogram
from numerics.reference import attention_reference, exact_attention_rows, mp_attention_rows, visible_mask


def _inputs(seed=0, b=2, sq=7, sk=11, hq=4, hk=2, d=16):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, hq, d, generator=g).bfloat16()
    k = torch.randn(b, sk, hk, d, generator=g).bfloat16()
    v = torch.randn(b, sk, hk, d, generator=g).bfloat16()
    return q, k, v, torch.randn(hq, generator=g)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"causal": True},
        {"window_size": (3, 1)},
        {"window_size": (None, 0)},
        {"softcap": 4.0},
        {"softmax_scale": 0.7},
        {"sink": True, "causal": True},
    ],
)
def test_fp64_reference_certified_by_mpmath(kw):
    q, k, v, sink = _inputs()
    kw = dict(kw)
    if kw.pop("sink", False):
        kw["learnable_sink"] = sink
    out, lse = attention_reference(q, k, v, call=AttentionCall.from_kwargs(**kw), return_lse=True)
    rows = [(0, 0, 0), (1, 3, 6), (1, 2, 3)]
    old = mpmath.mp.dps
    for (bi, h, i), (mo, ml) in zip(rows, mp_attention_rows(q, k, v, rows, call=AttentionCall.from_kwargs(**kw))):
        assert mpmath.mp.dps == old
        for c, x in enumerate(mo):
            assert abs(float(x) - out[bi, i, h, c].item()) <= 1e-14
        if math.isfinite(float(ml)):
            assert abs(float(ml) - lse[bi, h, i].item()) <= 1e-14
        else:
            assert lse[bi, h, i].item() == -math.inf


def test_visible_mask_bottom_right_and_windows():
    m = visible_mask(3, 5, causal=True)
    assert m.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    m = visible_mask(4, 2, causal=True)  # seqlen_q > seqlen_k: the first rows see nothing
    assert m.sum(-1).tolist() == [0, 0, 1, 2]
    m = visible_mask(4, 4, window_size=(1, 0))
    assert m.tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]


def test_empty_rows_and_sink_conventions():
    q, k, v, sink = _inputs(sq=9, sk=4)
    out, lse = attention_reference(q, k, v, call=AttentionCall(causal=True), return_lse=True)
    assert (out[:, :5] == 0).all() and (lse[..., :5] == -math.inf).all()
    out, lse = attention_reference(q, k, v, call=AttentionCall(causal=True, learnable_sink=sink), return_lse=True)
    assert (out[:, :5] == 0).all() and torch.allclose(lse[0, :, 0], sink.double())


def test_nan_propagates_only_where_visible():
    q, k, v, _ = _inputs(sq=4, sk=6)
    k[:, 5, :, 0] = float("nan")  # key 5: visible to the last query only under causal (sq=4, sk=6)
    out = attention_reference(q, k, v, call=AttentionCall(causal=True))
    assert torch.isnan(out[:, 3]).all() and torch.isfinite(out[:, :3]).all()


def test_output_errors_and_lse_errors():
    ref = torch.tensor([[1.0, 2.0, math.nan, 4.0]], dtype=torch.float64)
    out = torch.tensor([[1.0, 2.5, 3.0, math.inf]], dtype=torch.float32)
    e = output_errors(out, ref)
    assert e["max_abs"] == 0.5 and e["argmax"] == (0, 1)
    assert e["nan_swallowed"] == 1 and e["nonfinite_where_ref_finite"] == 1
    assert e["nonfinite_mismatches"] == {"+inf|finite": 1, "finite|NaN": 1}
    le = lse_errors(
        torch.tensor([1.0, -math.inf, 2.0, -math.inf, math.nan]),
        torch.tensor([1.5, -math.inf, -math.inf, math.nan, 3.0], dtype=torch.float64),
    )
    # 2.0 vs -inf: an empty row made finite (fails); -inf vs NaN: deviation; NaN vs 3.0: fails
    assert le == {
        "max_abs": 0.5,
        "ref_max_abs": 3.0,
        "mismatched_nonfinite": 1,
        "nan_swallowed": 1,
        "nonfinite_where_ref_finite": 1,
        "nonfinite_mismatches": {"-inf|NaN": 1, "NaN|finite": 1, "finite|-inf": 1},
        "checked": 2,  # the elements with a finite reference (1.5 and 3.0)
    }


def test_ulp_histograms():
    a = torch.tensor([1.0, 1.0, 1.0, -1e-30, float("nan")]).bfloat16()
    b = torch.tensor([1.0, 1.0078125, 1.0234375, 1e-30, float("nan")]).bfloat16()
    h = ulp_diff_histogram(a, b)
    assert (h["0"], h["1"], h[">2"]) == (2, 1, 2)  # +-1e-30 are far apart in integer steps
    ref = torch.tensor([[1.0, 1.0, 1.0, 0.0, 1.0]], dtype=torch.float64)
    r = row_scaled_ulp_diff(a.view(1, -1)[:, :4], b.view(1, -1)[:, :4], ref[:, :4])
    assert r["max"] == 3.0 and r["le_1"] == 3  # ... but a fraction of a ULP of the row's scale


def test_fa_criterion():
    ref = torch.tensor([1.0, -2.0], dtype=torch.float64)
    low = torch.tensor([1.01, -2.0])
    assert fa_criterion(torch.tensor([1.02, -2.0]), ref, low)["passed"]
    assert not fa_criterion(torch.tensor([1.04, -2.0]), ref, low)["passed"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float32])
@pytest.mark.parametrize(
    "kw", [{"causal": True, "softcap": 5.0, "sink": True}, {"window_size": (2, 1)}, {"softmax_scale": 3.0}]
)
def test_exact_rows_agree_with_50_digit_mpmath(dtype, kw):
    """The fast certifier is within its documented 2**-78 (3.3e-24) of the pure-mpmath rows, on
    logits up to ~1e2 (wide exponent spread among the softmax weights)."""
    g = torch.Generator().manual_seed(3)
    q = (torch.randn(1, 5, 2, 16, generator=g) * 3).to(dtype)
    k = (torch.randn(1, 9, 1, 16, generator=g) * 3).to(dtype)
    v = (torch.randn(1, 9, 1, 8, generator=g) * torch.logspace(-3, 3, 8)).to(dtype)
    kw = dict(kw)
    if kw.pop("sink", False):
        kw["learnable_sink"] = torch.tensor([0.3, -1.0])
    rows = [(0, 0, 4), (0, 1, 0), (0, 1, 2)]
    got = exact_attention_rows(q, k, v, rows, call=AttentionCall.from_kwargs(**kw))
    want = mp_attention_rows(q, k, v, rows, call=AttentionCall.from_kwargs(**kw), dps=50)
    old = mpmath.mp.dps
    mpmath.mp.dps = 50
    vmax = float(v.float().abs().max())  # the documented error is relative to the row's max |v|
    try:
        for (go, gl), (wo, wl) in zip(got, want):
            assert all(abs(a - b) <= 4e-24 * vmax for a, b in zip(go, wo))
            assert gl == wl if not mpmath.isfinite(wl) else abs(gl - wl) <= 1e-25 * (abs(wl) + 1)
    finally:
        mpmath.mp.dps = old


def test_exact_rows_refuse_nonfinite_rows_and_float64():
    q, k, v, _ = _inputs()
    v[0, 2, 0, 0] = float("inf")  # key 2 of kv head 0: visible to every query of batch 0
    got = exact_attention_rows(q, k, v, [(0, 0, 6), (1, 0, 6)], call=AttentionCall())
    assert got[0] is None and got[1] is not None
    got = exact_attention_rows(q, k, v, [(0, 0, 0)], call=AttentionCall(window_size=(0, 0)))  # query 0 sees key 0 only
    assert got[0] is not None
    with pytest.raises(ValueError, match="float64"):
        exact_attention_rows(q.double(), k, v, [(0, 0, 0)], call=AttentionCall())


def test_the_one_bound_check_counts_nan_and_inf_errors_as_violations():
    """numerics.metrics.bound_check, the runner's, the backward's and fidelity's one counter:
    where the reference and the bound are finite, a NaN or inf result violates; where either is
    not, nothing is checked; an LSE equal to an infinite reference is no error."""
    from numerics.metrics import bound_check

    nan, inf = float("nan"), float("inf")
    ref = torch.tensor([1.0, 1.0, 1.0, nan, 1.0, 1.0])
    out = torch.tensor([1.0, nan, inf, 5.0, 9.0, 1.5])
    bound = torch.tensor([0.1, 0.1, 0.1, 0.1, inf, 1.0])
    res = bound_check(out, ref, bound)
    assert res["violations"] == 2  # the NaN and the inf; not the NaN reference, not the infinite bound
    assert res["tightness"] == 0.5 and res["max_bound"] == 1.0
    lse_ref = torch.tensor([-inf, 2.0, 2.0])
    res = bound_check(out[:1], ref[:1], bound[:1], torch.tensor([-inf, nan, 2.0]), lse_ref, torch.full((3,), 0.1))
    assert res["lse_violations"] == 1 and res["lse_tightness"] == 0.0
