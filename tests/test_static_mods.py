"""The static audit's mod facts (``audits.checks.static.mod_facts``): the score_mod's and mask_mod's float32
instructions read as differentials against the same kernel without the mod, and the mod
attributes production records, forward and backward, on production's real sm_100a PTX
(tests/data/ptx/mods: compiled on a CPU-only machine with flash-attn-4 4.0.0b36 / cutlass-dsl
4.8.1, 2026-12-02, the ``mods`` suite's shape at batch 1; the forward texts cut to the lines the
facts read, ``cut_ptx`` below, the backward ones whole), seeded divergences, and the CLI."""

import dataclasses
import gzip
import json
import lzma
import re
import shutil
from collections import Counter, namedtuple
from pathlib import Path

import pytest
import torch

from audits import cli
from audits.checks.static import backward, core, mod_facts
from audits.checks.static.backward import audit_backward_group, backward_groups
from audits.checks.static.core import StaticError, audit_group, static_groups
from audits.checks.static.facts import PtxFormatError, kernel_facts
from audits.checks.static.mod_facts import NEG_INF_SELECT, differential, f32_elements, mask_baseline, score_baseline
from audits.suites.cases import Case, smoke_suite
from tests.test_static import _production_importable

DATA = Path(__file__).parent / "data" / "ptx" / "mods"
SHAPE = dict(dtype="bfloat16", batch=1, heads_q=4, heads_kv=2, seqlen_q=256, seqlen_k=384)
ALIBI = Case(**SHAPE, d=64, dv=64, score_mod="alibi")
SOFTCAP = Case(**SHAPE, d=64, dv=64, score_mod="softcap")
CAUSAL_MM = Case(**SHAPE, d=128, dv=128, mask_mod="causal")
VERSIONS = {"flash-attn-4": "4.0.0b36", "nvidia-cutlass-dsl": "4.8.1"}


def cut_ptx(text: str) -> str:
    """What the forward fixtures keep of a kernel's PTX: structure lines, every float32
    instruction, conversions, selects, MUFU ops and any line with a float immediate
    (``kernel_facts`` and ``f32_elements`` give the same answers on the cut text but ``lines``)."""
    keep = re.compile(r"^\s*(\.target|\.version|\.address_size|(\.visible\s+)?\.entry|// fa4-audit kernel|[{}])")
    out = []
    for line in text.splitlines(keepends=True):
        m = re.match(r"^\s*(?:@!?%p\d+\s+)?([a-z][a-z0-9_]*(?:\.[a-z0-9_:]+)*)", line)
        parts = m.group(1).split(".") if m else []
        if (
            keep.match(line)
            or re.search(r"0f[0-9A-Fa-f]{8}", line)
            or any(p in ("f32", "f32x2") for p in parts[1:])
            or (parts and parts[0] in ("ex2", "rcp", "tanh", "div", "cvt", "selp"))
        ):
            out.append(line)
    return "".join(out)


def ptx_text(stem: str) -> str:
    return lzma.decompress((DATA / f"{stem}.ptx.xz").read_bytes()).decode()


def ptx_dir(tmp_path: Path, *, edit=None) -> Path:
    """The fixtures as the audit's PTX cache (``cached_ptx``: ``<stem>.ptx.gz`` and ``.ptx.json``),
    ``edit(stem, text)`` applied to each text."""
    d = tmp_path / "ptx"
    d.mkdir(parents=True, exist_ok=True)
    for f in DATA.glob("*.ptx.xz"):
        stem = f.name[: -len(".ptx.xz")]
        text = ptx_text(stem)
        (d / f"{stem}.ptx.gz").write_bytes(gzip.compress((edit(stem, text) if edit else text).encode()))
        shutil.copy(DATA / f"{stem}.ptx.json", d / f"{stem}.ptx.json")
    return d


def test_alibi_forward_adds_the_contracted_fma_the_model_assumes(tmp_path):
    """ALiBi on production's forward: per score one exact int->float conversion (the distance),
    one FMUL (slope * distance) and one ``fma.rn.f32`` — the scale's multiply contracted with the
    bias add, which fa4.mod_forms' ``_fused_bias`` models — and nothing else; every other fact
    of the kernel as without the mod; the attributes record the score_mod."""
    rec = audit_group(ALIBI, [ALIBI.name], ptx_dir=ptx_dir(tmp_path), no_driver=True)
    assert rec["verdict"] == "match" and rec["compiled"] == "cached", rec["differences"]
    f = rec["facts"]
    assert f["mod.score_ops"] == {"cvt.rn.f32.s32": 1, "fma.rn.f32": 1, "mul.f32": 1}
    assert f["mod.attributes"] == {
        "score_mod": True, "mask_mod": False, "use_block_sparsity": False, "is_causal": False, "is_local": False,
    }  # fmt: skip
    assert rec["baselines"] == {"mod.score_ops": f"{score_baseline(ALIBI).name} (cached)"}
    assert f["softmax.steps"] == 2 and f["exp2.hardware"] == {"ex2.approx.ftz.f32": 225}


@pytest.mark.parametrize(
    "table",
    [
        # the reference form's order, uncontracted: acc * scale rounded, then the add
        {"cvt.rn.f32.s32": 1, "mul.f32": 2, "add.f32": 1},
        {"cvt.rn.f32.s32": 1, "mul.f32": 1, "fma.rn.f32": 2},
    ],
    ids=["uncontracted-model-form", "count-off-by-one"],
)
def test_a_model_form_that_differs_is_reported_by_fact_name(table, tmp_path, monkeypatch):
    monkeypatch.setitem(mod_facts.SCORE_OPS, "alibi", table)
    rec = audit_group(ALIBI, [ALIBI.name], ptx_dir=ptx_dir(tmp_path), no_driver=True)
    assert rec["verdict"] == "diverged"
    (d,) = rec["differences"]
    assert d == {
        "fact": "mod.score_ops",
        "production": {"cvt.rn.f32.s32": 1, "fma.rn.f32": 1, "mul.f32": 1},
        "model": dict(sorted(table.items())),
    }


def test_a_production_that_stops_contracting_is_reported(tmp_path):
    """The same seeded change from production's side: the mod's fma split into FMUL + FADD."""

    def split(stem, text):
        if stem != ALIBI.name:
            return text
        return re.sub(
            r"fma\.rn\.f32 \t(%r\d+), (%r\d+), (%r\d+), (%r\d+);",
            r"mul.f32 \t\1, \2, \3;\n\tadd.f32 \t\1, \1, \4;",
            text,
            count=256,  # one per score (2 steps x 128); the kernel's own 2 scalar fma stay
        )

    rec = audit_group(ALIBI, [ALIBI.name], ptx_dir=ptx_dir(tmp_path, edit=split), no_driver=True)
    diffs = {d["fact"]: d for d in rec["differences"]}
    assert list(diffs) == ["mod.score_ops"]
    assert diffs["mod.score_ops"]["production"] == {"add.f32": 1, "cvt.rn.f32.s32": 1, "mul.f32": 2}


def test_a_differential_that_is_not_per_score_is_a_format_error(tmp_path):
    """One instruction more or less than a whole number per score, or a kernel with a different
    number of scores than its baseline: exit 2 (StaticError), never a match or a default."""
    one_less = lambda stem, text: text.replace("\tcvt.rn.f32.s32", "\tmov.b32", 1) if stem == ALIBI.name else text
    with pytest.raises(StaticError, match=r"cvt\.rn\.f32\.s32 differs by 255 elements .* not a whole number"):
        audit_group(ALIBI, [ALIBI.name], ptx_dir=ptx_dir(tmp_path / "a", edit=one_less), no_driver=True)
    a, b = Counter({"mul.f32": 512}), Counter({"mul.f32": 256})
    with pytest.raises(PtxFormatError, match="computes 384 scores with the mod and 256 without"):
        differential(a, b, scores=384, scores_without=256, what="test")
    assert differential(a, b, scores=256, scores_without=256, what="test") == {"mul.f32": 1}


def test_mask_mod_adds_one_minus_inf_select_per_score_and_no_arithmetic(tmp_path):
    """A mask_mod against the same kernel without it (and without the causal flag production
    drops): one ``selp.f32 ..., 0fFF800000`` per score, no float arithmetic; the kernel records
    the mask_mod and is_causal False."""
    rec = audit_group(CAUSAL_MM, [CAUSAL_MM.name], ptx_dir=ptx_dir(tmp_path), no_driver=True)
    assert rec["verdict"] == "match", rec["differences"]
    assert rec["facts"]["mod.mask_ops"] == {NEG_INF_SELECT: 1}
    assert rec["facts"]["mod.attributes"]["mask_mod"] and not rec["facts"]["mod.attributes"]["is_causal"]
    # a mask that also did arithmetic on the score (one FADD per score) is reported
    add = lambda stem, text: (
        text.replace("\tselp.f32", "\tadd.f32 \t%r1, %r1, %r1;\n\tselp.f32", 256) if "mm-" in stem else text
    )
    rec = audit_group(CAUSAL_MM, [CAUSAL_MM.name], ptx_dir=ptx_dir(tmp_path / "b", edit=add), no_driver=True)
    assert [d["fact"] for d in rec["differences"]] == ["mod.mask_ops"]


def test_a_mask_may_select_more_than_once_per_score_but_not_less_nor_compute():
    """Production's sliding-window mask is two -inf selects per score in one of its two softmax
    steps (514 against 130 in the mods suite's kernels: 1.5 per score): a match, as selecting
    -inf twice changes no value; a mask reaching half the scores, or adding arithmetic, is not."""
    want = {"mod.mask_ops": mod_facts.MASK_OPS}
    base = Counter({NEG_INF_SELECT: 130, "mul.f32": 6})
    judge = lambda extra: mod_facts.compare_mod_facts(
        {"mod.mask_ops": differential(base + Counter(extra), base, scores=256, scores_without=256, what="t")}, want
    )
    assert judge({NEG_INF_SELECT: 384}) == []
    (d,) = judge({NEG_INF_SELECT: 128})
    assert d["fact"] == "mod.mask_ops" and d["production"] == {NEG_INF_SELECT: 0.5}
    assert judge({NEG_INF_SELECT: 256, "add.f32": 256})[0]["production"] == {"add.f32": 1, NEG_INF_SELECT: 1.0}


def test_causal_beside_a_mask_mod_is_dropped_in_the_forward_kept_in_the_backward():
    """The semantic trap (docs/mods.md) as the expectations state it: the forward's kernel
    non-causal with a mask_mod (``_resolve_causal_local_window``), the backward's causal; the
    model's numerics for the group are the non-causal ones (its tuning key and 2-CTA)."""
    c = dataclasses.replace(CAUSAL_MM, causal=True, mask_mod="document")
    assert mod_facts.expected_attributes(c)["is_causal"] is False
    assert mod_facts.expected_attributes(c, backward=True)["is_causal"] is True
    assert core.case_numerics(c) == core.case_numerics(dataclasses.replace(c, causal=False))
    assert core.case_numerics(c) != core.case_numerics(dataclasses.replace(c, mask_mod=""))
    assert mask_baseline(c).causal is False and mask_baseline(c, backward=True).causal is True
    assert mask_baseline(dataclasses.replace(c, block_sparse=(256, 128))) is None  # more softmax steps: no differential


def test_attributes_that_differ_are_reported_and_a_record_without_them_is_an_error(tmp_path):
    d = ptx_dir(tmp_path)
    side = d / f"{CAUSAL_MM.name}.ptx.json"
    chosen = json.loads(side.read_text())
    chosen["attributes"]["is_causal"] = True  # production kept causal beside the mask_mod
    side.write_text(json.dumps(chosen))
    rec = audit_group(CAUSAL_MM, [CAUSAL_MM.name], ptx_dir=d, no_driver=True)
    (diff,) = rec["differences"]
    assert diff["fact"] == "mod.attributes" and diff["production"]["is_causal"] and not diff["model"]["is_causal"]
    del chosen["mods"]
    side.write_text(json.dumps(chosen))
    with pytest.raises(StaticError, match="has no mod attributes"):
        audit_group(CAUSAL_MM, [CAUSAL_MM.name], ptx_dir=d, no_driver=True)


@pytest.mark.parametrize(
    "case,ops",
    [
        (ALIBI, {"cvt.rn.f32.s32": 1, "fma.rn.f32": 1, "mul.f32": 1}),
        # the forward's div / tanh once, shared with the backward form (the same x); 1 - t*t as mul.f32, sub.f32
        (SOFTCAP, {"div.rn.f32": 1, "mul.f32": 4, "sub.f32": 1, "tanh.approx.f32": 1}),
    ],
    ids=["alibi", "softcap"],
)
def test_backward_recomputes_the_forward_mod_and_adds_its_derivative(case, ops, tmp_path):
    """The backward's main kernel: the forward score mod recomputed as the model's form (ALiBi's
    contracted fma again), the identity score_mod_bwd adding nothing, softcap's derivative
    ``g (1 - t^2)``; the tanh fact one per exp2 for softcap as a score_mod, as for the flag."""
    rec = audit_backward_group(case, [case.name], ptx_dir=ptx_dir(tmp_path), no_driver=True)
    assert rec["verdict"] == "match", rec["differences"]
    assert rec["facts"]["mod.score_ops"] == ops
    assert rec["facts"]["mod.attributes"]["score_mod_bwd"] is True
    assert rec["facts"]["tanh"] == (rec["facts"]["main.ex2"] if case.score_mod == "softcap" else 0)
    broken = dict(ops, **{"sub.f32": 0})  # a model whose 1 - t*t is not there, or ALiBi with a stray sub
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(mod_facts.SCORE_OPS_BWD, case.score_mod, broken)
        rec = audit_backward_group(case, [case.name], ptx_dir=ptx_dir(tmp_path), no_driver=True)
    assert [d["fact"] for d in rec["differences"]] == ["mod.score_ops"]


def test_backward_mask_mod_selects_minus_inf_bits_and_adds_no_arithmetic(tmp_path):
    """The backward masks S with ``selp.b32 %r, -8388608, ...`` (-inf's bits), several chained
    per score (the mask_mod, the sequence ends): at least one per score, no float arithmetic."""
    c = dataclasses.replace(CAUSAL_MM, d=64, dv=64)
    rec = audit_backward_group(c, [c.name], ptx_dir=ptx_dir(tmp_path), no_driver=True)
    assert rec["verdict"] == "match", rec["differences"]
    assert rec["facts"]["mod.mask_ops"] == {NEG_INF_SELECT: 3.0}
    assert rec["facts"]["mod.attributes"]["mask_mod"] and rec["facts"]["mod.attributes"]["score_mod_bwd"] is False


def test_backward_beside_causal_applies_no_mask_mod_as_the_model_assumes(tmp_path):
    """Document mask_mod with causal=True: production's backward keeps causal and then ignores the
    mask_mod (``mask.py`` ``apply_mask_sm100_transposed``: the mask_mod branch only without the
    flags) — its kernel has exactly the causal-only kernel's float instructions and selects, though
    it records the mask_mod; ``fa4.model_bwd`` does the same.  A model expecting the mask applied
    there diverges on ``mod.mask_ops``."""
    c = dataclasses.replace(CAUSAL_MM, d=64, dv=64, causal=True, mask_mod="document")
    rec = audit_backward_group(c, [c.name], ptx_dir=ptx_dir(tmp_path), no_driver=True)
    assert rec["verdict"] == "match", rec["differences"]
    assert rec["facts"]["mod.mask_ops"] == {} and rec["facts"]["mod.attributes"]["is_causal"] is True
    assert rec["facts"]["mod.attributes"]["mask_mod"] is True
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mod_facts, "expected_mod_facts", lambda c, backward: {"mod.mask_ops": mod_facts.MASK_OPS})
        mp.setattr(backward, "expected_mod_facts", mod_facts.expected_mod_facts)
        rec = audit_backward_group(c, [c.name], ptx_dir=ptx_dir(tmp_path), no_driver=True)
    assert [d["fact"] for d in rec["differences"]] == ["mod.mask_ops"]


def test_f32_elements_counts_packed_pairs_and_minus_inf_selects():
    ptx = "\n".join(
        [
            "\tmul.f32x2 \t%rd1, %rd2, %rd3;",
            "\tmul.f32 \t%r1, %r2, %r3;",
            "\tselp.f32 \t%r4, %r5, 0fFF800000, %p1;",
            "\tselp.b32 \t%r4, -8388608, %r5, %p1;",  # the backward's: -inf's bits as an integer
            "\tselp.f32 \t%r4, %r5, %r6, %p1;",  # a select between values: not a mask
            "\tcvt.rn.bf16x2.f32 \t%r7, %r8, %r9;",
            "\tadd.s32 \t%r10, %r11, %r12;",  # integer index arithmetic: not numerics
        ]
    )
    assert f32_elements(ptx) == Counter({"mul.f32": 3, NEG_INF_SELECT: 2, "cvt.rn.bf16x2.f32": 2})
    # the score_mod differential leaves -inf selects to the mask's fact (their count follows how
    # the compiler merges a mask's conditions: the sliding window's backward, one less beside ALiBi)
    a, b = Counter({"fma.rn.f32": 256, NEG_INF_SELECT: 512}), Counter({NEG_INF_SELECT: 768})
    assert differential(a, b, scores=256, scores_without=256, what="t", selects=False) == {"fma.rn.f32": 1}


def test_max_offset_ignores_a_register_that_is_not_a_constant():
    """The block-sparse forward resets its running row max to -inf per block list and later
    subtracts it in the rescale: a register set once to a constant and elsewhere to a computed
    value is no max_offset; a register only ever set to one constant is."""
    from tests.test_static import excerpt

    loop = "\tmov.b32 \t%r90, 0fFF800000;\n\tmax.f32 \t%r90, %r91, %r92;\n\tsub.f32 \t%r93, %r90, %r94;"
    assert kernel_facts(excerpt(extra=loop), tile_n=128)["max_offset"] == 0.0
    const = "\tmov.b32 \t%r90, 0fFF800000;\n\tsub.f32 \t%r93, %r90, %r94;"
    assert kernel_facts(excerpt(extra=const), tile_n=128)["max_offset"] == float("-inf")
    assert kernel_facts(excerpt(extra="\tdiv.s32 \t%r95, %r96, %r97;"), tile_n=128)["division"] == {}


def test_static_groups_include_mod_cases_and_softcap_mod_expects_the_flag_facts():
    cases = smoke_suite()
    mods = [c for c in cases if c.mods and not c.varlen]  # the varlen entry's kernels are not compiled here
    assert mods and {n for _, ns in static_groups(cases) for n in ns} >= {c.name for c in mods}
    assert {n for _, ns in backward_groups(cases) for n in ns} >= {c.name for c in mods}
    assert core.expected_facts(SOFTCAP)["tanh"] is True
    assert backward.expected_backward_facts(SOFTCAP)["tanh"] is True


def test_cli_audits_mod_groups_and_names_a_divergence(tmp_path, capsys, monkeypatch):
    """``fa4-audit static --config`` with a mod case, judged from the fixtures (the compile
    monkeypatched to fail, so only the cached PTX is read): exit 0 with the mod facts in the
    report; a seeded model table: exit 1 naming the fact, both values and the group."""
    from audits.cli import static as static_cli

    monkeypatch.setattr(static_cli, "_production_versions", lambda: VERSIONS)

    def no_compile(*a, **kw):
        raise AssertionError("the fixtures are cached: nothing may compile")

    monkeypatch.setattr(core, "_compile", no_compile)
    cfg = json.dumps({k: v for k, v in ALIBI.as_dict().items() if k in ("dtype", "d", "dv", "score_mod")} | SHAPE)
    d = ptx_dir(tmp_path)
    argv = ["static", "--compile-on", "cpu", "--config", cfg, "--ptx-dir", str(d), "--quiet"]
    assert cli.main([*argv, "--out", str(tmp_path / "a")]) == 0
    (g,) = json.loads((tmp_path / "a" / "static.json").read_text())["groups"]
    assert g["group"] == ALIBI.name and g["facts"]["mod.score_ops"]["fma.rn.f32"] == 1
    assert cli.main([*argv, "--backward", "--out", str(tmp_path / "b")]) == 0
    capsys.readouterr()
    monkeypatch.setitem(mod_facts.SCORE_OPS, "alibi", {"cvt.rn.f32.s32": 1, "mul.f32": 2, "add.f32": 1})
    assert cli.main([*argv, "--out", str(tmp_path / "c")]) == 1
    out = capsys.readouterr().out
    assert f"DIVERGED {ALIBI.name}: mod.score_ops: production {{'cvt.rn.f32.s32': 1, 'fma.rn.f32': 1" in out
    assert "model {'add.f32': 1, 'cvt.rn.f32.s32': 1, 'mul.f32': 2}" in out


def test_fake_mods_replace_every_tensor_by_a_fake_cuda_tensor_alike():
    """``fa4.sm100_compile`` hands production FakeTensors of each aux tensor and each tensor field
    of the block-sparse tuples (same shape, stride, dtype, on cuda); callables and scalars pass."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from fa4 import sm100_compile

    Blocks = namedtuple("Blocks", "mask_block_cnt mask_block_idx block_size")
    aux = [torch.arange(6, dtype=torch.int32).reshape(2, 3).t(), torch.ones(4)]
    bs = Blocks(torch.zeros(1, 2, 3, dtype=torch.int32), torch.zeros(1, 2, 3, 4, dtype=torch.int32), (256, 128))
    fn = lambda *a: None
    real = {"score_mod": fn, "aux_tensors": aux, "aux_scalars": (0.5,), "block_sparse_tensors": bs}
    with FakeTensorMode():
        fake = sm100_compile._fake_mods({**real, "block_sparse_tensors_bwd": bs})
    assert fake["score_mod"] is fn and fake["aux_scalars"] == (0.5,)
    for got, want in [*zip(fake["aux_tensors"], aux), *zip(fake["block_sparse_tensors"][:2], bs[:2])]:
        assert isinstance(got, FakeTensor) and got.device.type == "cuda"
        assert (got.shape, got.stride(), got.dtype) == (want.shape, want.stride(), want.dtype)
    assert fake["block_sparse_tensors_bwd"].block_size == (256, 128)
    assert sm100_compile._real_mods({"batch": 1}) == {}


@pytest.mark.slow
@pytest.mark.skipif(
    not _production_importable(), reason="needs the gpu extra (flash-attn-4, nvidia-cutlass-dsl); no GPU needed"
)
def test_cpu_cross_compile_of_mod_groups_matches_the_model(tmp_path):
    """Production compiles ALiBi (and its baseline) and a block-sparse document mask here without
    a GPU, forward and backward (1-2 min each on 2 loaded cores), and every fact matches."""
    cfgs = [
        json.dumps(SHAPE | {"d": 64, "dv": 64, "score_mod": "alibi"}),
        json.dumps(SHAPE | {"d": 128, "dv": 128, "mask_mod": "document", "block_sparse": [256, 128]}),
    ]
    for extra in ([], ["--backward"]):
        argv = ["static", "--compile-on", "cpu", "--out", str(tmp_path), "--quiet", *extra]
        assert cli.main(argv + [a for c in cfgs for a in ("--config", c)]) == 0
    for name in ("static.json", "static-backward.json"):
        rep = json.loads((tmp_path / name).read_text())
        assert [g["verdict"] for g in rep["groups"]] == ["match", "match"], name
        assert rep["groups"][0]["facts"]["mod.score_ops"] == {"cvt.rn.f32.s32": 1, "fma.rn.f32": 1, "mul.f32": 1}
        assert rep["groups"][1]["facts"]["mod.attributes"]["use_block_sparsity"] is True


def test_a_backward_no_forward_call_reaches_is_skipped_without_compiling(monkeypatch, tmp_path):
    """SM100's forward refuses a 128-row sparse query block (two Q stages: 256 rows), though
    ``_flash_attn_bwd`` alone would compile it: the backward group is skipped, naming why, and
    nothing is compiled; a 256-row block is audited."""

    def no_compile(*a, **kw):
        raise AssertionError("compiled a backward no flash_attn_func call reaches")

    monkeypatch.setattr(backward, "cached_ptx", no_compile)
    refused = Case(**SHAPE, d=64, dv=64, mask_mod="document", block_sparse=(128, 128))
    rec = audit_backward_group(refused, [refused.name], ptx_dir=tmp_path, no_driver=True)
    assert rec["verdict"] == "skipped"
    assert rec["reason"].startswith("production's forward refuses block_q 128 (a multiple of q_stage * tile_m = 256")
    assert backward.forward_refusal(dataclasses.replace(refused, block_sparse=(256, 128))) is None
    assert backward.forward_refusal(dataclasses.replace(refused, block_sparse=())) is None
