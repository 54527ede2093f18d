"""``aux_scalars`` in the mod contract (docs/mods.md, "Runtime scalars"): production's compatibility
shim (a mod gets ``aux_scalars=`` only when the call has some), the ``temperature`` library mod
(forms, hooks, bounds), the model against the FP64 reference through the runner, a kernel that
ignores the call's scalars caught with its reason, and production's compile of Python-number
scalars (a CPU cross-compile, when the gpu extra is importable)."""

import json
import math
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from audits.suites.cases import Case
from fa4.model import FA4Numerics, attention
from fa4.mods import build_mods
from numerics.backward_bound import backward_error_bound
from numerics.call import AttentionCall
from numerics.forward_bound import UNIT_ROUNDOFF, forward_error_bound
from numerics.grad_reference import attention_grad_reference
from numerics.mod_library import TEMPERATURE_RANGE
from numerics.mods import MaskMod, ScoreMod, bind_aux_scalars, check_aux_scalars, index_grid
from numerics.reference import attention_reference, call_visibility
from tests.test_static import _production_importable

U = UNIT_ROUNDOFF


def _inputs(dtype=torch.bfloat16, b=1, sq=48, sk=64, hq=4, hk=2, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, hq, d, generator=g).to(dtype)
    k = torch.randn(b, sk, hk, d, generator=g).to(dtype)
    v = torch.randn(b, sk, hk, d, generator=g).to(dtype)
    return q, k, v


# ---- the contract: production's shim ------------------------------------------------------------


def _plain_mod() -> ScoreMod:
    """A user mod written before aux_scalars existed: no ``aux_scalars`` parameter anywhere."""
    return ScoreMod(
        "plain_bias",
        lambda s, b, h, q, kv, aux: s + 0.01 * (kv - q).to(s.dtype),
        lambda g, s, b, h, q, kv, aux: g * torch.ones_like(s),
    )


@pytest.mark.parametrize("none", [None, (), []])
def test_a_mod_without_an_aux_scalars_parameter_works_when_the_call_has_none(none):
    """softmax.py call_score_mod: without scalars the mod is called as before (None and an empty
    sequence alike: interface._flash_attn_fwd turns an empty one into None)."""
    q, k, v = _inputs()
    sm = _plain_mod()
    ref = attention_reference(q, k, v, call=AttentionCall(score_mod=sm))
    assert torch.equal(attention_reference(q, k, v, call=AttentionCall(score_mod=sm, aux_scalars=none)), ref)
    out = attention(q, k, v, score_mod=sm, aux_scalars=none)
    assert torch.equal(out, attention(q, k, v, score_mod=sm))
    assert float((out.double() - ref).abs().max()) < 0.02
    nm = FA4Numerics.for_inputs("sm90", q, k, v, False, (None, None))
    ob, _ = forward_error_bound(q, k, v, nm, call=AttentionCall(score_mod=sm, aux_scalars=none))
    assert torch.isinf(ob).all()  # no hooks: unbounded where the mod applies, and it ran


def test_with_scalars_every_mod_of_the_call_receives_them():
    """The shim is per call, not per mod: with scalars the plain mod is called with them too, and
    refuses them, as production's would (its compile fails on the unexpected keyword)."""
    q, k, v = _inputs()
    reference = lambda **kw: attention_reference(q, k, v, call=AttentionCall(**kw))
    for call in (reference, lambda **kw: attention(q, k, v, **kw)):
        with pytest.raises(TypeError, match="aux_scalars"):
            call(score_mod=_plain_mod(), aux_scalars=(0.5,))


def test_a_mod_reading_aux_scalars_gets_them_everywhere():
    """References, bounds and the model, forward and backward: every form and hook of the score
    mod and the mask mod receives the call's scalars, normalised to a tuple."""
    seen: list = []

    def rec(name, x):
        seen.append((name, x))

    def fn(s, b, h, q, kv, aux, *, aux_scalars):
        rec("fn", aux_scalars)
        return s * torch.tensor(aux_scalars[0], dtype=s.dtype)

    def grad(g, s, b, h, q, kv, aux, *, aux_scalars):
        rec("grad", aux_scalars)
        return g * torch.tensor(aux_scalars[0], dtype=g.dtype)

    def hook(name, value):
        def f(*args, aux_scalars):
            rec(name, aux_scalars)
            return value(args[0])

        return f

    sm = ScoreMod(
        "scaled", fn, grad, value_error=hook("value_error", lambda s: s.abs() * 1e-6),
        slope=hook("slope", lambda lo: torch.full_like(lo, 0.75)),
        grad_error=hook("grad_error", lambda g: g.abs() * 1e-6), curvature=hook("curvature", torch.zeros_like),
        per_head=False,
    )  # fmt: skip

    def keep(b, h, q, kv, aux, *, aux_scalars):
        rec("mask", aux_scalars)
        return kv <= q + aux_scalars[1]

    mm = MaskMod("shifted_causal", keep)
    kw = dict(score_mod=sm, mask_mod=mm, aux_scalars=[0.75, 16])
    q, k, v = _inputs()
    nm = FA4Numerics.for_inputs("sm90", q, k, v, False, (None, None))
    ref, rl = attention_reference(q, k, v, call=AttentionCall.from_kwargs(**kw), return_lse=True)
    forward_error_bound(q, k, v, nm, call=AttentionCall.from_kwargs(**kw), reference=(ref, rl))
    do = torch.randn_like(q)
    gref = attention_grad_reference(q, k, v, do, call=AttentionCall.from_kwargs(**kw))
    qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
    out, lse = attention(qq, kk, vv, return_lse=True, numerics=nm, **kw)
    out.backward(do)
    backward_error_bound(
        q, k, v, do, out.detach(), lse.detach(), nm, call=AttentionCall.from_kwargs(**kw), reference=gref
    )
    call_visibility(call=AttentionCall(mask_mod=mm, aux_scalars=(0.75, 16)), batch=1, heads=4, seqlen_q=48, seqlen_k=64)
    names = {n for n, _ in seen}
    assert names == {"fn", "grad", "value_error", "slope", "grad_error", "curvature", "mask"}
    assert {x for _, x in seen} == {(0.75, 16)}
    # and the values were used: the mask keeps 16 keys past the diagonal, the mod scales by 0.75
    plain = attention_reference(q, k, v, call=AttentionCall(score_mod=_plain_mod()))
    assert float((ref - plain).abs().max()) > 0.05


@pytest.mark.parametrize(
    "bad, says",
    [
        (torch.tensor([0.5]), "aux_scalars must be a tuple of Python ints / floats (or None), got Tensor"),
        ("0.5", "got str"),
        (0.5, "got float"),
        ((0.5, torch.tensor(1.0)), "aux_scalars[1] is Tensor (tensor(1.)); accepted: a Python int or float"),
        ((None,), "aux_scalars[0] is NoneType (None)"),
    ],
)
def test_bad_aux_scalars_are_refused_naming_what_is_accepted(bad, says):
    with pytest.raises(TypeError) as exc:
        check_aux_scalars(bad)
    assert says in str(exc.value)
    q, k, v = _inputs(sq=16, sk=16)
    with pytest.raises(TypeError, match="aux_scalars"):
        attention(q, k, v, score_mod=_plain_mod(), aux_scalars=bad)


# ---- the temperature mod ----------------------------------------------------------------------


def _temperature(seed=0, **shape):
    shape = {"batch": 1, "heads_q": 2, "seqlen_q": 40, "seqlen_k": 56, **shape}
    kw = build_mods(score_mod="temperature", seed=seed, **shape)
    return kw["score_mod"], kw["aux_scalars"]


def test_build_mods_puts_the_seeded_temperature_into_the_calls_aux_scalars():
    taus = set()
    for seed in range(6):
        sm, scalars = _temperature(seed)
        (tau,) = scalars
        assert isinstance(tau, float) and TEMPERATURE_RANGE[0] <= tau < TEMPERATURE_RANGE[1]
        assert sm.params["aux_scalars"] == scalars and float(torch.tensor(tau, dtype=torch.float32)) != tau
        taus.add(tau)
    assert len(taus) == 6  # the seed draws it
    assert _temperature(3)[1] == _temperature(3)[1]
    assert "aux_scalars" not in build_mods(score_mod="alibi", seed=0, batch=1, heads_q=2, seqlen_q=8, seqlen_k=8)


def test_temperature_forms_agree_within_the_value_error_hook():
    """The reference in float64 (the user's tau), production's float32 arithmetic (sm_90a PTX,
    fa4/mod_forms.py: mul.f32 scale*acc, then mul.f32 tau*that with tau the Float32 kernel
    parameter), the model form bitwise that arithmetic, and |float32 - float64| within value_error.
    The hook's dt term (the scalar's Float32 rounding) is needed: without it some element exceeds."""
    sm, scalars = _temperature(18)  # tau's Float32 rounding 0.77 u relative (seed 5's: 0.004 u)
    (tau,) = scalars
    bound_mod, _, _ = bind_aux_scalars(scalars, score_mod=sm, form_keys=("model", "model_bwd"))
    b, h, q, kv = index_grid(1, 2, 40, 56)
    acc = torch.randn(1, 2, 40, 56, generator=torch.Generator().manual_seed(4)) * 40
    scale = 1 / math.sqrt(96)
    tau32 = torch.tensor(tau, dtype=torch.float32)
    want = (acc * torch.tensor(scale, dtype=torch.float32)) * tau32
    got = bound_mod.forms["model"](acc, scale, b, h, q, kv, [])
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    x = acc * torch.tensor(scale, dtype=torch.float32)  # the scaled score, rounded
    assert torch.equal(bound_mod.fn(x, b, h, q, kv, []), got)  # no contraction: the reference form in float32 is it
    exact = bound_mod.fn(x.double(), b, h, q, kv, [])
    assert float(exact.flatten()[7]) == float(x.flatten()[7]) * tau  # float64: the user's tau, not its float32
    err = (got.double() - exact).abs()
    bound = bound_mod.value_error(x.double(), b, h, q, kv, [])
    assert (err <= bound).all()
    assert (err > U * exact.abs() * (1 + 2.0**-50)).any(), "tau's Float32 rounding must show, else dt is untested"
    # backward: g * tau32, one FMUL, within grad_error of g * tau
    g = torch.randn(1, 2, 40, 56, generator=torch.Generator().manual_seed(5)).float()
    gb = bound_mod.forms["model_bwd"](g, x, b, h, q, kv, [])
    assert torch.equal(gb, g * tau32)
    assert (
        (gb.double() - g.double() * tau).abs() <= bound_mod.grad_error(g.double().abs(), x.double(), b, h, q, kv, [])
    ).all()
    assert bound_mod.slope(x.double(), x.double(), b, h, q, kv, []).eq(abs(tau)).all()


def _small_call(dtype, seed, **mods):
    q, k, v = _inputs(dtype, b=1, sq=96, sk=128, hq=4, hk=2, seed=seed)
    kw = build_mods(batch=1, heads_q=4, seqlen_q=96, seqlen_k=128, seed=seed, **mods)
    return q, k, v, kw


@pytest.mark.parametrize("dtype, mods", [
    (torch.bfloat16, {}),
    (torch.float16, {"mask_mod": "prefix_lm", "block_sparse": (128, 128)}),
])  # fmt: skip
def test_the_bounds_hold_on_the_model_with_temperature_and_break_when_the_scalar_is_ignored(dtype, mods):
    """Forward and backward bounds hold on the SM90 model with the call's tau; a kernel that runs
    tau = 1 instead (the call's scalar ignored) exceeds the forward bound, and its gradients the
    backward bound."""
    q, k, v, kw = _small_call(dtype, 7, score_mod="temperature", **mods)
    q = q * 2  # logits of a few units: a wrong temperature moves the softmax visibly
    nm = FA4Numerics.for_inputs("sm90", q, k, v, False, (None, None), block_sparse=mods.get("block_sparse"))
    ref, rl = attention_reference(q, k, v, call=AttentionCall.from_kwargs(**kw), return_lse=True)
    ob, lb = forward_error_bound(q, k, v, nm, call=AttentionCall.from_kwargs(**kw), reference=(ref, rl))
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(8)).to(dtype)
    gref = attention_grad_reference(q, k, v, do, call=AttentionCall.from_kwargs(**kw))

    def model(scalars):
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
        out, lse = attention(qq, kk, vv, return_lse=True, numerics=nm, **{**kw, "aux_scalars": scalars})
        out.backward(do)
        return out.detach(), lse.detach(), {"dq": qq.grad, "dk": kk.grad, "dv": vv.grad}

    out, lse, grads = model(kw["aux_scalars"])
    assert ((out.double() - ref).abs() <= ob).all() and ((lse.double() - rl).abs() <= lb).all()
    gb = backward_error_bound(q, k, v, do, out, lse, nm, call=AttentionCall.from_kwargs(**kw), reference=gref)
    for n in ("dq", "dk", "dv"):
        assert ((grads[n].double() - gref[n]).abs() <= gb[n]).all(), n
    out1, lse1, grads1 = model((1.0,))
    assert ((lse1.double() - rl).abs() > lb).any() and ((out1.double() - ref).abs() > ob).any()
    assert ((grads1["dq"].double() - gref["dq"]).abs() > gb["dq"]).any()


# ---- through the runner --------------------------------------------------------------------------


def _ignores_scalars(q, k, v, *, return_lse=False, **kw):
    """A kernel that ignores the call's aux_scalars: it runs the value it was built with (1.0),
    as a kernel that baked a runtime capture in at compile time would (production's compile key
    holds only the scalars' types, so a new value must reach the kernel at launch)."""
    kw = {**kw, "aux_scalars": (1.0,)} if kw.get("aux_scalars") is not None else kw
    return _honours_scalars(q, k, v, return_lse=return_lse, **kw)


def _honours_scalars(q, k, v, *, return_lse=False, **kw):
    """The SM90 model with the call's keywords."""
    flags = dict(causal=kw.get("causal", False), window_size=kw.get("window_size", (None, None)))
    nm = FA4Numerics.for_call("sm90", q, k, v, **flags, mask_mod=kw.get("mask_mod"),
                              block_sparse_tensors=kw.get("block_sparse_tensors"))  # fmt: skip
    return attention(q, k, v, return_lse=return_lse, numerics=nm, **kw)


for _f in (_ignores_scalars, _honours_scalars):
    _f.fa4_audit_domain = {"mods": ["score_mod", "mask_mod", "block_sparse", "aux_scalars"]}

CASES = [
    Case("float16", 64, 64, 1, 4, 2, 96, 128, score_mod="temperature", seed=3),
    Case("bfloat16", 64, 64, 1, 2, 2, 96, 160, family="drift", score_mod="temperature", mask_mod="document",
         block_sparse=(128, 128), seed=4),
]  # fmt: skip
FWD = r"exceed the forward-pass bound|FA criterion: max\|out|LSE max \|err\|"


def test_a_kernel_ignoring_the_calls_aux_scalars_is_caught_and_the_model_passes(tmp_path):
    from audits.engine.options import RunOptions
    from audits.engine.run import run_suites
    from audits.verdict.gate import load_thresholds

    torch.set_num_threads(min(2, torch.get_num_threads()))
    spec = {k: f"{__file__}:{k}" for k in ("_honours_scalars", "_ignores_scalars")}
    options = RunOptions(out=tmp_path, thresholds=load_thresholds(), label="scalars", isolate=False)
    recs = run_suites(list(spec.values()), CASES, options)
    good, bad = ({r["case"]: r for r in recs[spec[k]]} for k in ("_honours_scalars", "_ignores_scalars"))
    for c in CASES:
        assert good[c.name]["verdict"] == "pass", (c.name, good[c.name]["reasons"])
        r = bad[c.name]
        assert r["verdict"] == "fail", (c.name, r["verdict"], r["reasons"])
        assert any(re.search(FWD, why) for why in r["reasons"]), r["reasons"]


# ---- production: the compile of Python-number scalars ----------------------------------------------

_COMPILE = textwrap.dedent(
    """
    import json, os, sys, tempfile
    dump = tempfile.mkdtemp(prefix="fa4-aux-scalars-")
    os.environ.update(CUTE_DSL_ARCH="sm_90a", FLASH_ATTENTION_ARCH="sm_90", CUTE_DSL_KEEP_PTX="1",
                      CUTE_DSL_DUMP_DIR=dump, CUTE_DSL_DISABLE_FILE_CACHING="1",
                      FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED="0", FLASH_ATTENTION_NUM_SMS="132")
    from fa4 import sm100_compile as sc
    sc._stub_hardware_info()
    import flash_attn.cute as fa
    from flash_attn.cute import interface
    compiled = sc._capture_compiles(interface, dump)
    cfg = dict(dtype="bfloat16", d=64, dv=64, batch=1, heads_q=2, heads_kv=2, seqlen_q=128, seqlen_k=128,
               causal=False, window=[None, None], softcap=0.0, sink=False, score_mod="temperature", seed=0)
    mods = sc._real_mods(cfg)  # fa4.mods.production_kwargs: the scalars as cutlass.Float32
    if sys.argv[1] == "python":
        from fa4.mods import build_mods  # the same scalars as Python floats, as a user passes them
        mods["aux_scalars"] = build_mods(score_mod="temperature", batch=1, heads_q=2, seqlen_q=128, seqlen_k=128,
                                         seed=0)["aux_scalars"]
    err = sc._call_on_fake_tensors(fa, cfg, mods)
    ptx = [c["ptx"] for c in compiled if c.get("ptx")]
    print(json.dumps({"error": None if err is None else f"{type(err).__name__}: {err}", "ptx": ptx[-1] if ptx else ""}))
    """
)


@pytest.mark.slow
@pytest.mark.skipif(
    not _production_importable(), reason="needs the gpu extra (flash-attn-4, nvidia-cutlass-dsl); no GPU needed"
)
@pytest.mark.parametrize("how", ["python", "dsl"])
def test_production_compiles_aux_scalars_only_as_dsl_values(how):
    """flash-attn-4 4.0.0b36 with nvidia-cutlass-dsl 4.8.1, SM90 forward with the temperature mod
    (sm_90a, compiled on the CPU, ~25 s each): Python-float aux_scalars do not compile (the DSL's
    argument adapters do not enter utils.AuxData; the arguments misalign), the same scalars as
    cutlass.Float32 (fa4.mods.dsl_scalars) compile, and the kernel multiplies the scaled score by
    its .f32 parameter, uncontracted.  When a release fixes the former, this test says so."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path])}
    res = subprocess.run([sys.executable, "-c", _COMPILE, how], capture_output=True, text=True, env=env, timeout=600)
    got = json.loads(res.stdout.strip().splitlines()[-1])
    if how == "python":
        assert got["error"] is not None and "unable to convert BlockArgument" in got["error"], got["error"]
        assert "!cuda.stream" in got["error"] and not got["ptx"]
        return
    assert got["error"] is None and ".param .f32" in got["ptx"]
    last_f32 = max(int(n) for n in re.findall(r"\.param \.f32 \w+_param_(\d+)", got["ptx"]))  # aux_data's scalar
    (tau_reg,) = set(re.findall(rf"ld\.param\.b32\s+(%r\d+), \[\w+_param_{last_f32}\];", got["ptx"]))
    muls = re.findall(rf"mul\.f32\s+%r\d+, {re.escape(tau_reg)}, (%r\d+);", got["ptx"])
    assert muls, "the scalar multiplies the score"
    scaled = {m.group(1) for m in re.finditer(r"mul\.f32\s+(%r\d+), %r\d+, %r\d+;", got["ptx"])}
    assert set(muls) <= scaled  # each operand the product of a mul.f32 (the scale's): no fma.rn.f32 contraction


@pytest.mark.slow
def test_the_mods_suites_temperature_cases_pass_on_the_sm90_model_forward_and_backward(tmp_path):
    """``fa4-audit run --kernel fa4-model-sm90 --suite mods --case '*s256x384-sm-temperature*'
    --backward``: the suite's 9 temperature cases (alone, with document, with prefix-LM
    block-sparse; bf16 / fp16, an adversarial family each) pass, forward and gradients, 0 bound
    violations (5.2 min wall on the shared 2-core machine, 2026-12-02)."""
    from audits import cli

    argv = ["run", "--kernel", "fa4-model-sm90", "--suite", "mods", "--case", "*s256x384-sm-temperature*",
            "--backward", "--out", str(tmp_path), "--quiet"]  # fmt: skip
    assert cli.main(argv) == 0
    cases = json.loads((tmp_path / "report.json").read_text())["cases"]
    assert len(cases) == 9 and all("temperature" in c["case"] for c in cases)
    for c in cases:
        assert c["verdict"] == "pass" and c["backward"]["status"] == "ran", (c["case"], c["reasons"])
        assert c["bound"]["violations"] == c["bound"]["lse_violations"] == 0
        assert all(c["backward"]["grads"][g]["bound"]["violations"] == 0 for g in ("dq", "dk", "dv"))


def test_a_kernel_that_does_not_declare_aux_scalars_gets_no_scalar_mod_case():
    """The domain kind ``aux_scalars`` (audits.suites.cases.MOD_KINDS): a case whose mod reads runtime
    scalars passes ``aux_scalars=``, a keyword a kernel declaring only ``score_mod`` need not take;
    such a kernel has the case outside its domain (named), never an error from an unknown keyword."""
    from audits.suites.domain import Domain

    scalar = Case("bfloat16", 64, 64, 1, 2, 2, 128, 128, score_mod="temperature")
    plain = Case("bfloat16", 64, 64, 1, 2, 2, 128, 128, score_mod="alibi")
    assert scalar.mods == ("score_mod", "aux_scalars") and plain.mods == ("score_mod",)
    score_only = Domain.from_dict({"mods": ["score_mod"]}, where="test")
    why = score_only.refusal(scalar)
    assert why is not None and why.startswith("aux_scalars unsupported (the domain's mods: score_mod;"), why
    assert score_only.refusal(plain) is None
    assert Domain.from_dict({"mods": ["score_mod", "aux_scalars"]}, where="test").refusal(scalar) is None


def test_flex_keeps_the_scalar_at_the_scores_precision():
    """flex_attention traces a score_mod on an example score of the *query's* dtype: a form that
    builds ``torch.tensor(tau, dtype=s.dtype)`` bakes in tau rounded to bf16 (the H200 run of
    2026-12-02 failed all 9 temperature cases of flex on the LSE, 1e-2 off).  The library form
    multiplies by a Python float.  Eager flex on the CPU shows the same: the LSE within 1e-4 of
    float64 (float32 statistics over 384 keys err by ~1e-6; bf16's tau by |s| * 2^-9 ~ 1e-2)."""
    from audits.kernels import get_kernel
    from audits.suites.inputs import make_inputs

    c = Case("bfloat16", 64, 64, 1, 2, 2, 64, 384, score_mod="temperature", family="long_tail", seed=25396)
    x = make_inputs(c)
    _, lse = get_kernel("flex")(x["q"], x["k"], x["v"], return_lse=True, **x["kw"])
    _, want = attention_reference(x["q"], x["k"], x["v"], call=AttentionCall.from_kwargs(**x["kw"]), return_lse=True)
    assert float((lse.double() - want).abs().max()) <= 1e-4
