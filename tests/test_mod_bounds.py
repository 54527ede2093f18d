"""The forward and backward bounds with mods (numerics.forward_bound, numerics.backward_bound,
the hooks of numerics.mod_library; derivation in docs/mods.md, "Bounds with mods"): the library hooks bound
what they claim, the bounds hold on the fa4 model with every library mod (dense, block-sparse,
per-head), the softcap flag is the softcap score_mod's bound, an unbounded mod gives +inf where
it applies, a bound ignoring the mod's slope is beaten, and a wrong score_mod_bwd is caught."""

import dataclasses
import math

import pytest
import torch

from fa4.model import FA4Numerics, attention
from numerics.backward_bound import backward_error_bound
from numerics.call import AttentionCall
from numerics.forward_bound import MUFU, UNIT_ROUNDOFF, dot_products, forward_error_bound, mod_score
from numerics.grad_reference import attention_grad_reference
from numerics.mod_library import SCORE_MODS, SOFTCAP_CAP, make_mask_mod, make_score_mod
from numerics.mods import MaskMod, ScoreMod, bind_aux_scalars, block_sparse_from_mask, index_grid
from numerics.reference import attention_reference
from tests.production_defects import SM90_GQA_SCORE_MOD_BWD

U = UNIT_ROUNDOFF
SHAPE = dict(batch=2, heads_q=6, seqlen_q=96, seqlen_k=128)  # 6 heads: ALiBi slopes 2**(-8(h+1)/6) round


def _grid_scores(n=20001, top=300.0):
    """float32 scores over [-top, top], dense near 0 and at the softcap's knee."""
    s = torch.cat([torch.linspace(-top, top, n), torch.linspace(-3, 3, n), torch.logspace(-30, 2, 200)])
    return s.float()


def _idx(n):
    """Index tensors for n scores laid along the key axis: batch 1, head 1 (ALiBi slope
    2**(-8/3), not a power of two: its bias rounds), query 40, keys 0..n-1 folded to the
    table's range (the bias mods read per head and distance)."""
    b, h, q, _ = index_grid(2, 6, 96, 128)
    kv = (torch.arange(n) % 128).view(1, 1, 1, -1)
    return b[1:2], h[:, 1:2], q[:, :, 40:41], kv


def _library_mod(name):
    """The library score mod with its runtime scalars bound, as a call hands them (``temperature``'s)."""
    sm, aux = make_score_mod(name, **SHAPE)
    sm, _, _ = bind_aux_scalars(sm.params.get("aux_scalars"), score_mod=sm)
    return sm, aux


@pytest.mark.parametrize("name", SCORE_MODS)
def test_value_error_hook_covers_the_float32_form(name):
    sm, aux = _library_mod(name)
    s32 = _grid_scores().view(1, 1, 1, -1)
    idx = _idx(s32.shape[-1])
    exact = sm.fn(s32.double(), *idx, aux)
    got = sm.fn(s32, *idx, aux).double()  # the model's form: each op rounded to float32
    if name == "softcap":  # production's MUFU.TANH: any float32 within TANH_ABS of tanh(x^); its extremes
        x32 = s32 / SOFTCAP_CAP
        e = MUFU["tanh_abs"] - 2.0**-24  # minus a float32 rounding's worth: the emulated output stays inside
        worst = [(SOFTCAP_CAP * (torch.tanh(x32.double()) + d).float()).double() for d in (e, -e)]
        got = torch.stack([w - exact for w in worst] + [got - exact]).abs().amax(0) + exact
    bound = sm.value_error(s32.double(), *idx, aux)
    err = (got - exact).abs()
    assert (err <= bound).all(), float((err - bound).max())
    assert float((err / bound).max()) > 0.05  # not vacuous: some element uses a twentieth of it


@pytest.mark.parametrize("name", SCORE_MODS)
def test_slope_and_curvature_hooks_are_sups(name):
    sm, aux = _library_mod(name)
    centre = torch.linspace(-60, 60, 241, dtype=torch.float64).view(1, 1, 1, -1)
    idx = _idx(centre.shape[-1])
    for half in (1e-3, 0.5, 7.0):
        lo, hi = centre - half, centre + half
        slope, curv = sm.slope(lo, hi, *idx, aux), sm.curvature(lo, hi, *idx, aux)
        for t in torch.linspace(0, 1, 33, dtype=torch.float64):
            s = lo + t * (hi - lo)
            d1 = sm.grad(torch.ones_like(s), s, *idx, aux)
            h = 1e-5
            d2 = (sm.grad(torch.ones_like(s), s + h, *idx, aux) - sm.grad(torch.ones_like(s), s - h, *idx, aux)) / (
                2 * h
            )
            assert (d1.abs() <= slope * (1 + 1e-12)).all()
            assert (d2.abs() <= curv * (1 + 1e-6) + 1e-9).all()
    if name == "softcap":  # the sup is reached: sech^2 at 0 is 1, |f''| peaks at 4 / (3 sqrt(3) cap)
        z = torch.zeros(1, 1, 1, 1, dtype=torch.float64)
        assert float(sm.slope(z - 1, z + 1, *_idx(1), aux)) == 1.0
        peak = float(sm.curvature(z - 40, z + 40, *_idx(1), aux))
        assert abs(peak - 4 / (3 * math.sqrt(3) * SOFTCAP_CAP)) < 1e-12


@pytest.mark.parametrize("name", SCORE_MODS)
def test_grad_error_hook_covers_the_float32_backward(name):
    sm, aux = _library_mod(name)
    s32 = _grid_scores(4001).view(1, 1, 1, -1)
    idx = _idx(s32.shape[-1])
    g32 = (torch.randn(s32.shape, generator=torch.Generator().manual_seed(1)) * 3).float()
    exact = sm.grad(g32.double(), s32.double(), *idx, aux)
    got = sm.grad(g32, s32, *idx, aux).double()
    bound = sm.grad_error(g32.double().abs(), s32.double(), *idx, aux)
    assert ((got - exact).abs() <= bound).all()


def test_softcap_hooks_are_quasi_convex():
    """The bound evaluates value_error / grad_error at the ends of the score's interval
    (``hook_at_ends``): softcap's must not dip in between, i.e. be nondecreasing in |s|."""
    sm, aux = make_score_mod("softcap", **SHAPE)
    s = torch.linspace(0, 200, 400001, dtype=torch.float64).view(1, 1, 1, -1)
    idx = _idx(s.shape[-1])
    ve = sm.value_error(s, *idx, aux).flatten()
    ge = sm.grad_error(torch.ones_like(s), s, *idx, aux).flatten()
    assert (ve.diff() >= 0).all() and (ge.diff() >= 0).all()
    assert torch.equal(sm.value_error(-s, *idx, aux), sm.value_error(s, *idx, aux))


def test_softcap_flag_is_the_softcap_score_mod_bound():
    """One derivation: the flag's bound is the library softcap mod's (production's softcap *is*
    that score_mod)."""
    q, k, v, _ = _inputs(torch.bfloat16, sq=32, sk=48)
    q = q * 3
    nm = FA4Numerics.for_inputs("sm90", q, k, v, False, (None, None))
    sm, aux = make_score_mod("softcap", batch=1, heads_q=2, seqlen_q=32, seqlen_k=48)
    flag = forward_error_bound(q, k, v, nm, call=AttentionCall(softcap=SOFTCAP_CAP))
    mod = forward_error_bound(q, k, v, nm, call=AttentionCall(score_mod=sm, aux_tensors=aux))
    for a, b in zip(flag, mod):
        assert torch.allclose(a, b, rtol=1e-12, atol=0)


def test_causal_mask_mod_bound_is_the_causal_flag_bound():
    """A mask only changes visibility: the causal mask_mod's bounds are the causal flag's, bit for
    bit (forward and backward; the same numerics and the same model output held to both)."""
    q, k, v, do = _inputs(torch.float16, sq=48, sk=64)
    mm, aux = make_mask_mod("causal", batch=1, heads_q=2, seqlen_q=48, seqlen_k=64)
    nm = FA4Numerics.for_inputs("sm90", q, k, v, True, (None, None))
    flag = forward_error_bound(q, k, v, nm, call=AttentionCall(causal=True))
    mod = forward_error_bound(q, k, v, nm, call=AttentionCall(mask_mod=mm, aux_tensors=aux))
    assert all(torch.equal(a, b) for a, b in zip(flag, mod))
    out, lse = attention(q, k, v, causal=True, return_lse=True, numerics=nm)
    bf = backward_error_bound(q, k, v, do, out, lse, nm, call=AttentionCall(causal=True))
    bm = backward_error_bound(q, k, v, do, out, lse, nm, call=AttentionCall(mask_mod=mm, aux_tensors=aux))
    assert all(torch.equal(bf[n], bm[n]) for n in ("dq", "dk", "dv"))


def _inputs(dt, b=1, sq=96, sk=128, hq=2, hk=1, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, hq, d, generator=g).to(dt)
    k = torch.randn(b, sk, hk, d, generator=g).to(dt)
    v = torch.randn(b, sk, hk, d, generator=g).to(dt)
    do = torch.randn(b, sq, hq, d, generator=g).to(dt)
    return q, k, v, do


def _per_head_mask():
    """Head h sees keys kv <= q + 8 h - 40 (head 0's first rows see none), batch-independent."""
    return MaskMod("per_head", lambda b, h, q, kv, aux: kv <= q + 8 * h - 40 + 32, per_head=True)


def _call(q, k, score="", mask="", block=()):
    sh = dict(batch=q.shape[0], heads_q=q.shape[2], seqlen_q=q.shape[1], seqlen_k=k.shape[1])
    kw, aux = {}, []
    if score == "temperature":  # a user mod with f' = 4 (docs: the slope's role shows at f' > 1)
        kw["score_mod"] = _temperature(4.0, 4.0)
    elif score:
        sm, a = make_score_mod(score, aux_base=0, seed=5, **sh)
        kw["score_mod"], aux = sm, aux + a
    mm = None
    if mask == "per_head":
        mm = _per_head_mask()
    elif mask:
        mm, a = make_mask_mod(mask, aux_base=len(aux), seed=5, **sh)
        aux = aux + a
    if mm is not None:
        kw["mask_mod"] = mm
        if block:
            bs = block_sparse_from_mask(mm, batch=sh["batch"], heads=sh["heads_q"], seqlen_q=sh["seqlen_q"],
                                        seqlen_k=sh["seqlen_k"], block_size=block, aux=aux)  # fmt: skip
            kw["block_sparse_tensors"] = bs
    kw["aux_tensors"] = aux
    return kw


# name: (dtype, arch, score_mod, mask_mod, block size)
CASES = {
    "bf16_alibi": (torch.bfloat16, "sm90", "alibi", "", ()),
    "fp16_relbias_document": (torch.float16, "sm90", "relbias", "document", ()),
    "bf16_softcap_causal": (torch.bfloat16, "sm100", "softcap", "causal", ()),
    "fp16_document_block_sparse": (torch.float16, "sm90", "", "document", (128, 128)),
    "bf16_alibi_window_block_sparse": (torch.bfloat16, "sm90", "alibi", "sliding_window", (128, 128)),
    "fp16_softcap_per_head": (torch.float16, "sm90", "softcap", "per_head", ()),
    "fp16_temperature_causal": (torch.float16, "sm90", "temperature", "causal", ()),
}


def _run(name):
    dt, arch, score, mask, block = CASES[name]
    q, k, v, do = _inputs(dt, hq=4, hk=2, seed=len(name))
    kw = _call(q, k, score, mask, block)
    nm = FA4Numerics.for_inputs(arch, q, k, v, False, (None, None), **({"block_sparse": block} if block else {}))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = attention(*leaves, return_lse=True, numerics=nm, **kw)
    return q, k, v, do, kw, nm, leaves, out, lse


def _within(err, bound, what):
    assert bound.shape == err.shape, what
    bad = err > bound
    assert not bad.any(), (what, int(bad.sum()), float((err - bound)[bad].max()))
    pos = bound > 0
    assert (err[~pos] == 0).all(), what  # a zero bound only where the model is exact (empty rows)
    return float((err[pos] / bound[pos]).max())


@pytest.mark.parametrize("name", list(CASES))
def test_forward_bound_holds_on_the_model(name):
    q, k, v, _, kw, nm, _, out, lse = _run(name)
    ref, rl = attention_reference(q, k, v, call=AttentionCall.from_kwargs(**kw), return_lse=True)
    ob, lb = forward_error_bound(q, k, v, nm, call=AttentionCall.from_kwargs(**kw), reference=(ref, rl))
    assert torch.isfinite(ob).all() and torch.isfinite(lb).all()
    tight = _within((out.detach().double() - ref).abs(), ob, "out")
    _within((lse.detach().double() - rl).abs().nan_to_num(0.0), lb, "lse")
    assert tight > 0.05, tight  # measured 0.35-0.65: the bound is not vacuous


def _check_backward(name):
    q, k, v, do, kw, nm, leaves, out, lse = _run(name)
    got = torch.autograd.grad((out.double() * do.double()).sum(), leaves)
    ref = attention_grad_reference(q, k, v, do, call=AttentionCall.from_kwargs(**kw))
    bnd = backward_error_bound(
        q, k, v, do, out.detach(), lse.detach(), nm, call=AttentionCall.from_kwargs(**kw), reference=ref
    )
    for n, g in zip(("dq", "dk", "dv"), got):
        assert torch.isfinite(bnd[n]).all(), n
        tight = _within((g.double() - ref[n]).abs(), bnd[n], n)
        assert tight > 0.05, (n, tight)  # measured 0.4-0.85


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_backward_bound_holds_on_the_model(name):
    _check_backward(name)


@pytest.mark.parametrize("name", ["fp16_relbias_document", "bf16_softcap_causal", "fp16_temperature_causal"])
def test_backward_bound_holds_on_the_model_fast_tier(name):
    """Two of CASES in the fast tier (the slow tier runs them all)."""
    _check_backward(name)


def _temperature(c: float, slope_hook: float) -> ScoreMod:
    """``f(s) = c s`` with c a power of two: the float32 product is exact (value_error 0), so
    the float32 score's own error reaches f multiplied by the slope c."""
    return ScoreMod(
        "temperature", lambda s, b, h, q, kv, aux: s * c, lambda g, s, b, h, q, kv, aux: g * c,
        value_error=lambda s, b, h, q, kv, aux: torch.zeros_like(s),
        slope=lambda lo, hi, b, h, q, kv, aux: torch.full_like(lo, slope_hook),
        grad_error=lambda g, s, b, h, q, kv, aux: torch.zeros_like(s),
        curvature=lambda lo, hi, b, h, q, kv, aux: torch.zeros_like(lo),
    )  # fmt: skip


def test_a_bound_ignoring_the_slope_is_beaten():
    """The score step of the bound (``mod_score``) against the kernel's float32 score
    ``c * fl(fl32(q.k) * scale32)``: within the bound with the slope c, beyond it somewhere when
    the slope is taken as 1.  (At the output, normal 16-bit inputs hide the difference: the P
    cast's 2**-11 dominates the bound there; the score step is where the slope enters.)"""
    c = 1024.0
    q, k, _, _ = _inputs(torch.bfloat16, b=1, sq=64, sk=64, hq=1, hk=1, d=16, seed=3)
    scale = 1 / 3  # not a float32: its rounding is part of the score's error
    dot, e_dot, _ = dot_products(q, k, k)
    dot32 = torch.einsum("bihd,bjhd->bhij", q.float(), k.float())  # a float32 sum, in some order
    f32 = (dot32 * torch.tensor(scale, dtype=torch.float32)).double() * c  # the score, then the exact * c
    err = (f32 - c * scale * dot).abs()
    s32 = float(torch.tensor(scale, dtype=torch.float32))
    for slope, holds in ((c, True), (1.0, False)):
        _, _, f, e_post = mod_score(dot, e_dot, scale, s32, _temperature(c, slope), None)
        assert torch.allclose(f, c * scale * dot, rtol=1e-15, atol=0)
        assert bool((err <= e_post).all()) == holds, (slope, float((err / e_post).max()))


def test_unbounded_mod_is_inf_where_it_applies():
    """A user mod without hooks: the bounds are +inf on every row it reaches and 0 on rows the
    mask leaves empty (there the output is exactly 0, mod or not)."""
    q, k, v, do = _inputs(torch.float16, sq=48, sk=64)
    sm, aux = make_score_mod("alibi", batch=1, heads_q=2, seqlen_q=48, seqlen_k=64)
    bare = ScoreMod("no_hooks", sm.fn, sm.grad)
    kw = dict(score_mod=bare, aux_tensors=aux, mask_mod=_per_head_mask())
    nm = FA4Numerics.for_inputs("sm90", q, k, v, False, (None, None))
    ref, rl = attention_reference(q, k, v, call=AttentionCall.from_kwargs(**kw), return_lse=True)
    empty = torch.isinf(rl)  # (b, h, sq): head 0's first rows
    assert empty.any() and not empty.all()
    ob, lb = forward_error_bound(q, k, v, nm, call=AttentionCall.from_kwargs(**kw), reference=(ref, rl))
    assert torch.isinf(lb[~empty]).all() and (lb[empty] == 0).all()
    e_out = empty.permute(0, 2, 1)  # (b, sq, h)
    assert torch.isinf(ob[~e_out]).all() and (ob[e_out] == 0).all()
    out, lse = attention(q, k, v, return_lse=True, numerics=nm, **kw)
    bb = backward_error_bound(q, k, v, do, out, lse, nm, call=AttentionCall.from_kwargs(**kw))
    assert torch.isinf(bb["dq"][~e_out]).all() and (bb["dq"][e_out] == 0).all()
    # the same call with the hooks is finite everywhere
    kw["score_mod"] = sm
    assert torch.isfinite(forward_error_bound(q, k, v, nm, call=AttentionCall.from_kwargs(**kw))[0]).all()


def test_a_wrong_score_mod_bwd_violates_the_backward_bound():
    """The model's backward with a score_mod_bwd 3% off (the derivative of a seeded bug), held
    to the bound of the true mod: dQ and dK leave it, dV (no f') does not."""
    q, k, v, do = _inputs(torch.float16, sq=64, sk=96)
    kw = _call(q, k, "relbias")
    sm = kw["score_mod"]
    wrong = dataclasses.replace(sm, grad=lambda g, s, *idx: g * 1.03)
    nm = FA4Numerics.for_inputs("sm90", q, k, v, False, (None, None))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = attention(*leaves, return_lse=True, numerics=nm, **{**kw, "score_mod": wrong})
    got = dict(zip(("dq", "dk", "dv"), torch.autograd.grad((out.double() * do.double()).sum(), leaves)))
    ref = attention_grad_reference(q, k, v, do, call=AttentionCall.from_kwargs(**kw))
    bnd = backward_error_bound(
        q, k, v, do, out.detach(), lse.detach(), nm, call=AttentionCall.from_kwargs(**kw), reference=ref
    )
    over = {n: bool(((got[n].double() - ref[n]).abs() > bnd[n]).any()) for n in got}
    assert over == {"dq": True, "dk": True, "dv": False}, over


# production SM90 on the H200: (score_mod, mask_mod, block size); sizes that fit SM90's block-sparse
# tiles (block_q a multiple of 128, block_k equal to tile_n)
# (the bias score mods under GQA meet production's backward defect: tests/production_defects.py)
_DEFECT = {"marks": SM90_GQA_SCORE_MOD_BWD}
GPU_CASES = [pytest.param("alibi", "", (), **_DEFECT), pytest.param("relbias", "document", (), **_DEFECT),
             ("softcap", "", ()), ("", "document", (128, 128)),
             pytest.param("alibi", "sliding_window", (128, 128), **_DEFECT), ("softcap", "prefix_lm", ())]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("score,mask,block", GPU_CASES)
def test_bounds_hold_on_production_sm90(score, mask, block, dt):
    """Production's kernel (``fa4.production.flash_attn``, library mods through ``fa4.mods``),
    forward and backward, against the bounds with SM90 numerics: 0 violations."""
    from fa4.mods import build_mods
    from fa4.production import flash_attn

    b, sq, sk, hq, hk, d = 2, 256, 384, 4, 2, 128
    g = torch.Generator().manual_seed(11)
    q, k, v, do = (
        torch.randn(b, n, h, d, generator=g).to(dt).cuda() for n, h in ((sq, hq), (sk, hk), (sk, hk), (sq, hq))
    )
    kw = build_mods(score_mod=score, mask_mod=mask, block_sparse=block, batch=b, heads_q=hq, seqlen_q=sq, seqlen_k=sk,
                    seed=5, device="cuda")  # fmt: skip
    nm = FA4Numerics.for_inputs("sm90", q, k, v, False, (None, None), block_sparse=tuple(block) or None)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = flash_attn(*leaves, return_lse=True, **kw)
    ref, rl = attention_reference(q, k, v, call=AttentionCall.from_kwargs(**kw), return_lse=True)
    ob, lb = forward_error_bound(q, k, v, nm, call=AttentionCall.from_kwargs(**kw), reference=(ref, rl))
    _within((out.detach().double() - ref).abs(), ob, "out")
    _within((lse.detach().double() - rl).abs().nan_to_num(0.0), lb, "lse")
    got = torch.autograd.grad(out, leaves, do)
    gref = attention_grad_reference(q, k, v, do, call=AttentionCall.from_kwargs(**kw))
    bnd = backward_error_bound(
        q, k, v, do, out.detach(), lse.detach(), nm, call=AttentionCall.from_kwargs(**kw), reference=gref
    )
    for n, gr in zip(("dq", "dk", "dv"), got):
        _within((gr.double() - gref[n]).abs(), bnd[n], n)
