"""fa4.model_bwd: the backward model through ``fa4.model.attention``'s autograd hook, against FP64
gradients with FlashAttention's backward criterion on every feature axis, and the properties
that criterion cannot see (exact zeros, the hardware exp2, the deterministic order, the float32
GQA reduction).  The primitives the backward shares with the forward (exp2, mask rule, scales)
are the same functions, ``fa4.primitives``: nothing to compare."""

import dataclasses
import math

import pytest
import torch

import fa4.model_bwd as mb
from fa4.model import FA4Numerics, attention
from fa4.model_bwd import attention_backward, bwd_plan
from numerics.fp import format_of, ulp_of
from numerics.reference import visible_mask
from tests.model_bwd_oracle import attention_backward_unblocked

BF16, FP16 = torch.bfloat16, torch.float16


def _attn(q, k, v, dt, *, causal=False, window_size=(None, None), softcap=0.0, learnable_sink=None):
    """Differentiable attention computed by PyTorch in ``dt`` (float64: the reference; the input
    dtype: FA's ``attention_ref(upcast=False)``): (out, lse), empty rows out 0 and lse -inf."""
    b, sq, hq, d = q.shape
    sk, rep = k.shape[1], hq // k.shape[2]
    q, k, v = q.to(dt), k.to(dt).repeat_interleave(rep, 2), v.to(dt).repeat_interleave(rep, 2)
    s = torch.einsum("bihd,bjhd->bhij", q * (1.0 / math.sqrt(d)), k)
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~visible_mask(sq, sk, causal=causal, window_size=window_size), -math.inf)
    if learnable_sink is not None:
        s = torch.cat([s, learnable_sink.to(dt).view(1, hq, 1, 1).expand(b, hq, sq, 1)], dim=-1)
    m = s.detach().amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    den = e.sum(-1, keepdim=True)
    safe = torch.where(den > 0, den, torch.ones_like(den))
    out = torch.einsum("bhij,bjhc->bihc", e[..., :sk] / safe, v)
    lse = torch.where(den > 0, m + torch.log(safe), torch.full_like(m, -math.inf)).squeeze(-1)
    return out, lse


def _inputs(dtype, d, b, sq, sk, hq, hk, seed, sink=False):
    g = torch.Generator().manual_seed(seed)
    x = {n: torch.randn(b, s, h, d, generator=g).to(dtype) for n, s, h in (("q", sq, hq), ("k", sk, hk), ("v", sk, hk))}
    x["sink"] = torch.randn(hq, generator=g).to(dtype) if sink else None
    x["do"] = torch.randn(b, sq, hq, d, generator=g).to(dtype)  # exact in every dtype used below
    x["dlse"] = torch.randn(b, hq, sq, generator=g).to(dtype).float()
    return x


def _grads(fn, x, dt, **kw):
    """Gradients of sum(out * dO) + sum(lse * dLSE) (finite lse) w.r.t. q, k, v (and the sink),
    the leaves held in ``dt``: dLSE flows wherever the LSE is finite."""
    leaves = [x[n].to(dt).requires_grad_() for n in ("q", "k", "v")]
    sink = None if x["sink"] is None else x["sink"].to(dt).requires_grad_()
    out, lse = fn(*leaves, learnable_sink=sink, **kw)
    loss = (out * x["do"].to(out.dtype)).sum() + torch.where(
        torch.isfinite(lse), lse * x["dlse"].to(lse.dtype), 0
    ).sum()
    got = torch.autograd.grad(loss, leaves + ([sink] if sink is not None else []))
    return dict(zip(("dq", "dk", "dv", "dsink"), got))


def _model(arch):
    """``fa4.model.attention`` with production's ``arch`` numerics for the inputs: (out, lse)."""

    def fn(q, k, v, **kw):
        nm = FA4Numerics.for_inputs(arch, q, k, v, kw.get("causal", False), kw.get("window_size", (None, None)))
        return attention(q, k, v, return_lse=True, numerics=nm, **kw)

    return fn


def _lowprec(dt):
    return lambda q, k, v, **kw: _attn(q, k, v, dt, **kw)


def fa_bwd_check(x, ref, pt, softcap):
    """FA's backward criterion (flash-attention/tests/cute/test_flash_attn.py): max|x - ref| <=
    rtol * max|pt - ref| + 2 * rounding (+ 3e-4 with softcap; rtol 2, 3 with softcap), rounding
    as ``numerics.metrics.fa_criterion`` takes FA's ``(ref + 0.3 - 0.3 - ref)``: the gradient
    dtype's unit roundoff times max|ref|.  Returns (error, allowed)."""
    r = ref.double()
    err = float((x.double() - r).abs().max())
    base = float((pt.double() - r).abs().max())
    rounding = format_of(x.dtype).unit_roundoff * float(r.abs().max())
    return err, (3 if softcap else 2) * base + 2 * rounding + (3e-4 if softcap else 0.0)


# (name, dtype, d, (b, sq, sk, hq, hk), attention kwargs, sink, arch): every axis at least once per
# arch; the causal cases with seqlen_q > seqlen_k have rows that see no key.
CASES = [
    ("bf16-d64", BF16, 64, (2, 384, 640, 2, 2), {}, False, "sm100"),
    ("fp16-d64", FP16, 64, (2, 384, 640, 2, 2), {}, False, "sm90"),
    ("bf16-d128", BF16, 128, (2, 400, 576, 2, 2), {}, False, "sm90"),
    ("fp16-d128", FP16, 128, (2, 400, 576, 2, 2), {}, False, "sm100"),
    ("bf16-causal-sq>sk", BF16, 128, (1, 700, 450, 2, 2), {"causal": True}, False, "sm100"),
    ("fp16-causal-sq>sk", FP16, 64, (1, 700, 330, 2, 2), {"causal": True}, False, "sm90"),
    ("bf16-causal-sq<sk", BF16, 64, (1, 300, 800, 2, 2), {"causal": True}, False, "sm90"),
    ("fp16-causal", FP16, 128, (2, 512, 512, 2, 2), {"causal": True}, False, "sm100"),
    ("bf16-local", BF16, 64, (1, 512, 768, 2, 2), {"window_size": (64, 32)}, False, "sm100"),
    ("fp16-local", FP16, 128, (1, 512, 640, 2, 2), {"window_size": (200, 0)}, False, "sm90"),
    ("bf16-softcap", BF16, 128, (1, 384, 512, 2, 2), {"softcap": 2.0}, False, "sm100"),
    ("fp16-softcap", FP16, 64, (1, 384, 512, 2, 2), {"softcap": 2.0}, False, "sm90"),
    ("bf16-sink", BF16, 64, (2, 400, 512, 2, 2), {}, True, "sm100"),
    ("fp16-sink-causal", FP16, 128, (1, 520, 400, 2, 2), {"causal": True}, True, "sm90"),
    ("bf16-gqa", BF16, 128, (1, 384, 512, 4, 2), {}, False, "sm100"),
    ("fp16-mqa", FP16, 64, (1, 384, 512, 3, 1), {"causal": True}, False, "sm90"),
    ("bf16-all", BF16, 64, (1, 400, 512, 4, 2), {"softcap": 5.0, "window_size": (96, 8)}, True, "sm100"),
    ("fp16-all", FP16, 128, (1, 520, 400, 6, 2), {"softcap": 5.0, "causal": True}, True, "sm90"),
]


@pytest.mark.parametrize("name,dtype,d,shape,kw,sink,arch", CASES, ids=[c[0] for c in CASES])
def test_gradients_meet_fa_criterion_against_fp64(name, dtype, d, shape, kw, sink, arch):
    x = _inputs(dtype, d, *shape, seed=sum(map(ord, name)), sink=sink)
    ref = _grads(lambda *a, **k: _attn(*a, torch.float64, **k), x, torch.float64, **kw)
    pt = _grads(_lowprec(dtype), x, dtype, **kw)
    got = _grads(_model(arch), x, dtype, **kw)
    for n in ("dq", "dk", "dv"):
        assert got[n].dtype == dtype and torch.isfinite(got[n]).all()
        err, allowed = fa_bwd_check(got[n], ref[n], pt[n], kw.get("softcap", 0.0))
        assert err <= allowed, (n, err, allowed)
    if sink:  # elementwise: 2 * PyTorch's worst error + 2 ULP of the sink dtype at |ref|
        r = ref["dsink"].double()
        tol = 2 * float((pt["dsink"].double() - r).abs().max()) + 2 * ulp_of(r, format_of(dtype))
        assert got["dsink"].dtype == dtype and ((got["dsink"].double() - r).abs() <= tol).all(), (got["dsink"], r)


@pytest.mark.parametrize("arch", ["sm100", "sm90"])
def test_keys_no_query_sees_get_exactly_zero_dk_dv(arch):
    """Local window, seqlen_q < seqlen_k: keys below sk - sq - left are in no query's window."""
    x = _inputs(BF16, 64, 1, 64, 256, 2, 2, seed=3)
    kw = {"window_size": (32, 0)}
    g = _grads(_model(arch), x, BF16, **kw)
    seen = visible_mask(64, 256, **kw).any(0)
    assert int((~seen).sum()) == 160
    for n in ("dk", "dv"):
        assert (g[n][:, ~seen] == 0).all() and (g[n][:, seen] != 0).any(-1).all(), n


@pytest.mark.parametrize("arch", ["sm100", "sm90"])
def test_rows_with_no_visible_key_contribute_nothing(arch):
    """Causal, seqlen_q > seqlen_k: rows 0..sq-sk-1 see no key (LSE -inf).  Their dQ is exactly
    zero, and dK / dV do not change when their dO and dLSE do (even a dLSE on a -inf LSE)."""
    x = _inputs(BF16, 64, 1, 200, 120, 2, 2, seed=4)
    q, k, v, do = x["q"], x["k"], x["v"], x["do"]
    nm = FA4Numerics.for_inputs(arch, q, k, v, True)
    out, lse = attention(q, k, v, causal=True, return_lse=True, numerics=nm)
    empty = ~visible_mask(200, 120, causal=True).any(1)
    assert int(empty.sum()) == 80 and torch.isinf(lse[..., empty]).all() and (out[:, empty] == 0).all()
    a = attention_backward(q, k, v, out, lse, do, dlse=x["dlse"], causal=True, numerics=nm)
    do2, dlse2 = do.clone(), x["dlse"].clone()
    do2[:, empty], dlse2[..., empty] = 7.0, -3.0
    b = attention_backward(q, k, v, out, lse, do2, dlse=dlse2, causal=True, numerics=nm)
    assert (a[0][:, empty] == 0).all() and (a[0][:, ~empty] != 0).any(-1).all()
    assert torch.equal(a[1], b[1]) and torch.equal(a[2], b[2]) and torch.equal(a[0], b[0])


def test_backward_recomputes_p_with_the_hardware_exp2(monkeypatch):
    """SM100's forward takes the polynomial exp2 on some columns; the backward recomputes P with
    MUFU.EX2 whatever the forward's exp2 knob (bitwise the same gradients for every knob value),
    and that choice shows: with the polynomial in its place the SM100 gradients change."""
    x = _inputs(BF16, 128, 1, 256, 256, 2, 2, seed=5)
    q, k, v, do = x["q"], x["k"], x["v"], x["do"]
    nm = FA4Numerics.sm100(BF16, 128, seqlen_q=256)
    assert nm.emu_freq > 0
    out, lse = attention(q, k, v, return_lse=True, numerics=nm)
    runs = [
        attention_backward(q, k, v, out, lse, do, numerics=dataclasses.replace(nm, exp2=e))
        for e in ("mixed", "emulated", "hardware")
    ]
    assert all(torch.equal(r[i], runs[0][i]) for r in runs[1:] for i in range(3))
    from fa4.ex2 import ex2_emulation_2

    monkeypatch.setattr(mb, "hardware_exp2", lambda t: ex2_emulation_2(t.contiguous(), 3))
    poly = attention_backward(q, k, v, out, lse, do, numerics=nm)
    assert all(not torch.equal(poly[i], runs[0][i]) for i in range(3))


def test_deterministic_order_is_deterministic_and_only_orders_dq():
    """bwd_deterministic (causal: dq_accum takes the KV blocks last first): two runs bitwise
    equal; against the ascending order only dQ moves, by float32 reassociation (a few bf16 ULP
    on a few elements at most)."""
    x = _inputs(BF16, 64, 1, 256, 512, 2, 2, seed=6)
    q, k, v, do = x["q"], x["k"], x["v"], x["do"]
    nm = FA4Numerics.for_inputs("sm100", q, k, v, True)
    det = dataclasses.replace(nm, bwd_deterministic=True)
    out, lse = attention(q, k, v, causal=True, return_lse=True, numerics=nm)
    a, b = (attention_backward(q, k, v, out, lse, do, dlse=x["dlse"], causal=True, numerics=det) for _ in range(2))
    assert all(torch.equal(a[i], b[i]) for i in range(3))
    c = attention_backward(q, k, v, out, lse, do, dlse=x["dlse"], causal=True, numerics=nm)
    assert torch.equal(a[1], c[1]) and torch.equal(a[2], c[2]) and not torch.equal(a[0], c[0])
    diff = (a[0].float() - c[0].float()).abs() / ulp_of(c[0].float().abs(), format_of(BF16)).float()
    assert float(diff.max()) <= 2 and float((diff > 0).float().mean()) < 0.05


def test_p_and_ds_are_rounded_before_the_gradient_mmas(monkeypatch):
    """P goes to the input dtype and dS to ``ds_dtype`` (default the input dtype) through
    ``round_to`` (cvt.rn) before the dV / dK / dQ products; ds_dtype moves dK and dQ, not dV."""
    x = _inputs(BF16, 64, 1, 128, 256, 2, 2, seed=9)
    q, k, v, do = x["q"], x["k"], x["v"], x["do"]
    nm = FA4Numerics.for_inputs("sm100", q, k, v)
    out, lse = attention(q, k, v, return_lse=True, numerics=nm)
    calls, real = [], mb.round_to
    monkeypatch.setattr(mb, "round_to", lambda t, dt, **kw: calls.append((tuple(t.shape), dt)) or real(t, dt, **kw))
    base = attention_backward(q, k, v, out, lse, do, numerics=nm)
    assert calls == [((2, 128, 256), BF16)] * 2  # one query block of (batch x head) rows, P then dS
    calls.clear()
    f16 = attention_backward(q, k, v, out, lse, do, numerics=dataclasses.replace(nm, ds_dtype=FP16))
    assert calls == [((2, 128, 256), BF16), ((2, 128, 256), FP16)]
    assert torch.equal(f16[2], base[2]) and not torch.equal(f16[0], base[0]) and not torch.equal(f16[1], base[1])
    same = attention_backward(q, k, v, out, lse, do, numerics=dataclasses.replace(nm, ds_dtype=BF16))
    assert all(torch.equal(same[i], base[i]) for i in range(3))


def test_gqa_heads_are_summed_in_float32_before_the_cast():
    """``_reduce_heads``: a group's float32 partials added head by head in float32, times the
    scale, one cast — not cast per head (dK of 3 heads whose sum is not a bf16 value)."""
    g = torch.Generator().manual_seed(7)
    part = torch.randn(1, 3, 5, 4, generator=g) * 100
    got = mb._reduce_heads(part, 1, 0.125, BF16)
    want = (((part[:, 0] + part[:, 1]) + part[:, 2]) * 0.125).to(BF16).unsqueeze(2)  # (b, sk, hk, c)
    assert torch.equal(got, want)
    per_head = sum(part[:, h].mul(0.125).to(BF16).float() for h in range(3)).to(BF16).unsqueeze(2)
    assert not torch.equal(got, per_head)


def test_plan_follows_production_tiles_and_knobs():
    sm90 = FA4Numerics.sm90()
    assert bwd_plan(sm90, 64, 64, False, False) == mb.BwdPlan(128, 128, 128, 256, 32, False)
    assert bwd_plan(sm90, 128, 128, False, False).tile_m == 80
    assert bwd_plan(sm90, 128, 128, True, False).tile_m == 64
    assert bwd_plan(sm90, 96, 96, False, False).post_threads == 128
    assert bwd_plan(sm90, 192, 128, False, False).tile_n == 96
    sm100 = FA4Numerics.sm100(BF16, 128)
    assert bwd_plan(sm100, 128, 128, False, False).dq_keys == 256  # 2-CTA: the pair's keys
    assert bwd_plan(sm100, 64, 64, False, False).dq_keys == 128
    knobs = dataclasses.replace(sm100, bwd_tile_m=64, bwd_tile_n=32, bwd_dq_tiles=1, bwd_deterministic=True)
    assert bwd_plan(knobs, 128, 128, True, False) == mb.BwdPlan(64, 32, 32, 128, 32, True)
    assert not bwd_plan(knobs, 128, 128, False, False).dq_descending
    hd256 = bwd_plan(FA4Numerics.sm100(BF16, 256), 256, 256, True, False)
    assert hd256 == mb.BwdPlan(128, 128, 128, 128, 32, False, True)  # dedicated kernels
    generic = dataclasses.replace(FA4Numerics.sm100(BF16, 256), bwd_hd256_generic=True)
    assert bwd_plan(generic, 256, 256, False, False) == mb.BwdPlan(128, 64, 128, 128, 32, False, False)
    with pytest.raises(NotImplementedError):
        bwd_plan(FA4Numerics.sm100(BF16, 256), 256, 128, False, False)
    with pytest.raises(ValueError):
        FA4Numerics(bwd_tile_m=0)


def test_autograd_hook_runs_the_backward_model_on_the_forward_outputs():
    """``attention``'s autograd gradients are ``attention_backward`` on the saved inputs, the
    returned out and LSE, dO and dLSE, with the caller's numerics (bwd knobs included)."""
    x = _inputs(FP16, 64, 1, 200, 150, 4, 2, seed=10, sink=True)
    q, k, v, sink = x["q"], x["k"], x["v"], x["sink"]
    kw = {"causal": True, "softcap": 5.0}
    nm = dataclasses.replace(FA4Numerics.sm90(FP16, 64, causal=True), bwd_tile_m=32, bwd_deterministic=True)
    got = _grads(lambda *a, **k: attention(*a, return_lse=True, numerics=nm, **k), x, FP16, **kw)
    out, lse = attention(q, k, v, learnable_sink=sink, return_lse=True, numerics=nm, **kw)
    dlse = torch.where(torch.isfinite(lse), x["dlse"], 0)
    want = attention_backward(q, k, v, out, lse, x["do"], dlse=dlse, learnable_sink=sink, numerics=nm, **kw)
    assert all(torch.equal(got[n], w) for n, w in zip(("dq", "dk", "dv", "dsink"), want))
    other = attention_backward(
        q, k, v, out, lse, x["do"], dlse=dlse, learnable_sink=sink, numerics=FA4Numerics.sm90(), **kw
    )
    assert not torch.equal(other[1], want[1])  # the knobs reached the backward


def test_hook_leaves_the_forward_alone():
    """Without requires_grad (or under no_grad) attention returns plain tensors; with it, the same
    bits and a grad_fn; fp8 has no backward (production takes bf16 / fp16 only)."""
    x = _inputs(BF16, 64, 1, 64, 96, 2, 2, seed=8)
    q, k, v = x["q"], x["k"], x["v"]
    plain = attention(q, k, v, causal=True, return_lse=True)
    assert all(t.grad_fn is None and not t.requires_grad for t in plain)
    qg = q.clone().requires_grad_()
    with torch.no_grad():
        assert attention(qg, k, v, causal=True).grad_fn is None
    tracked = attention(qg, k, v, causal=True, return_lse=True)
    assert tracked[0].grad_fn is not None
    assert torch.equal(tracked[0], plain[0]) and torch.equal(tracked[1], plain[1])
    (dq,) = torch.autograd.grad(tracked[1].sum(), qg)  # out unused: dO None, taken as zeros
    assert dq.dtype == BF16 and torch.isfinite(dq).all() and (dq != 0).any()
    f8 = [t.to(torch.float8_e4m3fn) for t in (q, k, v)]
    out = attention(f8[0].requires_grad_(), f8[1], f8[2])
    with pytest.raises(NotImplementedError):
        out.float().sum().backward()


@pytest.mark.parametrize("det", [False, pytest.param(True, marks=pytest.mark.slow)])  # True: 20 s CPU
def test_blocked_model_gives_the_unblocked_models_bits(det):
    """The model streams query blocks and skips the tiles production skips; on finite inputs that
    changes no bit against the unblocked version the H200 fidelity was measured with
    (``tests/model_bwd_oracle.py``): every axis of CASES, both dQ orders, the sink, dLSE."""
    for name, dtype, d, shape, kw, sink, arch in CASES:
        x = _inputs(dtype, d, *shape, seed=sum(map(ord, name)) + 1, sink=sink)
        q, k, v = x["q"], x["k"], x["v"]
        nm = FA4Numerics.for_inputs(arch, q, k, v, kw.get("causal", False), kw.get("window_size", (None, None)))
        nm = dataclasses.replace(nm, bwd_deterministic=det)
        out, lse = attention(q, k, v, return_lse=True, numerics=nm, learnable_sink=x["sink"], **kw)
        args = (q, k, v, out, lse, x["do"])
        kw2 = dict(kw, dlse=torch.where(torch.isfinite(lse), x["dlse"], 0), learnable_sink=x["sink"], numerics=nm)
        got, want = attention_backward(*args, **kw2), attention_backward_unblocked(*args, **kw2)
        for n, a, b in zip(("dq", "dk", "dv", "dsink"), got, want):
            assert (a is None and b is None) or torch.equal(a.view(torch.int16), b.view(torch.int16)), (name, n)


def test_tiles_production_skips_keep_non_finite_values_out():
    """Causal, tiles 64 x 64: a NaN in K at key 200 lies beyond the diagonal of query blocks 0-2,
    whose tiles with that key production never computes (``get_m_block_min_max``): their dQ
    stays finite.  Block 3 computes the tile, where dS = 0 on the masked scores of rows 192-199
    meets the NaN in the dQ MMA (0 * NaN), as on the device.  The unblocked version forms that
    product for every row and poisons them all — the reason the model skips, not just speed."""
    x = _inputs(BF16, 64, 1, 256, 256, 2, 2, seed=11)
    q, k, v, do = x["q"], x["k"], x["v"], x["do"]
    k[0, 200, 0, 0] = math.nan
    nm = dataclasses.replace(FA4Numerics.for_inputs("sm90", q, k, v, True), bwd_tile_m=64, bwd_tile_n=64)
    out, lse = attention(q, k, v, causal=True, return_lse=True, numerics=nm)
    assert torch.isfinite(out[0, :200]).all()  # the forward masks the NaN score away
    dq = attention_backward(q, k, v, out, lse, do, causal=True, numerics=nm)[0]
    assert torch.isfinite(dq[0, :192, 0]).all() and torch.isnan(dq[0, 192:, 0]).any(-1).all()
    old = attention_backward_unblocked(q, k, v, out, lse, do, causal=True, numerics=nm)[0]
    assert torch.isnan(old[0, :192, 0]).any(-1).all()


def test_schedule_is_production_block_range():
    """``_schedule`` against ``get_m_block_min_max`` worked by hand: causal sq 300 > sk 200 (tile
    64, groups of 128 keys): group 0 starts at query block (0 + 100) // 64 = 1, group 1 at
    (128 + 100) // 64 = 3; local (32, 16) with sq == sk: group g spans query blocks
    [(128 g - 16) // 64, ceil((128 (g + 1) + 32) / 64))."""
    plan = mb.BwdPlan(64, 64, 128, 128, 32, False)
    got = [(b.i0, b.i1, b.j0, b.j1, b.jn) for b in mb._schedule(plan, 300, 200, True, (None, None))]
    assert got == [(64, 128, 0, 128, 0), (128, 192, 0, 128, 128), (192, 256, 0, 200, 128), (256, 300, 0, 200, 200)]
    got = [(b.i0, b.i1, b.j0, b.j1, b.jn) for b in mb._schedule(plan, 256, 256, False, (32, 16))]
    assert got == [(0, 64, 0, 128, 0), (64, 128, 0, 256, 128), (128, 192, 0, 256, 256), (192, 256, 128, 256, 256)]


HD256 = [
    ("bf16-hd256-causal", BF16, (2, 256, 384, 2, 2), {"causal": True}),
    ("fp16-hd256-gqa", FP16, (1, 200, 320, 4, 2), {}),
    ("bf16-hd256-gqa-causal-sq>sk", BF16, (1, 300, 200, 6, 2), {"causal": True}),
]


@pytest.mark.parametrize("name,dtype,shape,kw", HD256, ids=[c[0] for c in HD256])
def test_sm100_hd256_dedicated_backward_meets_fa_criterion(name, dtype, shape, kw):
    """SM100's dedicated head-dim-256 kernels (``bwd_plan(...).hd256``): dS scaled before its
    cast for dQ, dQ and GQA dK/dV as single MMA chains.  Within FA's criterion against FP64,
    and visibly a different computation from the generic kernel the environment variable
    selects (same inputs, some bits differ)."""
    x = _inputs(dtype, 256, *shape, seed=sum(map(ord, name)))
    x["dlse"] = torch.zeros_like(x["dlse"])  # the dedicated kernels take no LSE gradient
    ref = _grads(lambda *a, **k: _attn(*a, torch.float64, **k), x, torch.float64, **kw)
    pt = _grads(_lowprec(dtype), x, dtype, **kw)
    q, k, v = x["q"], x["k"], x["v"]
    nm = FA4Numerics.for_inputs("sm100", q, k, v, kw.get("causal", False))
    assert bwd_plan(nm, 256, 256, kw.get("causal", False), False).hd256
    out, lse = attention(q, k, v, return_lse=True, numerics=nm, **kw)
    got = dict(zip(("dq", "dk", "dv"), attention_backward(q, k, v, out, lse, x["do"], numerics=nm, **kw)))
    for n in ("dq", "dk", "dv"):
        err, allowed = fa_bwd_check(got[n], ref[n], pt[n], 0.0)
        assert torch.isfinite(got[n]).all() and err <= allowed, (n, err, allowed)
    gen = dataclasses.replace(nm, bwd_hd256_generic=True)
    other = attention_backward(q, k, v, out, lse, x["do"], numerics=gen, **kw)
    assert not torch.equal(other[0], got["dq"])  # the scale's place moves dQ's roundings


def test_hd256_dq_chain_and_scaled_ds():
    """``_dq_chain``: one accumulator, each block's exact sum rounded once with it — not a float32
    sum of rounded block tiles (``_dq_block``, the generic dq_accum)."""
    plan = mb.BwdPlan(128, 128, 2, 128, 32, False, True)
    kk = torch.ones(1, 4, 1, dtype=torch.float64)
    # keys in blocks of 2: 1 + 0, then 2**-24 + 2**-50 (not a float32).  Chained, the exact
    # 1 + 2**-24 + 2**-50 lies above the midpoint of 1 and 1 + 2**-23: up.  As float32 tiles
    # added (the generic dq_accum), the second tile rounds to 2**-24 first and 1 + 2**-24 ties
    # to even: 1.
    ds = torch.tensor([[[1.0, 0.0, 2.0**-24, 2.0**-50]]], dtype=torch.float64)
    assert float(mb._dq_chain(ds, kk, plan)) == 1 + 2.0**-23 and float(mb._dq_block(ds, kk, plan)) == 1.0


@pytest.mark.parametrize(
    "kw,why",
    [({"softcap": 5.0}, "softcap"), ({"window_size": (64, 0)}, "local"), ({"sink": True}, "learnable_sink"),
     ({"dlse": True}, "LSE")],
)  # fmt: skip
def test_hd256_refusals_are_production_s(kw, why):
    x = _inputs(BF16, 256, 1, 64, 64, 2, 2, seed=12, sink=kw.get("sink", False))
    q, k, v = x["q"], x["k"], x["v"]
    nm = FA4Numerics.sm100(BF16, 256)
    call = {n: w for n, w in kw.items() if n in ("softcap", "window_size")}
    out, lse = attention(q, k, v, return_lse=True, numerics=nm, learnable_sink=x["sink"], **call)
    dlse = x["dlse"] if kw.get("dlse") else None
    with pytest.raises(NotImplementedError, match=why):
        attention_backward(q, k, v, out, lse, x["do"], dlse=dlse, learnable_sink=x["sink"], numerics=nm, **call)


def test_accumulator_reductions_flush_subnormals():
    """dq_accum and the GQA dk/dv_accum take ``cp.reduce.async.bulk...add.f32``, which flushes
    subnormal inputs and results (PTX ISA; the static backward audit found it in every compiled
    kernel): a subnormal dQ tile adds nothing, a sum landing in the subnormal range becomes a
    zero of its sign; the single-head accumulator (MHA dK/dV, no reduction) keeps subnormals."""
    plan = mb.BwdPlan(128, 128, 1, 128, 32, False)
    ds = torch.tensor([[[2.0**-100, 2.0**-100]]], dtype=torch.float64)
    kk = torch.tensor([[[2.0**-30], [2.0**-27]]], dtype=torch.float64)  # tiles 2**-130 and 2**-127
    assert float(mb._dq_block(ds, kk, plan)) == 0.0  # IEEE: 2**-130 + 2**-127, a subnormal sum
    assert float(mb.reduce_add(torch.tensor([2.0**-125]), torch.tensor([-(2.0**-125) + 2.0**-140]))) == 0.0
    assert torch.signbit(mb.reduce_add(torch.tensor([-(2.0**-125)]), torch.tensor([2.0**-126])))
    sub = torch.full((1, 2, 1, 1), 2.0**-130)
    assert float(mb._reduce_heads(sub, 1, 1.0, torch.float32).sum()) == 0.0  # GQA: reduced, flushed
    assert float(mb._reduce_heads(sub, 2, 1.0, torch.float32)[0, 0, 0, 0]) == 2.0**-130  # MHA: kept


def test_tensor_core_backward_chains_dv_through_the_mma():
    """``mma="tensor_core"``: dV over two query blocks is the wgmma chain ``tc_dot(P2^T, dO2,
    C=tc_dot(P1^T, dO1))`` (``flash_bwd_sm90.py``: ``zero_init=not dKV_accumulate``), with S
    summed by the tensor cores and P = ex2(fma(S, scale_log2, -lse_log2)) cast to bf16 — the
    accumulator goes into the second MMA as its C, not added after it.  Measured on the H200
    with this knob and MUFU: every dQ/dK/dV bit of production's deterministic SM90 backward on
    all 10 backward fidelity cases (docs/backward.md)."""
    from fa4.primitives import LOG2_E, fma, hardware_exp2, scales
    from numerics.fp import to_f32
    from numerics.tensor_core import tc_dot

    g = torch.Generator().manual_seed(5)
    q, do = (torch.randn(1, 256, 1, 64, generator=g).bfloat16() for _ in range(2))
    k, v = (torch.randn(1, 64, 1, 64, generator=g).bfloat16() for _ in range(2))
    nm = dataclasses.replace(FA4Numerics.sm90(torch.bfloat16, 64), mma="tensor_core")
    assert bwd_plan(nm, 64, 64, False, False).tile_m == 128  # two query blocks
    out, lse = attention(q, k, v, return_lse=True, numerics=nm)
    dv = attention_backward(q, k, v, out, lse, do, numerics=nm)[2][0, :, 0]
    s = tc_dot(q[0, :, 0].double().unsqueeze(1), k[0, :, 0].double().unsqueeze(0))  # (rows, keys)
    sl2 = scales(64, None, 0.0)[2]
    pt = hardware_exp2(fma(s, sl2, -(lse[0, 0] * to_f32(LOG2_E)).unsqueeze(1))).bfloat16().double().T
    dot = do[0, :, 0].double().T  # (d, rows)
    first = tc_dot(pt[:, None, :128], dot[None, :, :128])
    want = tc_dot(pt[:, None, 128:], dot[None, :, 128:], first).bfloat16()
    assert torch.equal(dv.view(torch.int16), want.view(torch.int16))
    # the chain itself, in float32 (``_accumulate_keys``): what an add after the MMA would break
    acc = torch.zeros(1, 64, 64)
    for i0, jn in ((0, 0), (128, 64)):  # every key first met in block 0: zero_init there
        blk = mb._MBlock(i0, i0 + 128, 0, 64, jn)
        ab = (pt[None, :, i0 : i0 + 128], do[:, i0 : i0 + 128, 0].double())
        mb._accumulate_keys(acc, slice(0, 1), ab, blk, True, "tensor_core")
    chain = tc_dot(pt[:, None, 128:], dot[None, :, 128:], first)
    assert torch.equal(acc[0].view(torch.int32), chain.view(torch.int32))
    added = (first.double() + tc_dot(pt[:, None, 128:], dot[None, :, 128:]).double()).float()
    assert not torch.equal(added, chain)


@pytest.mark.parametrize("dv, multiple, chunks", [(256, 64, 2), (192, 64, 3), (128, 32, 1)])
def test_preprocess_folds_a_threads_chunks_element_major(dv, multiple, chunks):
    """D = rowsum(O * dO) as the preprocess kernel folds it: each thread's chunks of 8 columns,
    element 0 of every chunk, then element 1, ... (production's sm_90a PTX at head dims 192 and
    256: columns 0, 128, 1, 129, ...), then the warp butterfly.  The chunk-major order left 2 dQ
    and 12 dK elements of the H200's head-dim-256 backward different (docs/backward.md)."""
    g = torch.Generator().manual_seed(9)
    out, do = (torch.randn(2, 3, 5, dv, generator=g).bfloat16() for _ in range(2))
    prod = out.float() * do.float()
    threads = dv // chunks // 8
    lanes = []
    for t in range(threads):
        cols = [c * (dv // chunks) + t * 8 + e for e in range(8) for c in range(chunks)]
        acc = prod[..., cols[0]].clone()
        for col in cols[1:]:
            acc = acc + prod[..., col]
        lanes.append(acc)
    want = mb.butterfly(torch.stack(lanes, -1))
    assert torch.equal(mb.row_dot(out, do, multiple).view(torch.int32), want.view(torch.int32))
