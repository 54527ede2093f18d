"""The fa4-audit command line: exit codes, messages, reports."""

import json
import subprocess
import sys

import pytest
import torch

from audits import cli
from audits.suites.cases import suite


def run(*argv):
    return cli.main(list(argv))


def test_ex2_sample_writes_reports(tmp_path, capsys):
    rc = run("ex2", "--degree", "3", "--sample", "3000", "--out", str(tmp_path), "--quiet")
    assert rc == 0
    rep = json.loads((tmp_path / "ex2.json").read_text())
    assert rep["schema"] == "fa4-audit/ex2/1"
    (d,) = rep["degrees"]
    assert d["degree"] == 3 and d["sweep"]["classes"]["normal"]["max_rel_error"] <= d["bound"]
    assert {r["input"] for r in d["sweep"]["special"]} >= {"+inf", "-126.5"}
    md = (tmp_path / "ex2.md").read_text()
    assert "proven bound" in md and "ex2.svg" in md
    assert (tmp_path / "ex2.svg").read_text().startswith("<?xml")
    cap = capsys.readouterr()
    assert "8.77" in cap.out and "8.77" not in cap.err  # the printed table: results on stdout


def test_bound_violation_exits_1(tmp_path, monkeypatch, capsys):
    import numerics.bounds as b

    real = b.ex2_bound_details

    def tiny(degree, **kw):
        return {**real(degree, **kw), "bound": 1e-9}

    monkeypatch.setattr(b, "ex2_bound_details", tiny)
    assert run("ex2", "--sample", "500", "--out", str(tmp_path), "--quiet") == 1
    assert "FAIL degree 3" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv,message",
    [
        (["ex2", "--degree", "7"], "--degree '7' is not valid; accepted: 1, 2, 3, 4, 5 or 'all'"),
        (["ex2", "--degree", "three"], "accepted: 1, 2, 3, 4, 5"),
        (["ex2", "--device", "tpu"], "invalid choice: 'tpu'"),
        (["ex2", "--sample", "0"], "--sample must be a positive number"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)
def test_usage_errors_exit_2(argv, message, capsys, tmp_path):
    assert run(*argv, "--out", str(tmp_path)) == 2 if argv[0] == "ex2" else run(*argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_without_gpu_exits_2(capsys, tmp_path):
    assert run("ex2", "--device", "cuda", "--out", str(tmp_path)) == 2
    err = capsys.readouterr().err
    assert "--device cuda was requested but torch sees no CUDA device" in err and "--device cpu" in err


def test_ptx_without_production_package_exits_2(capsys, tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in ("cutlass", "flash_attn") else real(name, *a)
    )
    assert run("ex2", "--ptx", "--sample", "100", "--out", str(tmp_path), "--quiet") == 2
    err = capsys.readouterr().err
    assert "--ptx needs the production package" in err and "pip install 'fa4-audit[gpu]'" in err


def test_python_dash_m_audits_is_the_same_cli(tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "audits", "ex2", "--degree", "9", "--out", str(tmp_path)], capture_output=True, text=True
    )
    assert p.returncode == 2 and "accepted: 1, 2, 3, 4, 5" in p.stderr


def test_fidelity_with_a_stand_in_kernel(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(__import__("pathlib").Path(__file__).parents[1])
    rc = run(
        "fidelity",
        "--device",
        "cpu",
        "--production",
        "fa4-model-sm90",
        "--case",
        "d64_sq*",
        "--out",
        str(tmp_path),
        "--quiet",
    )
    assert rc == 0
    rep = json.loads((tmp_path / "fidelity.json").read_text())
    assert rep["summary"]["fraction_identical"] == 1.0 and rep["summary"]["cases_ok"] == 1
    rc = run(
        "fidelity",
        "--device",
        "cpu",
        "--production",
        "tests.fake_kernels:sm90_model_poly_exp2",
        "--case",
        "d64_sq*",
        "--out",
        str(tmp_path),
        "--quiet",
    )
    assert rc == 1  # a kernel whose exp2 differs fails the fidelity threshold
    assert "0/1 cases ok" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["fidelity", "--device", "cpu", "--production", "nocolon"],
            "unknown kernel 'nocolon'; accepted: fa4, fa4-model",
        ),
        (["fidelity", "--device", "cpu", "--production", "no.such.module:f"], "cannot load kernel 'no.such.module:f'"),
        (
            ["fidelity", "--device", "cpu", "--production", "fa4-model-sm90", "--case", "zzz"],
            "--case 'zzz' matches no case of 'fidelity'",
        ),
    ],
)
def test_fidelity_usage_errors(argv, message, capsys):
    assert run(*argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-production message")
def test_fidelity_without_production_exits_2(capsys, monkeypatch):
    from audits.cli import fidelity as fidelity_cli

    monkeypatch.setattr(fidelity_cli, "_device", torch.device)  # as if CUDA were here: production is not
    assert run("fidelity", "--device", "cuda") == 2
    assert "fidelity compares with the production kernel, which is unavailable" in capsys.readouterr().err


def test_list_names_kernels_suites_and_families(capsys):
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    release = suite("release")
    line = f"release  {len(release):5d} cases, {len({c.compile_key for c in release}):3d} compile keys"
    assert "fa4-model-sm90" in out and line in out and "nan_inf_masked" in out


def test_fidelity_mufu_on_cpu_is_refused_before_any_case_runs(capsys, monkeypatch):
    from audits.checks.fidelity import core

    monkeypatch.setattr(core, "run_case", lambda *a, **kw: pytest.fail("a case ran before the usage check"))
    assert run("fidelity", "--device", "cpu", "--production", "fa4-model-sm90", "--mufu", "--quiet") == 2
    assert "--mufu measures the GPU's MUFU.EX2: it needs --device cuda" in capsys.readouterr().err


def test_fidelity_markdown_regenerates_the_committed_reports():
    """The Markdown writer reproduces the committed H200 fidelity reports from their JSON."""
    import lzma
    from pathlib import Path

    from audits.checks.fidelity.core import markdown

    root = Path(__file__).parents[1] / "reports" / "fidelity"
    old = json.loads((root / "fidelity.json").read_text())
    new = json.loads(lzma.decompress((root / "2026-12-01" / "fidelity.json.xz").read_bytes()))
    assert markdown(old) == (root / "fidelity.md").read_text()
    assert markdown(new) == (root / "2026-12-01" / "fidelity.md").read_text()
