"""numerics.grad_reference: the FP64 attention gradients, against autograd and exact arithmetic."""

import math

import mpmath
import pytest
import torch

from numerics.call import AttentionCall
from numerics.grad_reference import (
    CHUNK_BUDGET,
    _contract,
    _visible_rows,
    attention_grad_reference,
    default_chunk_rows,
    exact_grad_elements,
)
from numerics.reference import attention_reference, visible_mask

GRADS = ("dq", "dk", "dv")


def _inputs(seed=0, b=2, sq=7, sk=11, hq=4, hk=2, d=16, dv=8, dtype=torch.bfloat16, amp=1.0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, sq, hq, d, generator=g) * amp).to(dtype)
    k = (torch.randn(b, sk, hk, d, generator=g) * amp).to(dtype)
    v = torch.randn(b, sk, hk, dv, generator=g).to(dtype)
    do = torch.randn(b, sq, hq, dv, generator=g).to(dtype)
    return q, k, v, do, torch.randn(hq, generator=g), torch.randn(b, hq, sq, generator=g)


def _autograd(q, k, v, do, *, softmax_scale=None, causal=False, window_size=(None, None), softcap=0.0, sink, dlse):
    """Plain float64 attention differentiated by torch.autograd: expanded kv heads, logsumexp
    over the logits with the sink as an extra column, empty rows patched with where."""
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    leaves = [q, k, v]
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = 1 / math.sqrt(d) if softmax_scale is None else softmax_scale
    ke, ve = k.repeat_interleave(hq // hk, 2), v.repeat_interleave(hq // hk, 2)
    s = torch.einsum("bihd,bjhd->bhij", q, ke) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    vis = visible_mask(sq, sk, causal=causal, window_size=window_size)
    s = s.masked_fill(~vis, -math.inf)
    empty = torch.zeros(sq, dtype=torch.bool)
    if sink is not None:
        sink = sink.double().requires_grad_()
        leaves.append(sink)
        s = torch.cat([s, sink.view(1, hq, 1, 1).expand(b, hq, sq, 1)], dim=-1)
    else:
        empty = ~vis.any(-1)
        s = torch.where(empty[:, None], 0.0, s)  # finite stand-ins: NaN-free gradients in the dead branch
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None])[..., :sk]
    out = torch.where(empty[None, :, None, None], 0.0, torch.einsum("bhij,bjhc->bihc", p, ve))
    lse = torch.where(empty, -math.inf, lse)
    dlse = torch.zeros_like(lse) if dlse is None else dlse.double()
    grads = torch.autograd.grad([out, lse], leaves, [do.double(), dlse])
    res = dict(zip(["dq", "dk", "dv", "dsink"], grads))
    return res | {"out": out.detach(), "lse": lse.detach()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| over the finite entries of b (the rest must match exactly)."""
    fin = torch.isfinite(b)
    assert torch.equal(a[~fin], b[~fin])
    return ((a - b)[fin].abs().max() / b[fin].abs().max().clamp_min(1e-300)).item() if fin.any() else 0.0


CASES = {
    "plain": ({}, {}),
    "gqa-causal-sq<sk-softcap-sink-dlse": (dict(sq=5, sk=13), dict(causal=True, softcap=3.0, sink=1, dlse=1)),
    "causal-sq>sk-empty-rows-dlse": (dict(sq=9, sk=4), dict(causal=True, dlse=1)),
    "causal-sq>sk-empty-rows-sink": (dict(sq=9, sk=4), dict(causal=True, sink=1, dlse=1)),
    "window-softcap-sink": ({}, dict(window_size=(2, 1), softcap=4.0, sink=1)),
    "window-left-unbounded-scale": ({}, dict(window_size=(None, 0), softmax_scale=0.7, dlse=1)),
    "mqa-window-sq>sk": (dict(sq=9, sk=6, hk=1), dict(window_size=(1, 1), sink=1, dlse=1)),
}


def _case(name, **over):
    shape, kw = CASES[name]
    q, k, v, do, sink, dlse = _inputs(**(shape | over))
    kw = dict(kw)
    kw["learnable_sink"] = sink if kw.pop("sink", 0) else None
    kw["dlse"] = dlse if kw.pop("dlse", 0) else None
    return (q, k, v, do), kw


def _grad_kw(kw: dict) -> dict:
    """A case's keywords as the gradient references take them: the call's bundle as ``call``,
    ``dlse`` apart."""
    rest = dict(kw)
    return {"dlse": rest.pop("dlse", None), "call": AttentionCall.from_kwargs(**rest)}


@pytest.mark.parametrize("name", CASES)
def test_closed_form_matches_autograd(name):
    args, kw = _case(name)
    got = attention_grad_reference(*args, **_grad_kw(kw))
    want = _autograd(*args, **{("sink" if n == "learnable_sink" else n): x for n, x in kw.items()})
    names = GRADS + ("out", "lse") + (("dsink",) if kw["learnable_sink"] is not None else ())
    assert set(got) == set(names)
    worst = {n: _rel(got[n], want[n]) for n in names}
    assert max(worst.values()) <= 1e-13, worst


def test_out_and_lse_are_the_forward_reference():
    args, kw = _case("gqa-causal-sq<sk-softcap-sink-dlse")
    got = attention_grad_reference(*args, **_grad_kw(kw))
    kw.pop("dlse")
    out, lse = attention_reference(*args[:3], call=AttentionCall.from_kwargs(**kw), return_lse=True)
    assert _rel(got["out"], out) <= 1e-15 and _rel(got["lse"], lse) <= 1e-15


@pytest.mark.parametrize("name", ["gqa-causal-sq<sk-softcap-sink-dlse", "causal-sq>sk-empty-rows-sink"])
def test_chunked_equals_unchunked(name):
    args, kw = _case(name, sq=9)
    full = attention_grad_reference(*args, **_grad_kw(kw), chunk_rows=9)
    for rows in (1, 2, 4, None):
        got = attention_grad_reference(*args, **_grad_kw(kw), chunk_rows=rows)
        for n, x in full.items():
            assert _rel(got[n], x) <= 1e-15, (rows, n)


def test_default_chunk_rows_keeps_the_budget():
    for b, hq, sk in [(1, 32, 65536), (4, 16, 8192), (2, 8, 1), (1, 128, 1 << 22)]:
        rows = default_chunk_rows(batch=b, heads_q=hq, seqlen_k=sk)
        assert rows >= 1
        assert rows == 1 or 4 * 8 * b * hq * sk * rows <= CHUNK_BUDGET


@pytest.mark.parametrize(
    "causal,window", [(False, (None, None)), (True, (None, None)), (True, (3, 1)), (False, (0, 2))]
)
@pytest.mark.parametrize("sq,sk", [(7, 11), (11, 7), (5, 5)])
def test_visible_rows_are_visible_mask(causal, window, sq, sk):
    full = visible_mask(sq, sk, causal=causal, window_size=window)
    for r0, r1 in [(0, sq), (0, 1), (2, 5), (sq - 1, sq)]:
        assert torch.equal(_visible_rows(r0, r1, sq, sk, causal=causal, window_size=window, device="cpu"), full[r0:r1])


EXACT_CASES = {
    # GQA, sink, softcap with tanh near 1 (|r/cap| up to ~6), dlse, causal with seqlen_q < seqlen_k
    "causal-softcap-sink-dlse": (dict(sq=10, sk=14, amp=2.0), dict(causal=True, softcap=2.0, sink=1, dlse=1)),
    # empty rows (with a sink), a window that leaves keys unseen, softmax_scale
    "window-sq>sk-sink": (dict(sq=12, sk=9), dict(window_size=(1, 0), softmax_scale=0.4, sink=1, softcap=5.0)),
}


def _certify(dtype, name, dps=30):
    shape, kw = EXACT_CASES[name]
    q, k, v, do, sink, dlse = _inputs(seed=5, **shape, dtype=dtype)
    kw = dict(kw)
    kw["learnable_sink"] = sink if kw.pop("sink", 0) else None
    kw["dlse"] = dlse if kw.pop("dlse", 0) else None
    b, sq, hq, _ = q.shape
    sk = k.shape[1]
    sample = dict(
        dq_rows=[(0, 0, 0), (1, sq // 2, 3), (1, sq - 1, 2)],
        dk_rows=[(0, 0, 0), (1, sk // 2, 1), (1, sk - 1, 0)],
        dv_rows=[(1, 0, 1), (0, sk // 2, 0), (0, sk - 1, 1)],
        dsink_heads=range(hq),
    )
    return (q, k, v, do), kw, exact_grad_elements(q, k, v, do, **sample, **_grad_kw(kw), dps=dps)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float32])
@pytest.mark.parametrize("name", EXACT_CASES)
def test_exact_elements_certify_the_fp64_reference(dtype, name):
    """Every sampled element within 1e-13 of the exact value, relative to the largest |element| of
    its row (dsink: to itself); exact zeros (empty rows, unseen keys) must be exact."""
    args, kw, ex = _certify(dtype, name)
    ref = attention_grad_reference(*args, **_grad_kw(kw))
    worst = 0.0
    for n in GRADS:
        for (bi, x, h), row in ex[n].items():
            want = torch.tensor([float(e) for e in row], dtype=torch.float64)
            got = ref[n][bi, x, h]
            if not want.any():
                assert not got.any(), (n, bi, x, h)
                continue
            worst = max(worst, ((got - want).abs().max() / want.abs().max()).item())
    for h, e in ex["dsink"].items():
        worst = max(worst, abs(ref["dsink"][h].item() - float(e)) / abs(float(e)))
    assert worst <= 1e-13, worst


def test_saturated_softcap_keeps_its_digits():
    """Every logit deep in tanh's tail (r/cap 8 .. 32): the chain factor sech^2 is 4e-7 .. 1e-27.
    Computed as 1 - tanh^2 in float64 it would keep 1e-16 absolute, i.e. no digit at all past
    r/cap ~ 19 (tanh rounds to 1); the reference's cosh**-2 keeps them all."""
    g = torch.Generator().manual_seed(7)
    q = (torch.rand(1, 6, 2, 16, generator=g) + 1).bfloat16()  # q.k in [16, 64], r = q.k / 4 in [4, 16]
    k = (torch.rand(1, 8, 1, 16, generator=g) + 1).bfloat16()
    v = torch.randn(1, 8, 1, 4, generator=g).bfloat16()
    do = torch.randn(1, 6, 2, 4, generator=g).bfloat16()
    kw = dict(softcap=0.5, causal=True)
    ref = attention_grad_reference(q, k, v, do, call=AttentionCall.from_kwargs(**kw))
    rows = [(0, i, h) for i in range(6) for h in range(2)]
    ex = exact_grad_elements(
        q, k, v, do, call=AttentionCall.from_kwargs(**kw), dq_rows=rows, dk_rows=[(0, j, 0) for j in range(8)]
    )
    for n in ("dq", "dk"):
        for (bi, x, h), row in ex[n].items():
            want = torch.tensor([float(e) for e in row], dtype=torch.float64)
            assert ((ref[n][bi, x, h] - want).abs().max() / want.abs().max()).item() <= 1e-13, (n, x, h)


def test_exact_elements_do_not_depend_on_the_precision():
    """dps 30 against dps 60: the exact elements are converged far below what they certify."""
    _, _, lo = _certify(torch.bfloat16, "causal-softcap-sink-dlse", dps=30)
    _, _, hi = _certify(torch.bfloat16, "causal-softcap-sink-dlse", dps=60)
    old = mpmath.mp.dps
    try:
        mpmath.mp.dps = 60
        for n in GRADS:
            for key, row in lo[n].items():
                scale = max(abs(x) for x in hi[n][key]) or 1
                assert all(abs(a - c) <= 1e-25 * scale for a, c in zip(row, hi[n][key])), (n, key)
        for h, e in lo["dsink"].items():
            assert abs(e - hi["dsink"][h]) <= 1e-25 * abs(hi["dsink"][h])
    finally:
        mpmath.mp.dps = old


def test_exact_restores_precision_refuses_float64_and_skips_nonfinite_rows():
    q, k, v, do, sink, _ = _inputs(sq=4, sk=6)
    old = mpmath.mp.dps
    with pytest.raises(ValueError, match="learnable_sink"):
        exact_grad_elements(q, k, v, do, call=AttentionCall(), dsink_heads=[0])
    assert mpmath.mp.dps == old
    with pytest.raises(ValueError, match="26 significant bits"):
        exact_grad_elements(q.double(), k, v, do, call=AttentionCall(), dq_rows=[(0, 0, 0)])
    k[0, 5, 0, 0] = math.nan  # key 5 of kv head 0: under causal (sq 4, sk 6) only query 3 sees it
    ex = exact_grad_elements(
        q, k, v, do, call=AttentionCall(causal=True), dq_rows=[(0, 3, 0), (0, 2, 0)], dk_rows=[(0, 5, 0), (0, 5, 1)]
    )
    assert ex["dq"][0, 3, 0] is None and ex["dq"][0, 2, 0] is not None
    assert ex["dk"][0, 5, 0] is None and ex["dk"][0, 5, 1] is not None


def test_unseen_keys_and_empty_rows_get_exact_zeros_despite_nonfinite_inputs_there():
    """Window (1, 0) with seqlen_q 4 < seqlen_k 9: query i sees keys i+4, i+5, so keys 0..3 are
    unseen; causal with seqlen_q 9 > seqlen_k 4: queries 0..4 see nothing.  NaN and inf planted
    exactly there reach no gradient."""
    q, k, v, do, sink, dlse = _inputs(sq=4, sk=9)
    k[:, :4] = math.nan
    v[:, :3] = math.inf
    v[:, 3] = -math.inf
    for sk_ in (None, sink):
        r = attention_grad_reference(q, k, v, do, call=AttentionCall(window_size=(1, 0), learnable_sink=sk_), dlse=dlse)
        assert (r["dk"][:, :4] == 0).all() and (r["dv"][:, :4] == 0).all()
        assert all(torch.isfinite(r[n]).all() for n in r) and r["dk"][:, 4:].abs().min() > 0
    q, k, v, do, sink, dlse = _inputs(sq=9, sk=4)
    q[:, :5] = math.nan
    do[:, :5] = math.inf
    dlse[:, :, :5] = math.nan
    r = attention_grad_reference(q, k, v, do, call=AttentionCall(causal=True), dlse=dlse)
    assert (r["dq"][:, :5] == 0).all() and all(torch.isfinite(r[n]).all() for n in GRADS)
    assert (r["out"][:, :5] == 0).all() and (r["lse"][..., :5] == -math.inf).all()
    ok = _autograd(q.nan_to_num(0), k, v, do.nan_to_num(0, 0, 0), causal=True, sink=None, dlse=dlse.nan_to_num(0))
    assert max(_rel(r[n], ok[n]) for n in GRADS) <= 1e-12  # and the visible rows are unaffected


def test_nan_at_a_visible_key_reaches_exactly_what_sees_it():
    """Window (1, 0), seqlen 8: query i sees keys i-1 and i.  NaN in key 5 of kv head 0 is seen by
    queries 5 and 6 of query heads 0 and 1: their dQ, the dK/dV of keys 4, 5, 6 of kv head 0 and
    dsink of heads 0, 1 turn NaN; nothing else does (a plain dS @ K would poison every dQ row)."""
    q, k, v, do, sink, dlse = _inputs(sq=8, sk=8)
    k[0, 5, 0, 3] = math.nan
    r = attention_grad_reference(q, k, v, do, call=AttentionCall(window_size=(1, 0), learnable_sink=sink), dlse=dlse)
    nan_dq = torch.zeros(2, 8, 4, dtype=torch.bool)
    nan_dq[0, 5:7, :2] = True
    assert torch.equal(torch.isnan(r["dq"]).any(-1), nan_dq) and torch.isnan(r["dq"][nan_dq]).all()
    nan_kv = torch.zeros(2, 8, 2, dtype=torch.bool)
    nan_kv[0, 4:7, 0] = True
    for n in ("dk", "dv"):
        assert torch.equal(torch.isnan(r[n]).any(-1), nan_kv), n
    assert torch.isnan(r["dsink"]).tolist() == [True, True, False, False]
    v[1, 2, 1, 0] = math.inf  # inf in v: seen by queries 2, 3 of heads 2, 3 in batch 1
    r = attention_grad_reference(q, k, v, do, call=AttentionCall(window_size=(1, 0), learnable_sink=sink), dlse=dlse)
    bad = ~torch.isfinite(r["dq"]).all(-1)
    nan_dq[1, 2:4, 2:] = True
    assert torch.equal(bad, nan_dq)


@pytest.mark.parametrize("eq,shape_x", [("bhgij,bjhd->bihgd", (1, 5, 2, 3)), ("bhgij,bihgd->bjhd", (1, 4, 2, 2, 3))])
def test_contract_is_ieee_over_visible_pairs(eq, shape_x):
    """_contract against a plain Python sum over visible pairs, on weights and inputs full of
    0, +-inf and NaN."""
    g = torch.Generator().manual_seed(1)
    vis = torch.rand(4, 5, generator=g) < 0.6
    pool = torch.tensor([0.0, 1.0, -2.0, 0.5, math.inf, -math.inf, math.nan], dtype=torch.float64)
    for _ in range(20):
        w = pool[torch.randint(0, 7, (1, 2, 2, 4, 5), generator=g)]
        w = torch.where(torch.rand(w.shape, generator=g) < 0.6, torch.randn(w.shape, generator=g, dtype=w.dtype), w)
        w = w.masked_fill(~vis, 0.0)
        x = pool[torch.randint(0, 7, shape_x, generator=g)]
        x = torch.where(torch.rand(x.shape, generator=g) < 0.7, torch.randn(x.shape, generator=g, dtype=x.dtype), x)
        got = _contract(eq, w, vis, x)
        naive = torch.einsum(eq, w, x)  # the index bookkeeping; its values are overwritten below
        want = torch.empty(naive.shape, dtype=naive.dtype)
        for idx in range(naive.numel()):
            o = list(torch.unravel_index(torch.tensor(idx), naive.shape))
            terms = []
            for i in range(4):
                for j in range(5):
                    if not vis[i, j]:
                        continue
                    if eq.endswith("bihgd"):  # o = (b, i, h, g, d); sum over j
                        if i != o[1]:
                            continue
                        terms.append(w[o[0], o[2], o[3], i, j].item() * x[o[0], j, o[2], o[4]].item())
                    else:  # o = (b, j, h, d); sum over g, i
                        if j != o[1]:
                            continue
                        terms += [w[o[0], o[2], gg, i, j].item() * x[o[0], i, o[2], gg, o[3]].item() for gg in range(2)]
            want.view(-1)[idx] = sum(terms)
        fin = torch.isfinite(want)
        assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.equal(
            got[~fin & ~want.isnan()], want[~fin & ~want.isnan()]
        )
        assert torch.allclose(got[fin], want[fin], rtol=1e-14, atol=1e-14)


def test_inputs_are_not_modified():
    args, kw = _case("gqa-causal-sq<sk-softcap-sink-dlse")
    args = tuple(a.double() for a in args)
    before = [a.clone() for a in args]
    attention_grad_reference(*args, **_grad_kw(kw))
    assert all(torch.equal(a, b) for a, b in zip(args, before))
