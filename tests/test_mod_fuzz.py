"""Random mods (audits.suites.strategies): the score chains' fn and grad against autograd, their
bound hooks against float32 evaluation and finite differences, the spec strings, the random
block masks' full / partial / empty blocks, and ``fuzz --mods`` drawing library mods inside a
kernel's declared domain."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from audits.checks.fuzz import MOD_BLOCKS, cases, fuzz
from audits.engine.options import RunOptions
from audits.suites import strategies as ms
from audits.suites.domain import Domain
from numerics.call import AttentionCall
from numerics.mods import block_sparse_from_mask, index_grid, visibility
from tests.production_defects import SM90_GQA_SCORE_MOD_BWD

#: few examples: each draws a whole chain and evaluates it on thousands of points
FEW = settings(max_examples=25, derandomize=True, database=None, deadline=None,
               suppress_health_check=list(HealthCheck))  # fmt: skip

B, H, SQ, SK = 2, 3, 24, 40


def _grid():
    return index_grid(B, H, SQ, SK)


def _scores(seed: int, spread: float = 40.0) -> torch.Tensor:
    """float32 scores (as float64) over several magnitudes: N(0, spread^2), some tiny, some 0."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(B, H, SQ, SK, generator=g, dtype=torch.float64) * spread
    s[..., :4] *= 1e-3
    s[..., 4] = 0.0
    return s.float().double()


def _f32_tanh_off(monkeypatch, sign: float):
    """torch.tanh on float32 off by ~TANH_ABS (MUFU.TANH's measured worst) in direction ``sign``:
    the bound must cover production's tanh, not only torch's."""
    orig = torch.tanh

    def tanh(x):
        if x.dtype == torch.float32:
            return (orig(x.double()) + sign * 0.999 * ms.TANH_ABS).float()
        return orig(x)

    monkeypatch.setattr(torch, "tanh", tanh)


@FEW
@given(ms.score_mods(heads_q=H))
def test_grad_is_the_derivative_of_fn(mod_aux):
    """grad(g, s) == g * d fn / ds (autograd, float64) for every drawn chain, to float64's
    absolute precision."""
    mod, aux = mod_aux
    b, h, q, kv = _grid()
    s = _scores(1).requires_grad_(True)
    (d,) = torch.autograd.grad(mod.fn(s, b, h, q, kv, aux).sum(), s)
    g = torch.randn(s.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    got = mod.grad(g, s.detach(), b, h, q, kv, aux)
    # absolute: tanh's 1 - t*t cancels where t ~ 1 in either evaluation (~1e-16 of |g|, both ways)
    assert bool(((got - g * d).abs() <= 1e-12 * g.abs() * (1 + d.abs())).all()), mod.name


def _value_check(mod, aux, seeds=(3, 4, 5)):
    b, h, q, kv = _grid()
    worst = 0.0
    for seed in seeds:
        s = _scores(seed)
        exact = mod.fn(s, b, h, q, kv, aux)
        got = mod.fn(s.float(), b, h, q, kv, [t.float() if t.is_floating_point() else t for t in aux]).double()
        bound = mod.value_error(s, b, h, q, kv, aux)
        err = (got - exact).abs()
        bad = err > bound
        assert not bool(bad.any()), f"{mod.name}: |fl32 - f64| {float(err[bad].max())} > bound {float(bound[bad][0])}"
        worst = max(worst, float((err / bound).max()))
    return worst


@FEW
@given(ms.score_mods(heads_q=H), st.sampled_from([0.0, 1.0, -1.0]))
def test_value_error_holds(monkeypatch, mod_aux, tanh_sign):
    """|fl32(fn)(s) - f(s)| <= value_error(s) on float32 scores, with torch's tanh and with a tanh
    off by MUFU.TANH's worst error either way."""
    mod, aux = mod_aux
    with monkeypatch.context() as m:
        if tanh_sign:
            _f32_tanh_off(m, tanh_sign)
        _value_check(mod, aux)


@FEW
@given(ms.score_mods(heads_q=H))
def test_error_hooks_grow_with_the_score_magnitude(mod_aux):
    """value_error and grad_error are nondecreasing in |s| (so the forward bound's
    ``hook_at_ends`` bounds them over an interval by its ends)."""
    mod, aux = mod_aux
    b, h, q, kv = _grid()
    s = _scores(6).abs()
    g = torch.ones_like(s)
    for hook, args in ((mod.value_error, ()), (mod.grad_error, (g,))):
        small, big = hook(*args, s, b, h, q, kv, aux), hook(*args, 1.5 * s, b, h, q, kv, aux)
        neg = hook(*args, -s, b, h, q, kv, aux)
        assert bool((small <= big).all()) and torch.equal(small, neg), mod.name


@pytest.mark.parametrize(
    "spec", ["rand:scale:0.3330000042915344", "rand:relpos:0.12300000339746475,hbias", "rand:hbias,scale:3.5"]
)
def test_value_error_is_tight_without_tanh(spec):
    """Without tanh the bound is a few u-terms: the worst error reaches a good part of it (a
    bound inflated tenfold would fail this)."""
    mod, aux = ms.score_mod_from_spec(spec, heads_q=H, seed=7)
    assert _value_check(mod, aux, seeds=range(3, 13)) > 0.2


@FEW
@given(ms.score_mods(heads_q=H), st.sampled_from([0.0, 1.0, -1.0]))
def test_grad_error_holds(monkeypatch, mod_aux, tanh_sign):
    """|fl32(grad)(g, s) - g f'(s)| <= grad_error(g, s), torch's tanh and MUFU-like tanh."""
    mod, aux = mod_aux
    b, h, q, kv = _grid()
    g = (torch.randn(B, H, SQ, SK, generator=torch.Generator().manual_seed(9), dtype=torch.float64)).float().double()
    with monkeypatch.context() as m:
        if tanh_sign:
            _f32_tanh_off(m, tanh_sign)
        for seed in (3, 4):
            s = _scores(seed)
            exact = mod.grad(g, s, b, h, q, kv, aux)
            got = mod.grad(g.float(), s.float(), b, h, q, kv, aux).double()
            bound = mod.grad_error(g, s, b, h, q, kv, aux)
            bad = (got - exact).abs() > bound
            assert not bool(bad.any()), f"{mod.name}: grad error {float((got - exact).abs()[bad].max())} > bound"


def _intervals(seed: int):
    g = torch.Generator().manual_seed(seed)
    c = torch.randn(B, H, SQ, SK, generator=g, dtype=torch.float64) * 30
    w = torch.rand(B, H, SQ, SK, generator=g, dtype=torch.float64) * 8
    return c - w, c + w


@FEW
@given(ms.score_mods(heads_q=H))
def test_slope_and_curvature_bound_the_derivatives(mod_aux):
    """On 17 points of each interval: |f'| (autograd) <= slope(lo, hi) and |f''| (autograd of the
    derivative) <= curvature(lo, hi)."""
    mod, aux = mod_aux
    b, h, q, kv = _grid()
    lo, hi = _intervals(11)
    slope = mod.slope(lo, hi, b, h, q, kv, aux)
    curv = mod.curvature(lo, hi, b, h, q, kv, aux)
    for t in torch.linspace(0, 1, 17, dtype=torch.float64):
        x = (lo + t * (hi - lo)).requires_grad_(True)
        (d1,) = torch.autograd.grad(mod.fn(x, b, h, q, kv, aux).sum(), x, create_graph=True)
        d2 = torch.autograd.grad(d1.sum(), x, allow_unused=True)[0] if d1.requires_grad else None
        d2 = torch.zeros_like(x) if d2 is None else d2  # a chain of linear ops: f'' = 0
        # + 1e-12: autograd's float64 1 - tanh^2 cancels where tanh ~ 1 (absolute noise ~1e-16
        # times the chain's factors, <= 4**4); the hooks' sech^2 = 1/cosh^2 does not
        assert bool((d1.abs() <= slope * (1 + 1e-12) + 1e-12).all()), mod.name
        assert bool((d2.abs() <= curv * (1 + 1e-12) + 1e-12).all()), mod.name


def test_slope_is_attained_for_one_tanh():
    """For one tanh op, the slope over an interval straddling 0 is 1 and far from 0 is sech^2 at
    the near end (exact, not merely an upper bound): finite differences reach it."""
    mod, aux = ms.score_mod_from_spec("rand:tanh:4.0", heads_q=1)
    b, h, q, kv = index_grid(1, 1, 1, 3)
    lo = torch.tensor([-3.0, 2.0, -9.0], dtype=torch.float64).view(1, 1, 1, 3)
    hi = torch.tensor([1.0, 5.0, -3.0], dtype=torch.float64).view(1, 1, 1, 3)
    got = mod.slope(lo, hi, b, h, q, kv, aux).flatten()
    want = torch.tensor([1.0, 1 / math.cosh(0.5) ** 2, 1 / math.cosh(0.75) ** 2], dtype=torch.float64)
    assert torch.allclose(got, want, rtol=1e-15)
    curv = mod.curvature(lo, hi, b, h, q, kv, aux).flatten()
    # the peak 2/(3 sqrt 3) * 2/c where y* = 0.658 (or -y*) lies in [lo, hi] / c: [-0.75, 0.25] and
    # [0.5, 1.25]; else the larger end: [-2.25, -0.75] peaks at -0.75
    peak = 2 / (3 * math.sqrt(3)) * 2 / 4
    end = 2 / 4 * math.tanh(0.75) / math.cosh(0.75) ** 2
    assert torch.allclose(curv, torch.tensor([peak, peak, end], dtype=torch.float64), rtol=1e-14)


@pytest.mark.parametrize(
    "spec", ["rand:scale:0.5,relpos:0.0625,tanh:15.0", "rand:hbias,tanh:8.0,scale:2.0", "rand:tanh:4.0,hbias,scale:4.0"]
)
def test_the_model_with_a_random_chain_stays_within_the_forward_bound(spec):
    """The SM90 model evaluating a chain in float32 stays within ``numerics.forward_bound`` built
    from the chain's hooks (out and LSE), on a case with scores of a few units."""
    from audits.kernels import get_kernel
    from fa4.model import FA4Numerics
    from numerics.forward_bound import forward_error_bound
    from numerics.reference import attention_reference

    g = torch.Generator().manual_seed(0)
    mk = lambda n, hh: torch.randn(1, n, hh, 128, generator=g).to(torch.bfloat16)  # noqa: E731
    q, k, v = mk(64, 2), mk(200, 1), mk(200, 1)
    sm, aux = ms.score_mod_from_spec(spec, heads_q=2, seed=1)
    kw = dict(softmax_scale=0.3, score_mod=sm, aux_tensors=aux)
    out, lse = get_kernel("fa4-model-sm90")(q, k, v, return_lse=True, **kw)
    ro, rl = attention_reference(
        q.double(), k.double(), v.double(), call=AttentionCall.from_kwargs(**kw), return_lse=True
    )
    nm = FA4Numerics.for_inputs("sm90", q, k, v, False, (None, None))
    ob, lb = forward_error_bound(q, k, v, nm, call=AttentionCall.from_kwargs(**kw), reference=(ro, rl))
    assert bool(((out.double() - ro).abs() <= ob).all()) and bool(((lse.double() - rl).abs() <= lb).all())


def test_spec_round_trip_and_refusals():
    ops = (ms.ScoreOp("scale", 0.5), ms.ScoreOp("hbias"), ms.ScoreOp("relpos", -0.0625), ms.ScoreOp("tanh", 15.0))
    spec = ms.score_spec(ops)
    assert spec == "rand:scale:0.5,hbias,relpos:-0.0625,tanh:15.0"
    a, aux_a = ms.score_mod_from_spec(spec, heads_q=H, seed=3)
    c, aux_c = ms.compose_score_mod(ops, heads_q=H, seed=3)
    b, h, q, kv = _grid()
    s = _scores(1)
    assert torch.equal(a.fn(s, b, h, q, kv, aux_a), c.fn(s, b, h, q, kv, aux_c)) and a.name == spec
    assert a.per_head and not ms.score_mod_from_spec("rand:tanh:15.0", heads_q=H)[0].per_head
    with pytest.raises(ValueError, match="is not a float32 number"):
        ms.parse_score_spec("rand:scale:0.1")
    with pytest.raises(ValueError, match="unknown score op 'cube'"):
        ms.parse_score_spec("rand:cube:2.0")
    with pytest.raises(ValueError, match=r"outside \(0.25, 4.0\)"):
        ms.parse_score_spec("rand:scale:8.0")


def test_aux_tensors_follow_aux_base():
    """A chain placed at aux_base 2 reads its hbias tables from there (other mods' aux before it)."""
    mod, aux = ms.score_mod_from_spec("rand:hbias,hbias", heads_q=H, aux_base=2, seed=1)
    b, h, q, kv = _grid()
    s = torch.zeros(1, 1, 1, 1, dtype=torch.float64)
    want = (aux[0].double() + aux[1].double()).view(1, H, 1, 1)
    assert torch.equal(mod.fn(s, b, h, q, kv, [None, None, *aux]).expand(1, H, 1, 1), want.expand(1, H, 1, 1))


def test_forms_are_lazy_and_named():
    """The CuTe forms are declared (production_kwargs finds them) without importing cutlass."""
    import sys

    mod, _ = ms.score_mod_from_spec("rand:relpos:0.25,tanh:8.0", heads_q=1)
    before = "cutlass" in sys.modules
    assert "cute" in mod.forms and "cute_bwd" in mod.forms
    assert ("cutlass" in sys.modules) == before  # asking which forms exist builds none


# ---- random masks -----------------------------------------------------------------------------

BLK = (8, 16)


@FEW
@given(ms.block_sparse_mods(batch=B, heads_q=H, seqlen_q=SQ + 3, seqlen_k=SK + 5, block_size=BLK))
def test_random_masks_classify_and_keep_rows(drawn):
    """The block sparsity of a drawn mask keeps exactly the mask's keys (partial blocks apply
    it, full blocks need not); every query row keeps a key; per-head / broadcast as declared."""
    mm, aux, bs = drawn
    kw = dict(batch=B, heads=H, seqlen_q=SQ + 3, seqlen_k=SK + 5, aux=aux)
    dense = visibility(mask_mod=mm, **kw).expand(B, H, SQ + 3, SK + 5)
    sparse = visibility(block_sparse=bs, **kw).expand(B, H, SQ + 3, SK + 5)
    assert torch.equal(dense, sparse)
    assert bool(dense.any(-1).all())
    assert bs.full.shape[1] == (H if mm.per_head else 1)


def test_random_masks_have_every_block_kind():
    """With all three kinds weighted, the blocks of one draw are full, partial and empty; with
    one kind alone, every block is that kind (bar rows needing a key)."""
    kw = dict(batch=1, heads=2, seqlen_q=64, seqlen_k=96, block_size=(16, 16), seed=4)
    mm, aux = ms.mask_mod_of(ms.random_mask(**kw))
    bs = block_sparse_from_mask(mm, batch=1, heads=2, seqlen_q=64, seqlen_k=96, block_size=(16, 16), aux=aux)
    empty = ~(bs.full | bs.partial)
    assert int(bs.full.sum()) > 0 and int(bs.partial.sum()) > 0 and int(empty.sum()) > 0
    for w, kind in (((1.0, 0.0, 0.0), "full"), ((0.0, 1.0, 0.0), "partial")):
        mm, aux = ms.mask_mod_of(ms.random_mask(**kw, weights=w))
        bs = block_sparse_from_mask(mm, batch=1, heads=2, seqlen_q=64, seqlen_k=96, block_size=(16, 16), aux=aux)
        assert bool(getattr(bs, kind).all()), kind
    for density in (0.999, 0.001):  # a partial block stays partial however dense or sparse inside
        pat = ms.random_mask(**kw, weights=(0.0, 1.0, 0.0), density=density, empty_rows=True)
        mm, aux = ms.mask_mod_of(pat)
        bs = block_sparse_from_mask(mm, batch=1, heads=2, seqlen_q=64, seqlen_k=96, block_size=(16, 16), aux=aux)
        assert bool(bs.partial.all()), density
    pat = ms.random_mask(**kw, weights=(0.0, 0.0, 1.0))
    assert int(pat.sum()) == 64 * 2  # empty everywhere but one key per row (the diagonal-aligned one)
    assert bool(ms.random_mask(**kw, weights=(0.0, 0.0, 1.0), empty_rows=True).sum() == 0)


def test_broadcast_masks():
    pat = ms.random_mask(batch=3, heads=4, seqlen_q=16, seqlen_k=16, block_size=(8, 8), seed=1, per_head=False)
    assert pat.shape == (1, 1, 16, 16)
    mm, aux = ms.mask_mod_of(pat)
    assert not mm.per_head
    b, h, q, kv = index_grid(3, 4, 16, 16)
    got = mm.fn(b, h, q, kv, aux).expand(3, 4, 16, 16)
    assert torch.equal(got, pat.expand(3, 4, 16, 16))
    pat = ms.random_mask(batch=3, heads=4, seqlen_q=16, seqlen_k=16, block_size=(8, 8), seed=1, per_batch=True)
    mm, aux = ms.mask_mod_of(pat)
    assert mm.per_head and torch.equal(mm.fn(b, h, q, kv, aux), pat)


def test_mask_fn_runs_under_vmap():
    """flex_attention evaluates a mask_mod on scalar index tensors under vmap: the reference
    form must stay tensor operations."""
    mm, aux = ms.mask_mod_of(ms.random_mask(batch=2, heads=2, seqlen_q=8, seqlen_k=8, block_size=(4, 4), seed=2))
    f = lambda b, h, q, kv: mm.fn(b, h, q, kv, aux)  # noqa: E731
    for dims in ((None, None, None, 0), (None, None, 0, None), (None, 0, None, None), (0, None, None, None)):
        f = torch.vmap(f, in_dims=dims)
    ar = lambda n: torch.arange(n)  # noqa: E731
    got = f(ar(2), ar(2), ar(8), ar(8))
    b, h, q, kv = index_grid(2, 2, 8, 8)
    assert torch.equal(got, mm.fn(b, h, q, kv, aux).expand(2, 2, 8, 8))
    sm, saux = ms.score_mod_from_spec("rand:hbias,relpos:0.125,tanh:4.0", heads_q=2)
    g = lambda s, b, h, q, kv: sm.fn(s, b, h, q, kv, saux)  # noqa: E731
    for dims in (
        (0, None, None, None, 0),
        (0, None, None, 0, None),
        (0, None, 0, None, None),
        (0, 0, None, None, None),
    ):
        g = torch.vmap(g, in_dims=dims)
    s = torch.randn(2, 2, 8, 8)
    assert torch.allclose(g(s, ar(2), ar(2), ar(8), ar(8)), sm.fn(s, b, h, q, kv, saux))


# ---- fuzz --mods ------------------------------------------------------------------------------

_ALL_MODS = Domain(mods=("score_mod", "mask_mod", "block_sparse", "aux_scalars"))
#: score mods without runtime scalars: a domain that does not declare aux_scalars never gets one
_NO_SCALARS = Domain(mods=("score_mod", "mask_mod", "block_sparse"))


@FEW
@given(cases(domain=_ALL_MODS, mods=True, max_seqlen=256))
def test_fuzz_draws_mods_inside_the_domain(case):
    """Drawn mods lie in the domain, with block sparsity only beside a mask_mod (d <= 128), no
    flags beside a mask_mod (production drops them), no softcap beside a score_mod (production
    refuses the pair) and no nan_inf family beside a mask_mod."""
    assert _ALL_MODS.refusal(case) is None
    if case.block_sparse:
        assert case.mask_mod and case.d <= 128 and case.block_sparse in MOD_BLOCKS
    if case.mask_mod:
        assert not case.causal and tuple(case.window) == (None, None) and not case.family.startswith("nan_inf")
    if case.score_mod:
        assert case.softcap == 0.0


def test_fuzz_reaches_every_mod_kind_and_only_when_asked():
    from hypothesis import find
    from hypothesis.errors import NoSuchExample

    quick = settings(database=None, derandomize=True, max_examples=300)
    strat = cases(domain=_ALL_MODS, mods=True, max_seqlen=256)
    for kind in ("score_mod", "mask_mod", "block_sparse"):
        assert getattr(find(strat, lambda c, k=kind: bool(getattr(c, k)), settings=quick), kind)
    assert "aux_scalars" in find(strat, lambda c: "aux_scalars" in c.mods, settings=quick).mods
    with pytest.raises(NoSuchExample):
        find(cases(domain=_NO_SCALARS, mods=True, max_seqlen=256), lambda c: "aux_scalars" in c.mods, settings=quick)
    plain = find(cases(domain=_ALL_MODS, max_seqlen=256), lambda c: c.causal, settings=quick)
    assert plain.mods == ()  # without mods=True nothing is drawn, whatever the domain declares
    with pytest.raises(NoSuchExample):
        find(cases(domain=_ALL_MODS, max_seqlen=256), lambda c: bool(c.mods), settings=quick)
    only_score = Domain(mods=("score_mod",))
    with pytest.raises(NoSuchExample):
        find(cases(domain=only_score, mods=True, max_seqlen=256), lambda c: bool(c.mask_mod), settings=quick)


def test_fuzz_mods_needs_declared_kinds(tmp_path):

    with pytest.raises(ValueError, match="fuzz --mods: kernel 'sdpa-math' declares no mod kinds"):
        fuzz("sdpa-math", options=RunOptions(isolate=False), budget=1, database=tmp_path / "db", mods=True)


def model_with_mods(q, k, v, **kw):
    """The SM90 model declaring the mods (its registry entry may not yet)."""
    from audits.kernels import get_kernel

    return get_kernel("fa4-model-sm90")(q, k, v, **kw)


# d = 128 only: at d = 64 the model kernel keeps SM90's 192-row tile beside 128-row sparse blocks
# and refuses them, where production fits a 128-row tile (interface._tile_size_fwd_sm90 with
# sparse_block_size_q): what this search found first, reported to the model's owners
model_with_mods.fa4_audit_domain = {"dtypes": ["bfloat16"], "head_dims": [128], "max_seqlen": 192,
                                    "mods": ["score_mod", "mask_mod", "block_sparse"]}  # fmt: skip
model_with_mods.fa4_audit_numerics = "sm90"


@pytest.mark.slow
def test_fuzz_with_mods_runs_the_model_clean(tmp_path):
    """A short fuzz --mods search on the SM90 model: no failure, cases with mods drawn."""

    res = fuzz("tests.test_mod_fuzz:model_with_mods", options=RunOptions(isolate=False), budget=4, seed=1,
               mods=True, database=tmp_path / "db", max_seqlen=192)  # fmt: skip
    assert res["failure"] is None and res["examples"] == 4 and res["mods"] is True, res


# ---- GPU: the CuTe forms on production (the lead runs these) -------------------------------------

_GPU_SPECS = ("rand:scale:0.5,relpos:0.0625,tanh:15.0", "rand:hbias,tanh:8.0,scale:2.0", "rand:tanh:4.0,hbias")


def _gpu_qkvdo(seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda n, h: torch.randn(2, n, h, 128, device="cuda", generator=g).to(torch.bfloat16)  # noqa: E731
    return mk(256, 4), mk(384, 2), mk(384, 2), mk(256, 4)


def _both(q, k, v, do, **kw):
    """(production's, the FP64 closed form's: ``numerics.grad_reference``) {out, lse, dq, dk, dv}."""
    from fa4.production import flash_attn
    from numerics.grad_reference import attention_grad_reference

    qq, kk, vv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out, lse = flash_attn(qq, kk, vv, return_lse=True, **kw)
    dq, dk, dv = torch.autograd.grad(out, (qq, kk, vv), do)
    ref = attention_grad_reference(q, k, v, do, call=AttentionCall.from_kwargs(**kw))
    return {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}, {n: ref[n] for n in ("out", "lse", "dq", "dk", "dv")}


@pytest.mark.gpu
@SM90_GQA_SCORE_MOD_BWD  # each spec reads the position or the head, on GQA inputs: tests/production_defects.py
@pytest.mark.parametrize("spec", _GPU_SPECS)
def test_random_score_forms_on_production(spec):
    """A random chain's CuTe forms (forward and score_mod_bwd) compile in production and compute
    the chain: out within the forward bound of production's numerics, every tensor within 2e-2
    of float64 relative to its largest value (bf16: u = 3.9e-3; a wrong op or derivative moves
    it by O(1))."""
    from audits.kernels import production_arch
    from fa4.model import FA4Numerics
    from numerics.forward_bound import forward_error_bound

    q, k, v, do = _gpu_qkvdo()
    sm, aux = ms.score_mod_from_spec(spec, heads_q=4, seed=1, device="cuda")
    kw = dict(softmax_scale=0.088, score_mod=sm, aux_tensors=aux)
    got, want = _both(q, k, v, do, **kw)
    nm = FA4Numerics.for_inputs(production_arch(), q, k, v, False, (None, None))
    ob, _ = forward_error_bound(
        q, k, v, nm, call=AttentionCall.from_kwargs(**kw), reference=(want["out"].detach(), want["lse"].detach())
    )
    assert bool(((got["out"].double() - want["out"]).abs() <= ob).all()), spec
    for name in want:
        err = (got[name].double() - want[name]).abs().max() / want[name].abs().max()
        assert float(err) <= 2e-2, (spec, name)


@pytest.mark.gpu
def test_random_block_mask_form_on_production_dense_and_block_sparse():
    """The random block mask's CuTe form: dense and block-sparse (128 x 128, full / partial /
    empty blocks, per head) each within 2e-2 of float64, forward and backward."""
    q, k, v, do = _gpu_qkvdo(1)
    pat = ms.random_mask(batch=2, heads=4, seqlen_q=256, seqlen_k=384, block_size=(128, 128), seed=3)
    mm, aux = ms.mask_mod_of(pat, device="cuda")
    bs = block_sparse_from_mask(mm, batch=2, heads=4, seqlen_q=256, seqlen_k=384, block_size=(128, 128), aux=aux,
                                device="cuda")  # fmt: skip
    assert bool(bs.full.any()) and bool(bs.partial.any()) and bool((~(bs.full | bs.partial)).any())
    for extra in ({}, {"block_sparse_tensors": bs}):
        got, want = _both(q, k, v, do, softmax_scale=0.088, mask_mod=mm, aux_tensors=aux, **extra)
        for name in want:
            err = (got[name].double() - want[name]).abs().max() / want[name].abs().max()
            assert float(err) <= 2e-2, (tuple(extra), name)
