"""The static audit of the SM100 backward: fact extraction on PTX written here (the instruction
patterns of production's backward, data flow included) and on production's real sm_100a PTX
(tests/data/ptx/bwd_*.ptx.xz: two whole backward calls, compiled on a CPU-only machine with
flash-attn-4 4.0.0b36 / cutlass-dsl 4.8.1), the comparison with the backward model, and a real
compile (skipped without the gpu extra)."""

import gzip
import json
import lzma
from pathlib import Path

import pytest

from audits import cli
from audits.checks.static import backward
from audits.checks.static.backward import backward_groups, compare_backward_facts, expected_backward_facts
from audits.checks.static.facts import PtxFormatError, f32_hex
from audits.checks.static.facts_bwd import KERNEL_MARK, _flushes_subnormals, backward_facts
from audits.suites.cases import Case, release_suite
from fa4.ex2 import POLY_EX2
from fa4.refusals import refusal_of
from tests.test_static import _production_importable

DATA = Path(__file__).parent / "data" / "ptx"
ENTRY = (
    ".visible .entry kernel_cutlass_kernel_flash_attncute{}_object_at__x(\n\t.param .align 8 .b8 k_param_8[40]\n)\n{{"
)


def _softmax_pair(i: int, ex2: str, p_cvt: str, ds_cvt: str, softcap: bool) -> list[str]:
    """One pair of scores: P = exp2(fma(S, scale_log2, -lse)), converted; dS = P * (dP - D),
    (softcap: times (1 - t*t)), converted — registers numbered from ``i``."""
    r = lambda k: f"%r{100 * i + k}"
    rd = lambda k: f"%rd{100 * i + k}"
    L = [f"\tfma.rn.f32x2 \t{rd(1)}, {rd(2)}, {rd(3)}, {rd(4)};", f"\tmov.b64 \t{{{r(1)}, {r(2)}}}, {rd(1)};"]
    L += [f"\t{ex2} \t{r(3)}, {r(1)};", f"\t{ex2} \t{r(4)}, {r(2)};", f"\t{p_cvt} {r(5)}, {r(4)}, {r(3)};"]
    L += [
        f"\ttcgen05.ld.sync.aligned.32x32b.x2.b32 {{{r(6)}, {r(7)}}}, [{r(8)}];",
        f"\tmov.b64 \t{rd(5)}, {{{r(6)}, {r(7)}}};",
        f"\tld.shared.v2.b64 \t{{{rd(6)}, {rd(7)}}}, [{r(9)}+16];",
        f"\tsub.rn.f32x2 \t{rd(8)}, {rd(5)}, {rd(6)};",
        f"\tmov.b64 \t{rd(9)}, {{{r(3)}, {r(4)}}};",
        f"\tmul.rn.f32x2 \t{rd(10)}, {rd(9)}, {rd(8)};",
    ]
    if softcap:
        L += [
            f"\ttanh.approx.f32 \t{r(20)}, {r(21)};",
            f"\ttanh.approx.f32 \t{r(22)}, {r(23)};",
            f"\tmov.b64 \t{rd(11)}, {{{r(20)}, {r(22)}}};",
            f"\tmul.f32x2 \t{rd(12)}, {rd(11)}, {rd(11)};",
            f"\tsub.f32x2 \t{rd(13)}, {rd(14)}, {rd(12)};",
            f"\tmul.f32x2 \t{rd(15)}, {rd(13)}, {rd(10)};",
            f"\tselp.b64 \t{rd(17)}, {rd(15)}, {rd(16)}, %p{i};",  # out-of-bounds keys zeroed
        ]
    ds = rd(17) if softcap else rd(10)
    return L + [f"\tmov.b64 \t{{{r(10)}, {r(11)}}}, {ds};", f"\t{ds_cvt} {r(12)}, {r(11)}, {r(10)};"]


def _preprocess_fold(fold: list[int]) -> list[str]:
    """The preprocess's D = rowsum(O * dO) for one thread: 128-bit loads of the columns in
    ``fold``, unpacked, then one FFMA chain from 0 in ``fold``'s order."""
    blocks = sorted({c // 8 for c in fold})
    L = []
    for j, blk in enumerate(blocks):
        regs = [f"%r{100 + 4 * j + w}" for w in range(4)]
        L.append(f"\tld.global.v4.b32 \t{{{', '.join(regs)}}}, [%rd1+{blk * 16}];")
        L += [f"\tmov.b32 \t{{%rs{200 + 8 * j + 2 * w}, %rs{201 + 8 * j + 2 * w}}}, {regs[w]};" for w in range(4)]
    L.append("\tmov.b32 \t%r399, 0f00000000;")
    acc = "%r399"
    for i, c in enumerate(fold):
        rs = f"%rs{200 + 8 * blocks.index(c // 8) + c % 8}"
        L.append(f"\tfma.rn.f32.bf16 \t%r{400 + i}, {rs}, {rs}, {acc};")
        acc = f"%r{400 + i}"
    return L


def bwd_excerpt(
    *,
    fold=tuple(range(8)),
    pairs=4,
    ex2="ex2.approx.ftz.f32",
    p_cvt="cvt.rn.bf16x2.f32",
    ds_cvt="cvt.rn.bf16x2.f32",
    out_cvt="cvt.rn.bf16x2.f32",
    reduce="cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32",
    targets=1,
    softcap=False,
    post_cvt="cvt.rn.bf16x2.f32",
    extra="",
) -> str:
    """A backward call's kernels (preprocess, FlashAttentionBackwardSm100, postprocess) with the
    instruction and data-flow patterns of production's: ``targets`` float32 reduce targets (1:
    dQ; 3: dQ, dK, dV with GQA) and, without GQA, the in-kernel dK / dV cast ``out_cvt``."""
    head = [".version 8.8", ".target sm_100a", ".address_size 64"]
    pre = head + [ENTRY.format("flash_bwd_preprocessFlashAttentionBackwardPreprocess")]
    pre += _preprocess_fold(list(fold)) + ["\tmul.f32 \t%r5, %r6, 0f3FB8AA3B;"]
    main = head + [ENTRY.format("flash_bwd_sm100FlashAttentionBackwardSm100")]
    for t in range(targets):
        main += [
            f"\tld.param.b64 \t%rd{9000 + t}, [k_param_{8 + t}];",
            f"\tadd.s64 \t%rd{9100 + t}, %rd{9000 + t}, 64;",
        ]
    for i in range(1, pairs + 1):
        main += _softmax_pair(i, ex2, p_cvt, ds_cvt, softcap)
    main += [f"\t{reduce} [%rd{9100 + t}], [%r9200], %r9201;" for t in range(targets)]
    if targets == 1:  # no GQA: dV (from TMEM) and dK (times the scale) cast in the kernel
        main += ["\ttcgen05.ld.sync.aligned.32x32b.x2.b32 {%r9300, %r9301}, [%r9302];"]
        main += [f"\t{out_cvt} %r9303, %r9301, %r9300;", "\tmul.rn.f32x2 \t%rd9304, %rd9305, %rd9306;"]
        main += ["\tmov.b64 \t{%r9307, %r9308}, %rd9304;", f"\t{out_cvt} %r9309, %r9308, %r9307;"]
    main += [extra]
    post = head + [ENTRY.format("flash_bwd_postprocessFlashAttentionBackwardPostprocess")]
    post += ["\tmul.f32x2 \t%rd1, %rd2, %rd3;", "\tmov.b64 \t{%r1, %r2}, %rd1;", f"\t{post_cvt} %r3, %r2, %r1;"]
    kernels = {"FlashAttentionBackwardPreprocess": pre, "FlashAttentionBackwardSm100": main}
    kernels["FlashAttentionBackwardPostprocess"] = post
    return "".join(f"{KERNEL_MARK}{k}\n" + "\n".join(v + ["\tret;", "}"]) + "\n" for k, v in kernels.items())


MHA = Case("bfloat16", 128, 128, 1, 4, 4, 512, 512)
GQA = Case("bfloat16", 64, 64, 1, 8, 2, 512, 512)
CAP = Case("bfloat16", 128, 128, 1, 4, 4, 512, 512, softcap=15.0)
TILES = {"tile_m": 128, "tile_n": 128, "dq_keys": 256}


#: the facts in which production's backward differs from the model: none since the model's
#: accumulator adds flush subnormals as production's float32 reduce-adds do (PTX ISA,
#: cp.reduce.async.bulk; fa4.model_bwd.reduce_add) — this audit found that difference first
FLUSH: set[str] = set()


def facts_of(ptx: str, tiles=TILES) -> dict:
    return {**backward_facts(ptx), "tiles": tiles}


def differing(f: dict, case: Case) -> set[str]:
    return {d["fact"] for d in compare_backward_facts(f, expected_backward_facts(case))}


def test_excerpt_facts_and_match():
    f = facts_of(bwd_excerpt())
    assert f["exp2.hardware"] == {"ex2.approx.ftz.f32": 8} and f["exp2.emulated"] == 0 and f["exp2.poly_degree"] is None
    assert f["p_convert"] == f["ds_convert"] == {"cvt.rn.bf16x2.f32": 4} and f["out_convert"] == {
        "cvt.rn.bf16x2.f32": 2
    }
    assert f["main.entries"] == {"FlashAttentionBackwardSm100": {"ex2": 8, "P": 8, "dS": 8}}
    assert f["reduce.targets"] == 1 and f["arith.nonstandard"] == {} and f["postprocess.convert_reads"] == ["mul.f32x2"]
    assert differing(f, MHA) == FLUSH
    gqa = facts_of(bwd_excerpt(targets=3), {"tile_m": 128, "tile_n": 128, "dq_keys": 128})
    assert gqa["reduce.targets"] == 3 and gqa["out_convert"] == {}
    assert differing(gqa, GQA) == FLUSH
    cap = facts_of(bwd_excerpt(softcap=True))  # dS traced through (1 - t*t) and the out-of-bounds selp
    assert cap["tanh"] == 8 and cap["ds_convert"] == {"cvt.rn.bf16x2.f32": 4}
    assert differing(cap, CAP) == FLUSH
    assert _flushes_subnormals("red.global.add.f32") and not _flushes_subnormals("red.global.add.noftz.bf16x2")


def test_float32_reductions_flush_subnormals_as_the_model_does():
    """dQ (and GQA dK / dV) are accumulated by cp.reduce.async.bulk...add.f32, which flushes
    subnormal inputs and results to zero — the fact this audit found the model missing (now
    ``fa4.model_bwd.reduce_add``); a reduction keeping subnormals (the bf16 ``.noftz`` form) is a
    difference, named with the model's expectation."""
    assert compare_backward_facts(facts_of(bwd_excerpt()), expected_backward_facts(MHA)) == []
    diffs = compare_backward_facts(
        facts_of(bwd_excerpt(reduce="red.global.add.noftz.bf16x2")), expected_backward_facts(MHA)
    )
    (d,) = [d for d in diffs if d["fact"] == "reduce.flush"]
    assert d["production"] == [] and d["model"].startswith("every reduction: float32 adds flushing subnormal")


EMULATION = "\n".join(
    ["\tadd.rm.f32x2 \t%rd8000, %rd8001, %rd8002;"] + [f"\tmov.b32 \t%r8003, {f32_hex(c)};" for c in POLY_EX2[3]]
)


@pytest.mark.parametrize(
    "change,case,facts",
    [
        ({"extra": "\tadd.rm.f32 \t%r8000, %r8001, %r8002;"}, MHA, {"exp2.emulated", "arith.nonstandard"}),
        ({"extra": "\tfma.rz.f32 \t%r8000, %r8001, %r8002, %r8003;"}, MHA, {"arith.nonstandard"}),
        ({"extra": "\tmul.ftz.f32 \t%r8000, %r8001, %r8002;"}, MHA, {"arith.nonstandard"}),
        ({"extra": "\tdiv.approx.f32 \t%r8000, %r8001, %r8002;"}, MHA, {"arith.nonstandard"}),
        ({"extra": EMULATION}, MHA, {"exp2.emulated", "exp2.poly_degree", "arith.nonstandard"}),
        ({"ex2": "ex2.approx.f32"}, MHA, {"exp2.hardware"}),  # subnormal results no longer flushed
        ({"p_cvt": "cvt.rz.bf16x2.f32"}, MHA, {"p_convert"}),  # P truncated
        ({"ds_cvt": "cvt.rz.bf16x2.f32"}, MHA, {"ds_convert"}),  # dS truncated
        ({"ds_cvt": "cvt.rn.f16x2.f32"}, MHA, {"ds_convert"}),  # dS in another dtype
        ({"ds_cvt": "mov.b32"}, MHA, {"ds_convert", "main.entries"}),  # dS not converted (kept f32)
        ({"reduce": "red.global.add.noftz.bf16x2"}, MHA, {"reduce", "reduce.flush"}),  # dQ accumulated in bf16
        ({"targets": 1}, GQA, {"reduce.targets", "out_convert"}),  # GQA dK / dV not through f32 adds
        ({}, CAP, {"tanh"}),  # softcap without tanh
        ({"post_cvt": "cvt.rz.bf16x2.f32"}, MHA, {"postprocess.convert"}),
        ({"fold": tuple(range(7, -1, -1))}, MHA, {"preprocess.fold"}),  # D summed in another order
    ],
)
def test_each_seeded_wrong_fact_is_reported(change, case, facts):
    tiles = {**TILES, "dq_keys": 128} if case is GQA else TILES
    assert differing(facts_of(bwd_excerpt(**change), tiles), case) == facts | FLUSH


def test_preprocess_fold_is_element_major_across_chunks():
    """Head dim 256: a thread's two chunks are folded 0, 128, 1, 129, ... (production's PTX,
    ``fa4.model_bwd.fold_order``); the chunk-major order is reported."""
    from fa4.model_bwd import fold_order

    d256 = Case("bfloat16", 256, 256, 1, 4, 4, 512, 512)
    want = fold_order(256, 32)
    assert want[:4] == [0, 128, 1, 129]
    assert backward_facts(bwd_excerpt(fold=want))["preprocess.fold"] == [want]
    chunk_major = [c * 128 + e for c in range(2) for e in range(8)]
    assert "preprocess.fold" in differing(facts_of(bwd_excerpt(fold=chunk_major)), d256)
    assert "preprocess.fold" not in differing(facts_of(bwd_excerpt(fold=want)), d256)


def test_tiles_and_unsupported_configurations_are_differences():
    f = facts_of(bwd_excerpt(), {"tile_m": 128, "tile_n": 64, "dq_keys": 128})
    assert differing(f, MHA) == {"tiles"} | FLUSH
    with pytest.raises(NotImplementedError, match=r"got \(192, 192\)"):
        expected_backward_facts(Case("bfloat16", 192, 192))


@pytest.mark.parametrize(
    "ptx,message",
    [
        (".target sm_100a\n.entry k()\n{\n}\n", "no '// fa4-audit kernel: CLASS' line"),
        (bwd_excerpt().replace(".visible .entry", ".visible .func"), "no .entry"),
        (bwd_excerpt(ex2="mov.b32"), "no ex2 in FlashAttentionBackwardSm100"),
        (
            bwd_excerpt().replace("ld.param.b64 \t%rd9000, [k_param_8]", "ld.global.b64 \t%rd9000, [%rd1]"),
            "does not trace to a kernel parameter",
        ),
        (bwd_excerpt().replace("FlashAttentionBackwardPostprocess\n", "FlashAttentionBackwardSm100\n", 1), "one main"),
    ],
)
def test_unrecognised_backward_ptx_is_an_error(ptx, message):
    with pytest.raises(PtxFormatError, match=message):
        backward_facts(ptx)


def _cache(tmp_path: Path, case: Case, ptx: str, chosen: dict) -> Path:
    (tmp_path / f"bwd-{case.name}.ptx.gz").write_bytes(gzip.compress(ptx.encode()))
    (tmp_path / f"bwd-{case.name}.ptx.json").write_text(json.dumps(chosen))
    return tmp_path


GENERIC = {"kernel_class": "FlashAttentionBackwardSm100", "attributes": {"tile_m": 128, "tile_n": 128}}


@pytest.mark.parametrize(
    "name,case,two_cta",
    [
        ("bwd_bf16_d64_gqa", Case("bfloat16", 64, 64, 1, 8, 2, 384, 256, softcap=15.0, sink=True), False),
        ("bwd_bf16_d128_mha", Case("bfloat16", 128, 128, 1, 4, 4, 127, 512, causal=True, softcap=15.0), True),
    ],
)
def test_production_backward_ptx_matches_the_model(name, case, two_cta, tmp_path):
    """Production's real backward PTX (all kernels of one call): every fact agrees with the model;
    the same PTX with the dP - D subtraction rounding toward
    zero, or with P and dS truncated instead of rounded, differs in those facts too."""
    ptx = lzma.decompress((DATA / f"{name}.sm_100a.ptx.xz").read_bytes()).decode()
    chosen = {**GENERIC, "attributes": {**GENERIC["attributes"], "use_2cta_instrs": two_cta}}
    rec = backward.audit_backward_group(case, [case.name], ptx_dir=_cache(tmp_path, case, ptx, chosen), no_driver=True)
    assert rec["compiled"] == "cached" and {d["fact"] for d in rec["differences"]} == FLUSH, rec["differences"]
    f = rec["facts"]
    assert f["exp2.hardware"] == {"ex2.approx.ftz.f32": 64 + case.sink} and f["tanh"] == 64
    assert f["reduce.targets"] == (3 if case.heads_q > case.heads_kv else 1)
    for tamper, facts in (
        (lambda t: t.replace("sub.rn.f32x2", "sub.rz.f32x2", 1), {"arith.nonstandard"}),
        (lambda t: t.replace("cvt.rn.bf16x2.f32", "cvt.rz.bf16x2.f32"), {"p_convert", "ds_convert"}),
    ):
        _cache(tmp_path, case, tamper(ptx), chosen)
        rec = backward.audit_backward_group(case, [case.name], ptx_dir=tmp_path, no_driver=True)
        assert facts | FLUSH <= {d["fact"] for d in rec["differences"]}, rec["differences"]


def test_cli_backward_divergence_exits_1_naming_fact_values_and_group(tmp_path, capsys, monkeypatch):
    from audits.cli import static as static_cli

    monkeypatch.setattr(static_cli, "_production_versions", lambda: {"flash-attn-4": "x", "nvidia-cutlass-dsl": "y"})
    (tmp_path / "ptx").mkdir()
    _cache(tmp_path / "ptx", MHA, bwd_excerpt(ds_cvt="cvt.rz.bf16x2.f32"), GENERIC)
    cfg = json.dumps({k: v for k, v in MHA.as_dict().items() if k not in ("layout", "family", "seed")})
    argv = ["static", "--backward", "--compile-on", "cpu", "--config", cfg, "--out", str(tmp_path), "--quiet"]
    assert cli.main(argv) == 1
    out = capsys.readouterr().out
    assert (
        f"DIVERGED {MHA.name}: ds_convert: production {{'cvt.rz.bf16x2.f32': 4}}, model only cvt.rn.bf16x2.f32" in out
    )
    rep = json.loads((tmp_path / "static-backward.json").read_text())
    assert rep["schema"] == "fa4-audit/static-backward/1" and rep["groups"][0]["verdict"] == "diverged"
    assert "| ds_convert |" in (tmp_path / "static-backward.md").read_text()


def test_backward_groups_of_the_release_suite():
    # varlen cases: forward only (docs/varlen.md); mod cases: not compiled by the static audit (docs/mods.md)
    cases = [c for c in release_suite() if not c.varlen and not c.mods]
    groups = backward_groups(cases)
    names = sorted(n for _, ns in groups for n in ns)
    assert names == sorted(c.name for c in cases if not c.dtype.startswith("float8"))
    keys = {(g.compile_key, g.seqlen_q <= 128, g.seqlen_k <= 128) for g, _ in groups}
    # 115 groups from the covering array, 15 more from release's class cases (audits.suites.cases.class_cases:
    # their head dims 72, 104, 200 and (192, 128), and lengths 300 x 333 / 100 x 333, are their own),
    # 3 from the flag halves of the mods suite's cross-check pairs (audits.suites.cases.mods_cross_checks)
    assert len(keys) == len(groups) == 133 and all(g.batch == 1 for g, _ in groups)


def test_backward_refusals_are_documented():
    for what in ("learnable_sink", "softcap", "local attention"):
        hd256 = AssertionError(f"SM100 backward with head_dim=256 does not support {what}")
        assert refusal_of(hd256) is not None
    assert refusal_of(ValueError(str(hd256))) is None


@pytest.mark.skipif(
    not _production_importable(), reason="needs the gpu extra (flash-attn-4, nvidia-cutlass-dsl); no GPU needed"
)
def test_cpu_cross_compile_of_the_backward_matches_the_model(tmp_path):
    """Production compiles its backward here without a GPU (about 7 s per group on 2 cores) — the
    generic kernel with GQA and local window, and the dedicated head-dim-256 kernels — and every
    fact matches the backward model (exit 0); a configuration production refuses is skipped."""
    cfgs = [
        '{"dtype": "float16", "d": 64, "heads_q": 8, "heads_kv": 2, "seqlen_q": 300, "seqlen_k": 300, '
        '"window": [128, 32], "sink": true}',
        '{"dtype": "bfloat16", "d": 256, "dv": 256, "heads_q": 4, "heads_kv": 2, "seqlen_q": 256, "causal": true}',
        '{"dtype": "bfloat16", "d": 256, "dv": 256, "softcap": 15.0}',
    ]
    argv = ["static", "--backward", "--compile-on", "cpu", "--jobs", "2", "--out", str(tmp_path), "--quiet"]
    assert cli.main(argv + [a for c in cfgs for a in ("--config", c)]) == 0
    rep = json.loads((tmp_path / "static-backward.json").read_text())
    verdicts = [(g["verdict"], g.get("kernel_class")) for g in rep["groups"]]
    assert {d["fact"] for d in rep["groups"][0]["differences"]} == FLUSH
    assert verdicts == [
        ("match", "FlashAttentionBackwardSm100"),
        ("match", "BlackwellFusedMultiHeadAttentionBackward"),
        ("skipped", None),
    ]
    assert "does not support softcap" in rep["groups"][2]["reason"]
    assert rep["groups"][1]["facts"]["reduce.targets"] == 0 and rep["groups"][0]["facts"]["reduce.targets"] == 3
