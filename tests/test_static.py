"""The static fidelity audit: PTX fact extraction (on excerpts written here and on production's
real sm_100a PTX in tests/data/ptx), the comparison with FA4Numerics.sm100, and bad input."""

import dataclasses
import gzip
import json
import sys
from pathlib import Path

import pytest
import torch

from audits import cli
from audits.checks.static.core import audit_group, compare_facts, expected_facts, static_groups
from audits.checks.static.facts import PtxFormatError, f32_hex, kernel_facts
from audits.suites.cases import Case
from fa4.ex2 import POLY_EX2

DATA = Path(__file__).parent / "data" / "ptx"


def excerpt(
    *,
    steps=2,
    emu_per_step=24,
    degree=3,
    threshold=8.0,
    max_offset=0.0,
    ex2="ex2.approx.ftz.f32",
    cvt="cvt.rn.bf16x2.f32",
    rcp="rcp.approx.ftz.f32",
    extra="",
    tanh=0,
    tile_n=128,
) -> str:
    """A PTX module with the instruction mix of the SM100 forward kernel's softmax: ``steps``
    inlined softmax steps of ``tile_n`` exp2 each (``emu_per_step`` of them emulated in packed
    pairs), one rescale ex2 with its threshold compare, the bias, P conversion and rcp."""
    L = [".version 8.8", ".target sm_100a", ".address_size 64", ".visible .entry kernel(", ")", "{"]
    for _ in range(steps):
        L += ["\tfma.rn.f32x2 \t%rd1, %rd2, %rd3, %rd4;"] * (tile_n // 2)  # s * scale_log2 - bias, per pair
        L += [f"\t{ex2} \t%r1, %r2;"] * (tile_n - emu_per_step)
        for _ in range(emu_per_step // 2):
            L += [
                "\tmax.f32 \t%r3, %r4, 0fC2FE0000;",
                "\tmov.b32 \t%r5, 0f4B400000;",
                "\tadd.rm.f32x2 \t%rd5, %rd6, %rd7;",
                "\tsub.rn.f32x2 \t%rd8, %rd5, %rd7;",
            ]
            L += [f"\tmov.b32 \t%r6, {f32_hex(c)};" for c in POLY_EX2[degree]]
            L += ["\tfma.rn.f32x2 \t%rd9, %rd10, %rd11, %rd12;"] * degree
            L += ["\tshl.b32 \t%r7, %r8, 23;", "\tadd.s32 \t%r9, %r7, %r10;"]
        L += [f"\t{cvt} \t%r11, %r12, %r13;"] * (tile_n // 2)
        L += ["\tmul.f32 \t%r20, %r21, %r22;"] + (
            [f"\tmov.b32 \t%r23, {f32_hex(max_offset)};", "\tsub.f32 \t%r24, %r23, %r20;"] if max_offset else []
        )
        L += ["\tdiv.rn.f32 \t%r32, %r33, 0f41700000;", "\ttanh.approx.f32 \t%r30, %r32;"] * (tanh // steps)
    L += ["\tsub.f32 \t%r40, %r41, %r42;", "\tmul.f32 \t%r43, %r44, %r40;", f"\t{ex2} \t%r45, %r43;"]
    if threshold:
        L += [f"\tsetp.ge.f32 \t%p1, %r43, {f32_hex(-threshold)};"]
    L += [f"\t{rcp} \t%r50, %r51;", extra, "\tret;", "}"]
    return "\n".join(L) + "\n"


BF16 = Case("bfloat16", 128, 128, 1, 16, 16, 1024, 1024)  # 2-CTA: production emulates 24 of 128 per step
E4M3 = Case("float8_e4m3fn", 128, 128, 1, 16, 16, 1024, 1024)


def test_excerpt_matches_the_model():
    f = kernel_facts(excerpt(), tile_n=128)
    assert (
        f["softmax.steps"] == 2
        and f["exp2.emulated_per_step"] == 24
        and f["exp2.poly_degree"] == 3
        and f["exp2.fma_per_pair"] == 3
    )
    assert f["rescale.threshold"] == 8.0 and f["max_offset"] == 0.0 and f["arith.nonstandard"] == {}
    assert compare_facts(f, expected_facts(BF16)) == []


@pytest.mark.parametrize(
    "change,fact",
    [
        ({"degree": 4}, "exp2.poly_degree"),  # a new polynomial
        ({"emu_per_step": 32}, "exp2.emulated_per_step"),  # a new tuning table
        ({"threshold": 4.0}, "rescale.threshold"),
        ({"threshold": 0.0}, "rescale.threshold"),
        ({"max_offset": 8.0}, "max_offset"),
        ({"ex2": "ex2.approx.f32"}, "exp2.hardware"),  # subnormal results no longer flushed
        ({"cvt": "cvt.rz.bf16x2.f32"}, "p_convert"),  # P truncated instead of rounded
        ({"rcp": "rcp.rn.f32"}, "reciprocal"),
        ({"extra": "\tadd.rn.ftz.f32 \t%r60, %r61, %r62;"}, "arith.nonstandard"),
        ({"extra": "\tadd.rm.ftz.f32 \t%r60, %r61, %r62;"}, "exp2.emulated_scalar"),  # the scalar emulation appears
        ({"tanh": 256}, "tanh"),
        ({"extra": "\tdiv.full.f32 \t%r60, %r61, 0f41700000;"}, "arith.nonstandard"),  # approximate division
        ({"extra": "\tdiv.full.f32 \t%r60, %r61, 0f41700000;"}, "division"),
    ],
)
def test_each_changed_fact_is_reported(change, fact):
    diffs = compare_facts(kernel_facts(excerpt(**change), tile_n=128), expected_facts(BF16))
    assert fact in {d["fact"] for d in diffs}, diffs


def test_softcap_division_must_be_ieee_one_per_score():
    """Softcap's ``acc_S / softcap`` is ``div.rn.f32`` once per score (what ``div_rn`` models);
    the same count of scores divided by a multiply with the reciprocal — the form torch's CUDA
    division takes, which the model once had — is reported."""
    cap = dataclasses.replace(BF16, softcap=15.0)
    good = kernel_facts(excerpt(tanh=256), tile_n=128)
    assert good["division"] == {"div.rn.f32": 256}
    assert [d for d in compare_facts(good, expected_facts(cap)) if d["fact"] in ("tanh", "division")] == []
    recip = excerpt(tanh=256).replace("div.rn.f32 \t%r32, %r33, 0f41700000", "mul.f32 \t%r32, %r33, 0f3D888889")
    diffs = compare_facts(kernel_facts(recip, tile_n=128), expected_facts(cap))
    assert [d["fact"] for d in diffs] == ["division"], diffs


def test_fp8_expectations_and_saturating_conversion():
    ptx = excerpt(threshold=0.0, max_offset=8.0, cvt="cvt.rn.satfinite.e4m3x2.f32")
    assert compare_facts(kernel_facts(ptx, tile_n=128), expected_facts(E4M3)) == []
    ptx = excerpt(threshold=0.0, max_offset=8.0, cvt="cvt.rn.e4m3x2.f32")  # saturation lost
    assert {d["fact"] for d in compare_facts(kernel_facts(ptx, tile_n=128), expected_facts(E4M3))} == {"p_convert"}


@pytest.mark.parametrize(
    "ptx,message",
    [
        (".target sm_100a\nadd.f32 %r1, %r2, %r3;\n", "no .entry"),
        (".target sm_100a\n.entry k()\n{\nadd.f32 %r1, %r2, %r3;\n}\n", "no ex2"),
        (excerpt(cvt="mov.b32"), "P conversion was not found"),
        (
            excerpt(emu_per_step=24).replace("\tex2.approx.ftz.f32 \t%r1, %r2;\n", "", 40),
            "do not split into softmax steps",
        ),
    ],
)
def test_unrecognised_ptx_is_an_error_never_a_match(ptx, message):
    with pytest.raises(PtxFormatError, match=message):
        kernel_facts(ptx, tile_n=128)


@pytest.mark.parametrize("name,case", [("fwd_bf16_d128_s1024", BF16), ("fwd_e4m3_d128_s1024", E4M3)])
def test_production_ptx_matches_the_model(name, case, tmp_path):
    """Production's real sm_100a PTX (compiled on a CPU-only machine, 2026-11-29, flash-attn-4
    4.0.0b36): every fact agrees with FA4Numerics.sm100; a tampered copy diverges."""
    ptx = gzip.decompress((DATA / f"{name}.sm_100a.ptx.gz").read_bytes()).decode()
    rep = case.name
    (tmp_path / f"{rep}.ptx.gz").write_bytes(gzip.compress(ptx.encode()))
    (tmp_path / f"{rep}.ptx.json").write_text(
        json.dumps(
            {"kernel_class": "FlashAttentionForwardSm100", "attributes": {"n_block_size": 128, "use_2cta_instrs": True}}
        )
    )
    rec = audit_group(case, [case.name], ptx_dir=tmp_path, no_driver=True)
    assert rec["verdict"] == "match" and rec["compiled"] == "cached", rec.get("differences")
    assert rec["facts"]["exp2.hardware"] == {"ex2.approx.ftz.f32": 209} and rec["facts"]["exp2.emulated_pairs"] == 24
    c = next(c for c in POLY_EX2[3] if c != 1.0)
    tampered = ptx.replace(f32_hex(c), f32_hex(c * 1.001))  # one coefficient of the polynomial changes
    (tmp_path / f"{rep}.ptx.gz").write_bytes(gzip.compress(tampered.encode()))
    rec = audit_group(case, [case.name], ptx_dir=tmp_path, no_driver=True)
    assert rec["verdict"] == "diverged" and "exp2.poly_degree" in {d["fact"] for d in rec["differences"]}


def test_static_groups_cover_the_suite_once():
    from audits.suites.cases import smoke_suite

    cases = smoke_suite()
    groups = static_groups(cases)
    # the static audit compiles flash_attn_func, with the cases' mods; not the varlen entry
    fixed = [c for c in cases if not c.varlen]
    assert any(c.varlen for c in cases) and any(c.mods for c in cases)
    assert sorted(n for _, names in groups for n in names) == sorted(c.name for c in fixed)
    assert len(groups) < len(fixed)  # cases sharing a compile key and numerics share a group
    assert sum(bool(rep.mods) for rep, _ in groups) == len({c.compile_key for c in fixed if c.mods})


def test_static_bad_input_exits_2(tmp_path, capsys, monkeypatch):
    assert cli.main(["static", "--config", "{nope", "--out", str(tmp_path)]) == 2
    assert "expected a JSON object" in capsys.readouterr().err
    assert cli.main(["static", "--config", "[1]", "--out", str(tmp_path)]) == 2  # JSON, but not an object
    assert "--config #1: expected a JSON object of Case fields, got list" in capsys.readouterr().err
    assert cli.main(["static", "--config", '{"dtype": "float99"}', "--out", str(tmp_path)]) == 2
    assert "dtype = 'float99' is not accepted; accepted: bfloat16" in capsys.readouterr().err
    assert cli.main(["static", "--arch", "sm_90a", "--out", str(tmp_path)]) == 2
    if not torch.cuda.is_available():  # the default compiles on CUDA; without it: say how to opt in
        assert cli.main(["static", "--suite", "smoke", "--out", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert "--compile-on cpu" in err or "production package is not importable" in err
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)  # not importable
    assert cli.main(["static", "--suite", "smoke", "--out", str(tmp_path)]) == 2
    assert "production package is not importable" in capsys.readouterr().err


def _production_importable() -> bool:
    import importlib.util

    try:
        return (
            importlib.util.find_spec("flash_attn.cute") is not None and importlib.util.find_spec("cutlass") is not None
        )
    except (ImportError, ValueError):
        return False


@pytest.mark.skipif(
    not _production_importable(), reason="needs the gpu extra (flash-attn-4, nvidia-cutlass-dsl); no GPU needed"
)
def test_cpu_cross_compile_of_production_matches_the_model(tmp_path, capsys):
    """The opt-in CPU path end to end: production compiles its SM100 kernel here, without a GPU
    (about 8 s), and every fact matches FA4Numerics.sm100."""
    cfg = (
        '{"dtype": "float16", "d": 64, "dv": 64, "heads_q": 8, "heads_kv": 2, '
        '"seqlen_q": 512, "seqlen_k": 512, "causal": true}'
    )
    assert cli.main(["static", "--compile-on", "cpu", "--config", cfg, "--out", str(tmp_path), "--quiet"]) == 0
    rep = json.loads((tmp_path / "static.json").read_text())
    (g,) = rep["groups"]
    assert (
        g["verdict"] == "match"
        and g["kernel_class"] == "FlashAttentionForwardSm100"
        and g["facts"]["target"] == "sm_100a"
    )
    assert (tmp_path / "ptx" / f"{g['group']}.ptx.gz").exists()


def test_static_that_audited_nothing_exits_1(tmp_path, capsys, monkeypatch):
    """Every group refused by production: nothing was compared, so the audit does not pass."""
    from audits.checks.static import core
    from audits.cli import static as static_cli

    monkeypatch.setattr(static_cli, "_production_versions", lambda: {"flash-attn-4": "x", "nvidia-cutlass-dsl": "y"})
    refused = lambda c, cases, **kw: {"group": c.name, "cases": len(cases), "verdict": "skipped", "reason": "refused"}
    monkeypatch.setattr(core, "audit_group", refused)
    argv = ["static", "--compile-on", "cpu", "--config", '{"d": 192, "dv": 192}', "--out", str(tmp_path), "--quiet"]
    assert cli.main(argv) == 1
    cap = capsys.readouterr()
    assert "nothing was audited: production refused every compile group" in cap.err
    assert "0 match, 0 diverged, 1 skipped" in cap.out


def test_only_documented_refusals_skip_a_compile_group(tmp_path, capsys):
    """The compile child: a documented refusal exits REFUSED; anything else (a TypeError, an
    undocumented assertion) is a failed compile, exit 1."""
    from fa4 import sm100_compile

    refused = AssertionError("(head_dim, head_dim_v)=(192, 192) is not supported on SM100/SM110.")
    assert sm100_compile._no_ptx(refused, str(tmp_path / "d")) == sm100_compile.REFUSED
    for err in (TypeError("unexpected keyword"), AssertionError("tile_m must divide"), ValueError("bad"), None):
        assert sm100_compile._no_ptx(err, str(tmp_path / "d")) == 1
    assert "compile failed: TypeError: unexpected keyword" in capsys.readouterr().err


@pytest.mark.parametrize("how", ["failed", "timeout"])
def test_a_failed_or_hung_compile_is_exit_2_never_a_pass(how, tmp_path, capsys, monkeypatch):
    import subprocess

    from audits.checks.static import core
    from audits.cli import static as static_cli

    monkeypatch.setattr(static_cli, "_production_versions", lambda: {"flash-attn-4": "x", "nvidia-cutlass-dsl": "y"})

    def compile_child(cmd, **kw):
        if how == "timeout":
            raise subprocess.TimeoutExpired(cmd, core.COMPILE_TIMEOUT_S)
        return subprocess.CompletedProcess(cmd, 1, "", "compile failed: TypeError: unexpected keyword")

    monkeypatch.setattr(core.subprocess, "run", compile_child)
    argv = ["static", "--compile-on", "cpu", "--config", '{"d": 128}', "--out", str(tmp_path), "--quiet"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    want = "did not finish in 900 s" if how == "timeout" else "failed (exit 1):\ncompile failed: TypeError"
    assert want in err
    assert not (tmp_path / "static.json").exists()


def test_static_jobs_spread_cuda_compiles_over_the_gpus(tmp_path, monkeypatch):
    """static --jobs 2 --gpus 0,1 on CUDA: the compile children get one GPU each, round robin."""
    import subprocess

    from audits.checks.static import core
    from audits.cli import static as static_cli

    monkeypatch.setattr(static_cli, "_production_versions", lambda: {"flash-attn-4": "x", "nvidia-cutlass-dsl": "y"})
    monkeypatch.setattr(static_cli, "_check_environment", lambda args: {"flash-attn-4": "x", "nvidia-cutlass-dsl": "y"})
    seen = []

    def compile_child(cmd, **kw):
        seen.append((json.loads(cmd[3])["d"], (kw.get("env") or {}).get("CUDA_VISIBLE_DEVICES")))
        return subprocess.CompletedProcess(cmd, 3, "", "production refuses this configuration (test)")

    monkeypatch.setattr(core.subprocess, "run", compile_child)
    configs = [json.dumps({"d": d, "dv": d}) for d in (64, 96, 128)]
    argv = ["static", "--jobs", "2", "--gpus", "0,1", "--out", str(tmp_path), "--quiet"]
    cli.main([*argv, *(x for c in configs for x in ("--config", c))])
    assert sorted(seen) == [(64, "0"), (96, "1"), (128, "0")]
    assert cli.main(["static", "--jobs", "2", "--gpus", "0,x", "--config", configs[0], "--out", str(tmp_path)]) == 2
