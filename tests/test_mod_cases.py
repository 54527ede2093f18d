"""The programmable surface in the audit's cases (docs/mods.md): the Case fields ``score_mod``,
``mask_mod``, ``block_sparse`` (names, validation, the JSON and reproducer round trip), the
domain key ``mods``, the suites' mod cases (smoke, mods, release; built only within a domain
that declares the kinds), the inputs' mods and their preconditions, and the mod code-path
classes and their coverage."""

import json
import os
import shlex
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from audits.suites.cases import (
    MOD_BLOCK,
    MOD_BLOCK_SM100,
    MOD_KINDS,
    Case,
    build_suite,
    case_from_dict,
    case_from_json,
    mods_cross_checks,
    mods_within,
    smoke_mods,
    smoke_within,
    suite,
)
from audits.suites.domain import Domain, DomainError, domain_of
from audits.suites.inputs import NotApplicable, make_inputs, saveable_kw
from fa4.code_paths import ARCHS, classes, classes_of
from numerics.call import AttentionCall
from numerics.mod_library import MASK_MODS, RELBIAS_SPAN, SCALAR_SCORE_MODS, SCORE_MODS, SOFTCAP_CAP, WINDOW
from numerics.mods import BlockSparse, MaskMod, ScoreMod

ROOT = Path(__file__).parents[1]
ALL = Domain(mods=MOD_KINDS)
NONE = Domain(mods=())  # what a kernel declaring no mods gets (domain_of)
MOD = Case("bfloat16", 64, 64, 1, 2, 2, 128, 200, score_mod="alibi", mask_mod="document", block_sparse=(128, 128))
#: every mod kind: its score mod reads a runtime scalar (aux_scalars)
ALL_KINDS = replace(MOD, score_mod="temperature")


# ---- the Case fields --------------------------------------------------------------------------


def test_mod_fields_name_the_case_and_key_its_compilation():
    assert Case().score_mod == "" and Case().mask_mod == "" and Case().block_sparse == ()
    assert MOD.name == "bf16-d64-b1h2k2-s128x200-sm-alibi-mm-document-bs128x128-normal-seed0"
    assert MOD.mods == MOD_KINDS[:3] and replace(MOD, score_mod="").mods == ("mask_mod", "block_sparse")
    assert replace(MOD, score_mod="temperature").mods == MOD_KINDS  # it reads aux_scalars
    plain = replace(MOD, score_mod="", mask_mod="", block_sparse=())
    assert plain.name == "bf16-d64-b1h2k2-s128x200-normal-seed0" and plain.mods == ()
    variants = (MOD, plain, replace(MOD, score_mod="relbias"), replace(MOD, block_sparse=(256, 128)))
    keys = {c.compile_key for c in variants}
    assert len(keys) == 4  # each mod compiles its own kernel (production hashes it into its compile key)


def test_the_json_form_round_trips_and_leaves_unset_mods_out():
    d = MOD.as_dict()
    assert d["score_mod"] == "alibi" and d["mask_mod"] == "document" and d["block_sparse"] == [128, 128]
    assert case_from_dict(json.loads(json.dumps(d))) == MOD
    plain = Case().as_dict()
    assert not {"score_mod", "mask_mod", "block_sparse"} & set(plain)  # reports and journals read as before
    assert case_from_dict(plain) == Case()
    for c in suite("mods") + smoke_mods():
        assert case_from_json(json.dumps(c.as_dict()), where="t") == c


def test_call_carries_the_mods():
    call = MOD.call()
    assert (call.score_mod, call.mask_mod, call.block_sparse) == (True, True, (128, 128))
    assert Case().call().score_mod is False and Case().call().block_sparse == ()


@pytest.mark.parametrize(
    "bad, says",
    [
        ({"score_mod": "alibie"}, f"score_mod = 'alibie' is not accepted; accepted: {', '.join(SCORE_MODS)}"),
        ({"mask_mod": "window"}, f"mask_mod = 'window' is not accepted; accepted: {', '.join(MASK_MODS)}"),
        ({"score_mod": 3}, "score_mod = 3 is not accepted"),
        ({"mask_mod": "causal", "block_sparse": [128]}, "block_sparse = [128] must be [block_q, block_k], two"),
        ({"mask_mod": "causal", "block_sparse": [128, 0]}, "must be [block_q, block_k], two positive integers"),
        ({"mask_mod": "causal", "block_sparse": [128, True]}, "two positive integers"),
        ({"mask_mod": "causal", "block_sparse": "128x128"}, "two positive integers"),
        ({"block_sparse": [128, 128]}, f"block_sparse [128, 128] needs a mask_mod (its blocks are built from it); "
                                       f"accepted: {', '.join(MASK_MODS)}"),
    ],
)  # fmt: skip
def test_bad_mod_fields_are_refused_naming_what_is_accepted(bad, says):
    with pytest.raises(ValueError) as e:
        case_from_dict({"dtype": "bfloat16", **bad}, where="case file x, entry 1")
    assert says in str(e.value) and str(e.value).startswith("case file x, entry 1: ")


# ---- the reproducer ---------------------------------------------------------------------------


def test_the_reproducer_carries_the_mods():
    from audits.report.repro import reproducer

    cmd = shlex.split(reproducer("fa4-model", MOD, device="cpu"))
    cfg = cmd[cmd.index("--config") + 1]
    assert json.loads(cfg)["block_sparse"] == [128, 128]
    assert case_from_json(cfg, where="--config") == MOD


@pytest.mark.slow  # a subprocess run of one case (torch import, the model forward): ~15 s CPU
def test_the_printed_reproducer_reruns_the_mod_case(tmp_path):
    """The command a failing mod case's record carries, run as a user pastes it from another
    directory, re-runs exactly that case (its mods rebuilt from --config) to the same failure."""
    import tests.bugged_mods as bm
    from audits.engine.options import RunOptions
    from audits.engine.run import run_suites
    from audits.verdict.gate import load_thresholds

    case = smoke_mods()[1]  # relbias + document: the neighbour head's bias fails the forward
    kernel = f"{bm.__file__}:bug_aux_wrong_head"
    options = RunOptions(out=tmp_path / "run", thresholds=load_thresholds(), label="smoke", isolate=False)
    (rec,) = run_suites([kernel], [case], options)[kernel]
    assert rec["verdict"] == "fail" and "--config" in rec["repro"]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env["PYTHONPATH"] = str(ROOT)  # tests.bugged_mods imports the package's modules only
    (tmp_path / "elsewhere").mkdir()
    p = subprocess.run(rec["repro"], shell=True, cwd=tmp_path / "elsewhere", env=env, capture_output=True, text=True,
                       timeout=600)  # fmt: skip
    assert p.returncode == 1, p.stdout + p.stderr
    rep = json.loads((tmp_path / "elsewhere" / "fa4-audit-repro" / "report.json").read_text())
    assert [c["case"] for c in rep["cases"]] == [case.name]
    assert rep["cases"][0]["verdict"] == "fail" and rep["cases"][0]["reasons"] == rec["reasons"]


# ---- the domain key ---------------------------------------------------------------------------


def test_a_kernel_takes_no_mods_unless_it_says_so():
    def kernel(q, k, v, **kw): ...

    assert domain_of(kernel).mods == ()  # declares nothing
    kernel.fa4_audit_domain = {"dtypes": ["bfloat16"]}
    assert domain_of(kernel).mods == ()  # declares a domain without mods
    kernel.fa4_audit_domain = Domain(dtypes=("bfloat16",))
    assert domain_of(kernel).mods == ()
    kernel.fa4_audit_domain = {"mods": ["mask_mod"]}
    assert domain_of(kernel).mods == ("mask_mod",)
    why = NONE.refusal(MOD)
    assert why.startswith("score_mod unsupported (the domain's mods: none;") and "declares mods = [" in why
    assert Domain(mods=("score_mod",)).refusal(MOD).startswith("mask_mod unsupported (the domain's mods: score_mod;")
    assert ALL.refusal(MOD) is None and NONE.refusal(Case()) is None
    assert Domain().mods is None and Domain().refusal(MOD) is None  # elsewhere (a --domain file) absent is any


def test_the_mods_key_in_dict_and_toml_forms(tmp_path):
    d = Domain.from_dict({"mods": ["block_sparse", "score_mod", "block_sparse"]}, where="k")
    assert d.mods == ("score_mod", "block_sparse")  # MOD_KINDS' order, no repeats
    assert d.as_dict()["mods"] == ["score_mod", "block_sparse"] and Domain.from_dict(d.as_dict(), where="r") == d
    assert "mods" not in Domain().as_dict() and Domain.from_dict({}, where="k") == Domain()  # any
    assert Domain.from_dict({"mods": []}, where="k") == NONE and NONE.as_dict()["mods"] == []
    assert Domain.from_dict(NONE.as_dict(), where="r") == NONE
    f = tmp_path / "d.toml"
    f.write_text('mods = ["mask_mod", "block_sparse"]\n')
    assert Domain.from_toml(f).mods == ("mask_mod", "block_sparse")
    for bad in (["alibi"], "score_mod", [1]):
        with pytest.raises(DomainError) as e:
            Domain.from_dict({"mods": bad}, where="k.fa4_audit_domain")
        assert f"domain key 'mods' = {bad!r}: expected a list of score_mod, mask_mod, block_sparse" in str(e.value)


def test_narrow_and_widen_take_the_kinds_both_and_either_take():
    a, b = Domain(mods=("score_mod", "mask_mod")), Domain(mods=("mask_mod", "block_sparse"))
    assert a.narrow(b).mods == ("mask_mod",) and a.widen(b).mods == ("score_mod", "mask_mod", "block_sparse")
    assert a.narrow(NONE).mods == () and a.widen(NONE).mods == a.mods
    assert a.narrow(Domain()).mods == a.mods and a.widen(Domain()).mods is None


# ---- the suites -------------------------------------------------------------------------------


def test_smoke_has_each_mod_kind_and_library_mod():
    smoke = suite("smoke")
    mods = smoke_mods()
    assert mods and all(c in smoke for c in mods) and all(c.mods for c in mods)
    assert {k for c in mods for k in c.mods} == set(MOD_KINDS)
    assert {c.score_mod for c in mods} - {""} == set(SCORE_MODS)
    assert {c.mask_mod for c in mods} - {""} == set(MASK_MODS)
    assert any(c.mask_mod and c.causal for c in mods)  # the semantic trap: a mask_mod beside causal=True
    assert {c.block_sparse for c in mods} - {()} == {MOD_BLOCK, MOD_BLOCK_SM100}
    for c in mods:  # every one builds its inputs, its block sparsity with partial (and full) blocks
        kw = make_inputs(c)["kw"]
        if c.block_sparse:
            assert bool(kw["block_sparse_tensors"].partial.any())
    blocks = make_inputs(mods[0])["kw"]["block_sparse_tensors"]
    assert bool(blocks.full.any()) and bool(blocks.partial.any())


def test_the_mods_suite_has_every_mod_alone_and_paired_dense_and_block_sparse():
    cases = [c for c in suite("mods") if not c.varlen]  # its varlen cases: tests/test_varlen_mods.py
    assert len(cases) == len(set(cases))
    normal = [c for c in cases if c.family == "normal" and c.mods]
    configs = {(c.score_mod, c.mask_mod, c.block_sparse) for c in normal}
    for s in SCORE_MODS:
        assert (s, "", ()) in configs
        if s in SCALAR_SCORE_MODS:  # a few configurations of their own (audits.suites.cases._mod_configs)
            assert {(s, "document", ()), (s, "prefix_lm", MOD_BLOCK)} <= configs
            continue
        for m in MASK_MODS:
            assert {(s, m, ()), (s, m, MOD_BLOCK)} <= configs
    for m in MASK_MODS:
        assert {("", m, ()), ("", m, MOD_BLOCK), ("", m, MOD_BLOCK_SM100)} <= configs
    for cfg in configs:  # both 16-bit dtypes, and one adversarial family
        same = [c for c in cases if (c.score_mod, c.mask_mod, c.block_sparse) == cfg]
        assert {c.dtype for c in same} == {"bfloat16", "float16"}
        assert sum(c.family != "normal" for c in same) == 1
    assert {c.d for c in cases} == {64, 128}
    assert all((c.batch, c.heads_q, c.heads_kv, c.seqlen_q, c.seqlen_k) == (2, 4, 2, 256, 384) for c in cases)


def test_the_cross_checks_pair_same_inputs_that_must_agree():
    pairs = mods_cross_checks()
    assert set(pairs) == {"softcap", "causal", "sliding_window", "block_sparse", "mask_with_causal"}
    cases = set(suite("mods"))
    for a, b in pairs.values():
        assert {a, b} <= cases and a != b
        bare = dict(score_mod="", mask_mod="", block_sparse=(), softcap=0.0, causal=False, window=(None, None))
        assert replace(a, **bare) == replace(b, **bare)  # one shape, family and seed
        xa, xb = make_inputs(a), make_inputs(b)
        assert all(torch.equal(xa[n], xb[n]) for n in "qkv")  # the same inputs
    assert pairs["softcap"][1].softcap == SOFTCAP_CAP and pairs["sliding_window"][1].window == (WINDOW, 0)
    assert pairs["mask_with_causal"][0].causal and pairs["mask_with_causal"][0].mask_mod


def test_mod_cases_are_built_only_where_the_domain_takes_them():
    smoke = suite("smoke")
    plain = build_suite("smoke", NONE)["cases"]
    assert plain == [c for c in smoke if not c.mods]
    assert build_suite("smoke", ALL)["cases"] == build_suite("smoke", Domain())["cases"] == smoke
    only_scores = build_suite("smoke", Domain(mods=("score_mod",)))["cases"]
    assert {c.name for c in only_scores} - {c.name for c in plain} == set()  # every smoke mod case has a mask_mod too
    none = mods_within(NONE)
    assert none["cases"] == [] and "declares no mod kinds" in none["not_applicable"]["mods"]
    assert build_suite("mods", ALL)["cases"] == suite("mods")
    # a restricted domain: its smoke gets the mod cases that fit it, moved along lengths and heads
    d = Domain.from_dict({"dtypes": ["bfloat16"], "head_dims": [64, 128], "seqlen_multiple": 64, "gqa": False,
                         "mods": list(MOD_KINDS)}, where="t")  # fmt: skip
    got = [c for c in smoke_within(d)["cases"] if c.mods]
    assert got and all(d.refusal(c) is None for c in got)
    assert {c.score_mod for c in got} >= {"alibi", "softcap"}  # the fp16 relbias case is outside (dtype)
    built = mods_within(d)
    assert built["cases"] and all(d.refusal(c) is None for c in built["cases"])
    assert "fit no length, head or layout of the domain" in built["not_applicable"]["mods"]  # the fp16 half


def test_release_and_nightly_hold_the_mods_suite():
    rel = set(suite("release"))
    assert set(suite("mods")) <= rel
    assert any(c.mods for c in rel)


# ---- the inputs -------------------------------------------------------------------------------


def test_inputs_carry_the_mods_for_kernel_reference_and_bound_alike():
    kw = make_inputs(MOD)["kw"]
    assert isinstance(kw["score_mod"], ScoreMod) and kw["score_mod"].name == "alibi"
    assert isinstance(kw["mask_mod"], MaskMod) and kw["mask_mod"].name == "document"
    assert isinstance(kw["block_sparse_tensors"], BlockSparse) and kw["block_sparse_tensors"].block_size == (128, 128)
    assert len(kw["aux_tensors"]) == 3  # ALiBi's slopes, then the document ids of queries and keys
    again = make_inputs(MOD)["kw"]  # deterministic from the seed
    assert all(torch.equal(a, b) for a, b in zip(kw["aux_tensors"], again["aux_tensors"]))
    assert "score_mod" not in make_inputs(Case())["kw"]


def test_a_mod_breaking_a_family_precondition_is_not_applicable():
    with pytest.raises(NotApplicable, match="which the mods \\(document, block-sparse\\) hide from query"):
        make_inputs(replace(MOD, family="nan_inf_visible", seed=2))  # several documents: no key every query sees
    make_inputs(replace(MOD, family="nan_inf_visible", seed=0))  # one document: the key is seen by all
    make_inputs(replace(smoke_mods()[0], family="nan_inf_visible"))  # the prefix holds the key
    long = Case("bfloat16", 64, 64, 1, 1, 1, 8, RELBIAS_SPAN + 1, score_mod="relbias")
    with pytest.raises(NotApplicable, match=f"relbias covers sequences up to {RELBIAS_SPAN} tokens"):
        make_inputs(long)


def test_library_mods_cross_to_the_kernel_worker():
    """``run`` sends the call's keywords to its isolated kernel process pickled: a library mod
    (its reference form a closure) pickles by its recipe and means the same there."""
    import io
    import pickle
    from multiprocessing.reduction import ForkingPickler

    from numerics.reference import attention_reference

    x = make_inputs(MOD)
    buf = io.BytesIO()
    ForkingPickler(buf).dump(x["kw"])
    kw = pickle.loads(buf.getvalue())
    assert kw["score_mod"] is not x["kw"]["score_mod"] and kw["score_mod"].name == "alibi"
    ref = attention_reference(x["q"], x["k"], x["v"], call=AttentionCall.from_kwargs(**x["kw"]))
    assert torch.equal(attention_reference(x["q"], x["k"], x["v"], call=AttentionCall.from_kwargs(**kw)), ref)
    own = ScoreMod("own", lambda s, b, h, q, kv, aux: s)  # a user's own closure: pickles as before (it cannot)
    with pytest.raises((AttributeError, pickle.PicklingError)):
        ForkingPickler(io.BytesIO()).dump(own)


def test_the_saved_inputs_hold_no_code():
    import io

    kw = saveable_kw(make_inputs(MOD)["kw"])
    assert kw["score_mod"] == "alibi" and kw["mask_mod"] == "document"
    assert set(kw["block_sparse_tensors"]) == {"full", "partial", "block_size"}
    torch.save(kw, io.BytesIO())  # the mods' reference forms are closures: pickling them would fail


# ---- code paths and coverage ------------------------------------------------------------------


def test_mod_classes_per_arch_and_direction():
    for arch in ARCHS:
        names = {c.name for c in classes(arch)}
        for short in ("fwd", "bwd"):
            assert {f"{arch}.{short}.{k}" for k in MOD_KINDS} <= names
        fwd = classes_of(arch, ALL_KINDS.call(), direction="forward")
        bwd = classes_of(arch, ALL_KINDS.call(), direction="backward")
        assert {f"{arch}.fwd.{k}" for k in MOD_KINDS} <= set(fwd)
        assert {f"{arch}.bwd.{k}" for k in MOD_KINDS} <= set(bwd)
        # a mask_mod drops causal in the forward (_resolve_causal_local_window), not in the backward
        trap = replace(MOD, causal=True).call()
        assert f"{arch}.fwd.mask.none" in classes_of(arch, trap, direction="forward")
        assert f"{arch}.bwd.mask.causal" in classes_of(arch, trap, direction="backward")
    # SM90's block-sparse tiles: 128 rows at d <= 96 for a 128-row block, 64 x 64 backward at hd256
    assert "sm90.fwd.tile128x128.hd64" in classes_of("sm90", MOD.call(), direction="forward")
    assert "sm90.fwd.tile192x128.hd64" in classes_of("sm90", replace(MOD, block_sparse=()).call(), direction="forward")
    hd256 = replace(MOD, d=256, dv=256, block_sparse=(128, 64)).call()
    assert "sm90.bwd.tile64x64.hd256" in classes_of("sm90", hd256, direction="backward")
    # SM100 runs no 2-CTA with block sparsity (forward: use_block_sparsity; backward: an odd KV factor)
    big = replace(MOD, d=128, dv=128, seqlen_q=1024, seqlen_k=1024)
    dense = replace(big, mask_mod="", block_sparse=()).call()
    assert "sm100.fwd.2cta" in classes_of("sm100", dense, direction="forward")
    assert "sm100.fwd.1cta" in classes_of("sm100", big.call(), direction="forward")
    assert "sm100.bwd.1cta" in classes_of("sm100", big.call(), direction="backward")
    assert "sm100.bwd.2cta" in classes_of("sm100", replace(big, block_sparse=(128, 256)).call(), direction="backward")


def test_sm90_block_sparse_tiles_are_production_functions_results():
    """The SM90 tiles with block sparsity are what production's own ``_tile_size_fwd_sm90`` (with
    ``sparse_block_size_q``), ``_fit_sm90_fwd_tile_to_block_sparsity`` and ``_tile_size_bwd_sm90``
    return (their text from interface.py, run here: pure functions)."""
    import ast
    import itertools
    from dataclasses import dataclass

    from fa4.code_paths import sm90_bwd_tile, sm90_fwd_tile

    src = os.environ.get("FA4_SOURCE")
    if not src or not (Path(src) / "interface.py").is_file():
        pytest.skip("production's source not found: set FA4_SOURCE to flash_attn/cute (e.g. of flash-attn-4 4.0.0b36)")
    tree = ast.parse((Path(src) / "interface.py").read_text())
    fit = "_fit_sm90_fwd_tile_to_block_sparsity"
    want = {"FwdConfig", "BwdConfig", "_tile_size_fwd_sm90", "_tile_size_bwd_sm90", fit}
    nodes = [n for n in tree.body if getattr(n, "name", None) in want]
    assert {n.name for n in nodes} == want
    ns = {"dataclass": dataclass}
    exec(compile(ast.Module(body=nodes, type_ignores=[]), "interface.py", "exec"), ns)
    blocks = [(128, 128), (256, 128), (64, 128), (128, 64), (192, 96), (384, 48)]
    dims = [(64, 64), (96, 96), (128, 128), (192, 128), (192, 256), (256, 256), (72, 72)]
    for (d, dv), bs, (causal, local) in itertools.product(dims, blocks, ((False, False), (True, False), (False, True))):
        f = ns["_tile_size_fwd_sm90"](d, dv, causal, local, sparse_block_size_q=bs[0])
        f = ns[fit](f, bs[0], bs[1])
        tile = sm90_fwd_tile(d=d, dv=dv, causal=causal, local=local, block_sparse=bs)
        assert tile == (f.m_block_size, f.n_block_size), (d, dv, bs, causal, local)
        b = ns["_tile_size_bwd_sm90"](d, dv, causal, local, sparse_block_size_q=bs[0])
        t = sm90_bwd_tile(d=d, dv=dv, causal=causal, local=local, block_sparse=bs)
        assert (t.tile_m, t.tile_n, t.dkv_swap_ab, t.dq_swap_ab, t.stages_do) == (
            b.m_block_size, b.n_block_size, b.dKV_swapAB, b.dQ_swapAB, b.num_stages_dO), (d, dv, bs)  # fmt: skip


def test_coverage_counts_the_mod_classes_and_features():
    from audits.verdict.coverage import coverage

    def rec(c):
        return {"case": c.name, "config": c.as_dict(), "verdict": "pass", "status": "ran", "out": {"max_abs": 0.0}}

    cov = coverage(cases=[ALL_KINDS], records=[rec(ALL_KINDS)], domain=ALL, arch="sm90", backward=False)
    for k in MOD_KINDS:
        assert cov["classes"][f"sm90.fwd.{k}"]["forward"] == ALL_KINDS.name
        assert cov["features"][k]["forward"] == ALL_KINDS.name
    plain = coverage(cases=[Case()], records=[rec(Case())], domain=NONE, arch="sm90", backward=False)
    for k in MOD_KINDS:  # a kernel without mods: never missed, outside its domain
        assert "outside_domain" in plain["classes"][f"sm90.fwd.{k}"] and k not in plain["features"]
