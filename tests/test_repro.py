"""Every reproducer the tool prints is executed here, from another working directory: the run's
terminal summary, the report (JSON, Markdown, HTML), the fuzzer and the pytest fixture."""

import html
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from audits import cli

ROOT = Path(__file__).parents[1]
BAD = "tests.bugged_kernels:wrong_lse"  # its LSE is in log2 units: every case fails on the LSE
CASE = "f16-d128-b1h4k1-s160x160-uniform-seed0"


def execute(cmd: str, cwd: Path) -> subprocess.CompletedProcess:
    """Run a printed command in a shell, as a user pastes it, with this venv's fa4-audit."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("PYTHONPATH", None)
    return subprocess.run(cmd, shell=True, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def assert_reproduces(cmd: str, tmp_path: Path, case: str = CASE, why: str = "LSE max |err|") -> None:
    """The command exits 1 from an unrelated directory, re-running exactly ``case``, which fails
    for the same reason; and it can be run again (its output directory is reused)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    for _ in range(2):
        p = execute(cmd, elsewhere)
        assert p.returncode == 1, p.stdout + p.stderr
        rep = json.loads((elsewhere / "fa4-audit-repro" / "report.json").read_text())
        assert [c["case"] for c in rep["cases"]] == [case]
        assert rep["cases"][0]["verdict"] == "fail" and why in " ".join(rep["cases"][0]["reasons"])


@pytest.fixture(scope="module")
def failing_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        import contextlib
        import io

        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = cli.main(["run", "--quiet", "--kernel", BAD, "--case", "*uniform*", "--out", str(out)])
    finally:
        os.chdir(cwd)
    assert rc == 1
    return out, buf.getvalue()


def test_the_terminal_ends_with_the_failing_cases_and_their_reproducers(failing_run, tmp_path):
    out, stdout = failing_run
    assert f"FAIL {CASE}" in stdout and "why: " in stdout
    (cmd,) = re.findall(r"reproduce: (.*)", stdout)
    assert_reproduces(cmd, tmp_path)


def test_the_reports_carry_the_same_reproducer(failing_run):
    out, stdout = failing_run
    (cmd,) = re.findall(r"reproduce: (.*)", stdout)
    rep = json.loads((out / "report.json").read_text())
    assert rep["cases"][0]["repro"] == cmd
    assert f"`{cmd}`" in (out / "report.md").read_text()
    assert html.escape(cmd) in (out / "report.html").read_text()


@pytest.mark.slow  # a run and its reproducer in a subprocess: 37 s CPU
def test_a_file_path_kernel_reproduces_from_anywhere(tmp_path):
    spec = f"{ROOT / 'tests' / 'bugged_kernels.py'}:wrong_lse"
    cfg = json.dumps(
        {"dtype": "float16", "heads_q": 4, "heads_kv": 1, "seqlen_q": 160, "seqlen_k": 160, "family": "uniform"}
    )
    p = execute(f"fa4-audit run --quiet --kernel {spec} --config '{cfg}' --out here", tmp_path)
    assert p.returncode == 1 and f"FAIL {CASE}" in p.stdout
    (cmd,) = re.findall(r"reproduce: (.*)", p.stdout)
    assert_reproduces(cmd, tmp_path)


def _fuzz_failure(tmp_path, *argv) -> dict:
    """``fa4-audit fuzz`` from the repository root (seed 1): it must fail; its shrunk failure."""
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        rc = cli.main(["fuzz", *argv, "--database", str(tmp_path / "db"), "--seed", "1", "--out", str(tmp_path / "f")])
    finally:
        os.chdir(cwd)
    assert rc == 1
    return json.loads((tmp_path / "f" / "fuzz.json").read_text())["failure"]


@pytest.mark.slow  # a fuzz run and its reproducer in a subprocess: 15 s CPU
def test_the_fuzz_reproducer_runs(tmp_path):
    f = _fuzz_failure(tmp_path, "--kernel", "tests.bugged_kernels:bug_lse_log2", "--budget", "10", "--max-seqlen", "64")
    assert_reproduces(f["repro"], tmp_path, case=f["name"], why="LSE")


@pytest.mark.slow  # pytest and the reproducer in subprocesses: 22 s CPU
def test_the_fixture_failure_message_has_a_reproducer_that_runs(pytester, monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(ROOT))
    pytester.makepyfile(f'def test_bad(fa4_audit):\n    fa4_audit("{BAD}", case="*uniform*")\n')
    result = pytester.runpytest()
    result.assert_outcomes(failed=1)
    # The command appears in the failure and, where the terminal is wide enough
    # (CI's is), again in pytest's short summary: one distinct command.
    (cmd,) = set(re.findall(r"reproduce: (.*)", str(result.stdout)))
    assert_reproduces(cmd.strip(), tmp_path)


pytest_plugins = ["pytester"]


@pytest.mark.slow  # a fuzz run and its reproducer in a subprocess: 45 s CPU
def test_the_backward_fuzz_reproducer_runs(tmp_path):
    """``fuzz --backward`` on a kernel whose dQ is doubled: the shrunk case fails on dQ and its
    reproducer (with ``--backward``) fails the same way from another directory."""
    argv = ["--kernel", "tests.fake_kernels:dq_doubled", "--budget", "5", "--max-seqlen", "64", "--backward"]
    f = _fuzz_failure(tmp_path, *argv)
    assert "--backward" in f["repro"] and any("dq" in r for r in f["reasons"])
    assert_reproduces(f["repro"], tmp_path, case=f["name"], why="dq")
