"""The field's backward bug classes (tests/bugged_backward.py), each on a small case that exercises
its axis: FlashAttention's backward criterion against FP64 gradients (numerics.grad_reference)
fails for the bugged gradient(s) — exactly those — while the clean kernel and the FA4 model
(``fa4.model.attention``'s backward) pass every gradient on the same case."""

import functools
import math

import pytest
import torch

import tests.bugged_backward as bb
from fa4.model import attention as fa4_attention
from numerics.call import AttentionCall
from numerics.fp import format_of, ulp_of
from numerics.grad_reference import attention_grad_reference
from numerics.reference import visible_mask

BF16 = torch.bfloat16
GRADS = ("dq", "dk", "dv", "dsink")

# name -> (d, dv, (b, sq, sk, hq, hk), attention kwargs, q multiplier, sink offset or None, seed)
CASES = {
    "plain": (64, 64, (2, 128, 128, 2, 2), {}, 1.0, None, 532),
    "short": (64, 64, (2, 64, 64, 2, 2), {}, 1.0, None, 169),
    "unaligned-dv": (64, 72, (1, 128, 160, 2, 2), {}, 1.0, None, 1214),
    "causal": (64, 64, (1, 192, 192, 2, 2), {"causal": True}, 1.0, None, 633),
    "gqa": (64, 64, (1, 128, 128, 4, 2), {}, 1.0, None, 313),
    "softcap": (64, 64, (1, 128, 128, 2, 2), {"softcap": 8.0}, 6.0, None, 752),
    "sink": (64, 64, (2, 128, 128, 2, 2), {}, 1.0, 4.5, 437),
}

# bug -> (case, the gradients the criterion must fail: exactly these, the others must pass, and the
# least error / allowance ratio required of them)
CATALOGUE = {
    "dq_no_scale": ("plain", {"dq"}, 2.0),
    # Caught only narrowly: the degree-1 exp2's few-% errors in P are ~1-2x what PyTorch's bf16
    # backward gets wrong.  Over 9 seeds at this shape 8 fail dq and dk by 1.25-2.2x and one fails
    # dk by 1.04x while dq passes (0.98x); at seqlen 128 two seeds in eight pass both: the criterion
    # can miss this bug.  This seed is picked for a clear catch (~2x on both).
    "ds_other_exp2": ("short", {"dq", "dk"}, 1.0),
    "dv_unaligned_cols": ("unaligned-dv", {"dv"}, 2.0),
    "no_causal_in_bwd": ("causal", {"dq", "dk", "dv"}, 2.0),
    "gqa_one_head": ("gqa", {"dk", "dv"}, 2.0),
    "softcap_no_chain": ("softcap", {"dq", "dk"}, 2.0),
    "sink_grad_missing": ("sink", {"dsink"}, 2.0),
}


def fa_bwd_check(x, ref, pt, softcap):
    """FA's backward criterion (flash-attention/tests/cute/test_flash_attn.py): max|x - ref| <=
    rtol * max|pt - ref| + 2 * rounding (+ 3e-4 with softcap; rtol 2, 3 with softcap), rounding
    the gradient dtype's unit roundoff times max|ref|.  Returns (error, allowed)."""
    r = ref.double()
    err = float((x.double() - r).abs().max())
    base = float((pt.double() - r).abs().max())
    rounding = format_of(x.dtype).unit_roundoff * float(r.abs().max())
    return err, (3 if softcap else 2) * base + 2 * rounding + (3e-4 if softcap else 0.0)


def dsink_check(x, ref, pt):
    """dsink, elementwise (as tests/test_model_bwd.py): |x - ref| <= 2 max|pt - ref| + 2 ULP of
    the sink dtype at |ref|.  Returns (error, allowed) at the worst head (largest ratio)."""
    r = ref.double()
    err = (x.double() - r).abs()
    tol = 2 * float((pt.double() - r).abs().max()) + 2 * ulp_of(r, format_of(x.dtype)).double()
    i = int((err / tol).argmax())
    return float(err[i]), float(tol[i])


def verdicts(got, ref, pt, softcap):
    """{gradient: (error, allowed)} for every gradient present."""
    res = {n: fa_bwd_check(got[n], ref[n], pt[n], softcap) for n in ("dq", "dk", "dv")}
    if "dsink" in got:
        res["dsink"] = dsink_check(got["dsink"], ref["dsink"], pt["dsink"])
    return res


def _lowprec(q, k, v, *, causal=False, window_size=(None, None), softcap=0.0, learnable_sink=None):
    """Straightforward attention by PyTorch autograd in the input dtype (FA's
    ``attention_ref(upcast=False)``): (out, lse)."""
    b, sq, hq, d = q.shape
    sk, rep = k.shape[1], hq // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    s = torch.einsum("bihd,bjhd->bhij", q * (1.0 / math.sqrt(d)), k)
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~visible_mask(sq, sk, causal=causal, window_size=window_size), -math.inf)
    if learnable_sink is not None:
        s = torch.cat([s, learnable_sink.view(1, hq, 1, 1).expand(b, hq, sq, 1)], dim=-1)
    m = s.detach().amax(-1, keepdim=True)
    e = torch.exp(s - m)
    den = e.sum(-1, keepdim=True)
    out = torch.einsum("bhij,bjhc->bihc", e[..., :sk] / den, v)
    return out, (m + torch.log(den)).squeeze(-1)


@functools.cache
def _inputs(case):
    d, dv, (b, sq, sk, hq, hk), _, qmul, sink, seed = CASES[case]
    g = torch.Generator().manual_seed(seed)
    x = {
        "q": (torch.randn(b, sq, hq, d, generator=g) * qmul).to(BF16),
        "k": torch.randn(b, sk, hk, d, generator=g).to(BF16),
        "v": torch.randn(b, sk, hk, dv, generator=g).to(BF16),
        "do": torch.randn(b, sq, hq, dv, generator=g).to(BF16),
        "dlse": torch.randn(b, hq, sq, generator=g).to(BF16).float(),
        # a sink near each row's LSE (~4.9 here) carries ~40% of the softmax weight
        "sink": None if sink is None else (sink + 0.5 * torch.randn(hq, generator=g)).to(BF16),
    }
    return x


def _grads(fn, case):
    """Gradients of sum(out * dO) + sum(lse * dLSE) w.r.t. q, k, v (and the sink), leaves bf16."""
    x, kw = _inputs(case), CASES[case][3]
    leaves = [x[n].clone().requires_grad_() for n in ("q", "k", "v")]
    sink = None if x["sink"] is None else x["sink"].clone().requires_grad_()
    out, lse = fn(*leaves, learnable_sink=sink, **kw)
    loss = (out * x["do"].to(out.dtype)).sum() + (lse * x["dlse"].to(lse.dtype)).sum()
    got = torch.autograd.grad(loss, leaves + ([sink] if sink is not None else []))
    return dict(zip(GRADS, got))


@functools.cache
def _refs(case):
    """(FP64 gradients, PyTorch bf16 gradients) of a case."""
    x, kw = _inputs(case), CASES[case][3]
    ref = attention_grad_reference(
        x["q"], x["k"], x["v"], x["do"], call=AttentionCall.from_kwargs(**kw, learnable_sink=x["sink"]), dlse=x["dlse"]
    )
    pt = _grads(_lowprec, case)
    return ref, pt


def _check(fn, case):
    ref, pt = _refs(case)
    return verdicts(_grads(fn, case), ref, pt, CASES[case][3].get("softcap", 0.0))


def _fa4(q, k, v, **kw):
    return fa4_attention(q, k, v, return_lse=True, **kw)


def _clean(q, k, v, **kw):
    return bb.clean(q, k, v, return_lse=True, **kw)


def test_catalogue_is_complete():
    assert set(CATALOGUE) == set(bb.BUGS)
    for bug in bb.BUGS:
        assert getattr(bb, f"bug_{bug}").__doc__ == bb.BUGS[bug]


@pytest.mark.parametrize("bug", list(CATALOGUE))
def test_criterion_catches_the_bugged_gradient(bug):
    case, failing, margin = CATALOGUE[bug]
    res = _check(lambda q, k, v, **kw: bb.attention(q, k, v, bug=bug, return_lse=True, **kw), case)
    failed = {n for n, (err, allowed) in res.items() if not err <= allowed}
    assert failed == failing, (bug, res)
    assert all(res[n][0] > margin * res[n][1] for n in failing), (bug, res)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kernel", ["clean", "fa4"])
def test_clean_kernel_and_fa4_model_pass(case, kernel):
    res = _check(_clean if kernel == "clean" else _fa4, case)
    assert set(res) == ({"dq", "dk", "dv", "dsink"} if CASES[case][5] is not None else {"dq", "dk", "dv"})
    for n, (err, allowed) in res.items():
        assert err <= allowed, (kernel, case, n, err, allowed)


@pytest.mark.parametrize("seed", range(8))
def test_the_backward_bound_catches_ds_from_another_exp2_where_the_criterion_can_miss(seed):
    """At seqlen 128, FA's criterion passes this bug on 2 seeds of 8; the per-element backward
    bound (FA4 SM90 numerics: dS from the same hardware exp2 as the LSE) fails it on every seed
    on dq and dk, and holds for the clean kernel (measured: bug 4.0-5.4x the bound, clean <= 0.39)."""
    from fa4.model import FA4Numerics
    from numerics.backward_bound import backward_error_bound
    from numerics.metrics import bound_check

    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(2, 128, 2, 64, generator=g).bfloat16() for _ in range(4))
    ref = attention_grad_reference(q, k, v, do, call=AttentionCall())
    nm = FA4Numerics.for_inputs("sm90", q, k, v, False, (None, None))
    for fn, broken in ((bb.clean, set()), (bb.bug_ds_other_exp2, {"dq", "dk"})):
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
        out, lse = fn(qq, kk, vv, return_lse=True)
        grads = dict(zip(("dq", "dk", "dv"), torch.autograd.grad(out, (qq, kk, vv), do), strict=True))
        bound = backward_error_bound(q, k, v, do, out.detach(), lse.detach(), nm, call=AttentionCall(), reference=ref)
        violated = {n for n, t in grads.items() if bound_check(t, ref[n], bound[n])["violations"]}
        assert violated == broken, (fn.__name__, violated)
