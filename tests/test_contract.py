"""The verdict contract: nothing passes unchecked, resume never mixes runs, exit codes as
documented (0 pass, 1 check failed, 2 usage/environment), results on stdout."""

import json
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch

from audits import cli
from audits.engine.evaluate import evaluate_case
from audits.suites.cases import Case
from audits.verdict.gate import load_thresholds

ROOT = Path(__file__).parents[1]
NORMAL = "bf16-d64-b2h4k2-s200x300-causal-normal-seed0"
#: that case given as a config: sdpa-math's smoke is built within its declared domain (no case
#: of plain smoke's names), so its runs here take the case itself
NORMAL_CONFIG = json.dumps(Case("bfloat16", 64, 64, 2, 4, 2, 200, 300, causal=True, family="normal").as_dict())


@pytest.fixture(autouse=True)
def _cwd(monkeypatch):
    monkeypatch.chdir(ROOT)  # tests.* resolve as module:attr


def run(*argv):
    return cli.main(["run", "--quiet", *argv])


def report(out):
    return json.loads((Path(out) / "report.json").read_text())


# --- production refusals: explicit rules only -------------------------------------------------


@pytest.fixture
def fake_production(monkeypatch):
    """``flash_attn.cute.flash_attn_func`` replaced by a stub that raises what the test sets."""
    from fa4 import production, refusals

    box = {}

    def flash_attn_func(q, k, v, **kw):
        raise box["exc"]

    pkg = types.ModuleType("flash_attn")
    cute = types.ModuleType("flash_attn.cute")
    cute.flash_attn_func = flash_attn_func
    pkg.cute = cute
    monkeypatch.setitem(sys.modules, "flash_attn", pkg)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    monkeypatch.setattr(production, "require_production", lambda: None)
    # the refusal rules read the GPU and the release (fa4.refusals.call_features): the test's
    box.update(arch=10, version="4.0.0b40")
    monkeypatch.setattr(refusals, "device_arch", lambda device: box["arch"])
    monkeypatch.setattr(refusals, "production_version", lambda: box["version"])
    return box


FP8_SM100 = AssertionError("FP8 is only supported on SM100 (compute capability 10.x) for FA4 CuTe.")
HD192 = AssertionError("(head_dim, head_dim_v)=(192, 192) is not supported on SM100/SM110. ...")


@pytest.mark.parametrize(
    "exc,case,arch,verdict,reason",
    [
        (FP8_SM100, dict(dtype="float8_e4m3fn"), 9, "skipped",
         r"production refuses this configuration \(rule fp8-needs-sm100, predicted from the call's features; its "
         r"message confirms; flash_attn/cute/interface.py, _flash_attn_fwd"),
        (HD192, dict(d=192, dv=192), 10, "skipped", r"rule head-dims, .*_validate_head_dims"),
        # production's words on a call no rule predicts refused: an error, whatever the wording
        (FP8_SM100, dict(d=64, dv=64), 9, "error", r"flash_attn_func raised AssertionError: FP8 is only"),
        (HD192, dict(d=192, dv=192), 9, "error", r"flash_attn_func raised AssertionError: \(head_dim"),
        (AssertionError("some internal invariant"), {}, 10, "error", r"flash_attn_func raised AssertionError"),
        (TypeError("unexpected keyword"), {}, 10, "error", r"flash_attn_func raised TypeError"),
        (NotImplementedError("not yet"), {}, 10, "error", r"flash_attn_func raised NotImplementedError: not yet"),
    ],
)  # fmt: skip
def test_only_documented_production_refusals_are_skipped(fake_production, exc, case, arch, verdict, reason):
    from fa4.production import flash_attn

    fake_production.update(exc=exc, arch=arch)
    rec = evaluate_case("fa4", flash_attn, Case(**case), torch.device("cpu"), load_thresholds())
    assert rec["verdict"] == verdict
    assert __import__("re").search(reason, rec["reasons"][0]), rec["reasons"]


def test_static_compile_refusal_and_timeout(monkeypatch, tmp_path):
    import subprocess

    from audits.checks.static import core
    from fa4.refusals import refusal_of

    assert refusal_of(AssertionError("(head_dim, head_dim_v)=(192, 192) is not supported on SM100/SM110."))
    assert refusal_of(ValueError("(head_dim, head_dim_v)=(192, 192) is not supported on SM100/SM110.")) is None
    assert refusal_of(TypeError("FP8 is only supported on SM100")) is None

    def hang(*a, **kw):
        raise subprocess.TimeoutExpired(a[0], core.COMPILE_TIMEOUT_S)

    monkeypatch.setattr(core.subprocess, "run", hang)
    with pytest.raises(core.StaticError, match="did not finish in 900 s"):
        core._compile(Case(), tmp_path / "x.ptx", no_driver=True)


@pytest.mark.parametrize(
    ("production", "exc", "status"),
    [
        (True, AssertionError("SM100 backward with head_dim=256 does not support softcap"), "skipped"),
        (True, NotImplementedError("something production never documented"), "error"),
        (True, AssertionError("tile_m must divide"), "error"),
        (False, NotImplementedError("my kernel has no backward for this"), "skipped"),
        (False, AssertionError("SM100 backward with head_dim=256 does not support softcap"), "error"),
    ],
)
def test_backward_refusals_follow_the_same_rules(production, exc, status):
    """An exception in the backward (raised inside torch.autograd.grad) is a skip only when it is
    a documented production refusal, or a user kernel's NotImplementedError."""
    from audits.engine.backward import BackwardOptions, grad_call
    from audits.kernels import get_kernel
    from fa4.refusals import REFUSALS

    assert get_kernel("fa4").fa4_audit_refusals is REFUSALS  # production's adapter is marked

    class Raises(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q):
            return q.clone()

        @staticmethod
        def backward(ctx, g):
            raise exc

    def kernel(q, k, v, **kw):
        return Raises.apply(q)

    if production:
        kernel.fa4_audit_refusals = REFUSALS
    q = torch.ones(1, 2, 1, 4)
    res, _ = grad_call(kernel, {"q": q, "k": q, "v": q, "kw": {}}, torch.ones_like(q), BackwardOptions(repeat=1))
    assert res["status"] == status, res
    assert type(exc).__name__ in res["reason"] or status == "skipped"
    assert str(exc) in res["reason"]


# --- nothing passes unchecked --------------------------------------------------------------------


@pytest.mark.slow  # 10 s CPU
def test_a_kernel_without_lse_warns_per_case_and_can_be_failed(tmp_path, capsys):
    assert run("--kernel", "tests.fake_kernels:no_lse", "--case", NORMAL, "--out", str(tmp_path / "w")) == 0
    rep = report(tmp_path / "w")
    (c,) = rep["cases"]
    assert c["verdict"] == "warn" and c["reasons"] == ["LSE not returned: not audited"]
    assert rep["summary"]["lse_not_audited"] == 1
    assert "LSE not audited in 1" in capsys.readouterr().out
    strict = tmp_path / "strict.toml"
    shipped = Path(load_thresholds()["path"]).read_text()
    strict.write_text(shipped.replace('lse_missing = "warn"', 'lse_missing = "fail"'))
    argv = ("--kernel", "tests.fake_kernels:no_lse", "--case", NORMAL, "--thresholds", str(strict))
    assert run(*argv, "--out", str(tmp_path / "f")) == 1
    assert report(tmp_path / "f")["cases"][0]["verdict"] == "fail"


def test_a_run_that_evaluated_nothing_fails(tmp_path, capsys):
    assert run("--kernel", "tests.fake_kernels:refuses_everything", "--out", str(tmp_path)) == 1
    cap = capsys.readouterr()
    assert "nothing was audited" in cap.err
    rep = report(tmp_path)
    assert rep["summary"]["evaluated"] == 0 and rep["summary"]["verdicts"]["skipped"] == rep["summary"]["cases"]
    # the summary line, after the title, the command and the audited versions
    assert any(line.startswith("0 of ") for line in (tmp_path / "report.md").read_text().splitlines()[:8])


# --- resume and fresh runs never mix -----------------------------------------------------------


def test_resume_refuses_another_runs_journal(tmp_path, capsys):
    a = tmp_path / "a"
    assert run("--kernel", "fa4-model", "--case", NORMAL, "--out", str(a)) == 0
    b = tmp_path / "b"
    shutil.copytree(a, b)
    assert run("--kernel", "sdpa-math", "--config", NORMAL_CONFIG, "--out", str(b), "--resume") == 2
    err = capsys.readouterr().err
    assert "--resume refused" in err and "kernel: journal 'fa4-model', this run 'sdpa-math'" in err
    assert run("--kernel", "fa4-model", "--case", NORMAL[:-1] + "*", "--seed", "3", "--out", str(b), "--resume") == 2
    assert "seed: journal 0, this run 3" in capsys.readouterr().err
    assert run("--kernel", "fa4-model", "--case", NORMAL, "--out", str(b), "--resume") == 0
    assert report(b)["cases"][0].get("resumed") is True


@pytest.mark.slow  # job processes: 20 s CPU
def test_resume_with_jobs_refuses_another_runs_journals(tmp_path, capsys):
    """The jobs refuse the other run's journals; the parent must not report their records."""
    two = "*tile_step_[14]-seed0"
    assert run("--kernel", "fa4-model", "--case", two, "--jobs", "2", "--out", str(tmp_path)) == 0
    before = report(tmp_path)
    assert run("--kernel", "sdpa-math", "--case", two, "--jobs", "2", "--resume", "--out", str(tmp_path)) == 2
    err = capsys.readouterr().err
    assert "refused to run" in err and "kernel: journal 'fa4-model', this run 'sdpa-math'" in err
    assert report(tmp_path) == before  # nothing of fa4-model's was reported as sdpa-math's


def test_a_fresh_run_into_a_used_directory_needs_overwrite(tmp_path, capsys):
    assert run("--kernel", "fa4-model", "--case", NORMAL, "--out", str(tmp_path)) == 0
    (tmp_path / "mine.txt").write_text("kept")
    assert run("--kernel", "sdpa-math", "--config", NORMAL_CONFIG, "--out", str(tmp_path)) == 2
    assert "holds another run" in capsys.readouterr().err and report(tmp_path)["kernel"] == "fa4-model"
    assert run("--kernel", "sdpa-math", "--config", NORMAL_CONFIG, "--out", str(tmp_path), "--overwrite") == 0
    assert report(tmp_path)["kernel"] == "sdpa-math" and (tmp_path / "mine.txt").read_text() == "kept"


# --- gate, diff, summary -----------------------------------------------------------------------


def test_gate_baseline_overlap_and_seed_matching(tmp_path, capsys):
    assert run("--kernel", "fa4-model", "--case", NORMAL, "--out", str(tmp_path / "a")) == 0
    assert run("--kernel", "fa4-model", "--case", NORMAL[:-1] + "1", "--seed", "1", "--out", str(tmp_path / "b")) == 0
    a, b = str(tmp_path / "a" / "report.json"), str(tmp_path / "b" / "report.json")
    capsys.readouterr()
    assert cli.main(["gate", a, "--baseline", b]) == 2  # another seed, another case: nothing to judge
    cap = capsys.readouterr()
    assert "0 of 1 baseline cases and 0 of 1 candidate cases matched by configuration (case identity)" in cap.err
    assert "no case matched, too few to judge" in cap.err and "1 more would match" in cap.err
    assert cli.main(["gate", a, "--baseline", b, "--ignore-seed"]) == 0
    assert "1 of 1 baseline cases and 1 of 1 candidate cases matched by configuration, seeds ignored" in (
        capsys.readouterr().out
    )
    assert cli.main(["diff", a, b, "--ignore-seed"]) == 0
    assert "1 of 1 candidate cases matched" in capsys.readouterr().out


def test_summary_keeps_one_column_per_report(tmp_path, capsys):
    for d in ("x", "y"):
        assert run("--kernel", "fa4-model", "--case", NORMAL, "--out", str(tmp_path / d)) == 0
    capsys.readouterr()
    paths = [str(tmp_path / d / "report.json") for d in ("x", "y")]
    assert cli.main(["summary", *paths]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|") and "fa4-model" in line]
    assert len(rows) == 2 and f"fa4-model ({paths[0]})" in rows[0] and "| 1 |" in rows[0]


# --- exit codes per subcommand -----------------------------------------------------------------


def test_the_production_kernel_without_its_package_is_exit_2(capsys, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine may have the production package")
    assert run("--kernel", "fa4", "--out", str(tmp_path)) == 2
    err = capsys.readouterr().err
    assert "production kernel, which cannot run here" in err and "pip install 'fa4-audit[gpu]'" in err
    assert not (tmp_path / "report.json").exists()
    fuzz = ["fuzz", "--kernel", "fa4", "--budget", "3", "--seed", "1", "--out", str(tmp_path / "fz")]
    assert cli.main(fuzz) == 2
    err = capsys.readouterr().err
    assert "production kernel, which cannot run here" in err and "pip install 'fa4-audit[gpu]'" in err


@pytest.mark.parametrize(
    "content,message",
    [
        ("{not json", "not a readable JSON report"),
        ('{"schema": "fa4-audit/report/0"}', "'fa4-audit/report/0' is not one of fa4-audit/report/2"),
        ('{"schema": "fa4-audit/report/1", "kernel": "k"}', "report.suite: missing (expected str)"),
        ("[1, 2]", "not a report"),
    ],
)
@pytest.mark.parametrize("command", ["gate", "show", "merge", "summary", "diff"])
def test_malformed_reports_are_usage_errors(tmp_path, capsys, content, message, command):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    argv = {"merge": [str(bad), "--out", str(tmp_path / "m")], "diff": [str(bad), str(bad)]}.get(command, [str(bad)])
    assert cli.main([command, *argv]) == 2
    assert message in capsys.readouterr().err


def _drop(d, *path):
    for k in path[:-1]:
        d = d[k]
    del d[path[-1]]


@pytest.mark.parametrize(
    "spoil,message",
    [
        (lambda r: r.__setitem__("summary", {}), "report.summary.cases: missing (expected int)"),
        (lambda r: _drop(r, "summary", "verdicts", "crash"), "report.summary.verdicts.crash: missing"),
        (lambda r: r["cases"][0].__setitem__("config", {}), "cases[0].config lacks dtype, d, dv"),
        (lambda r: r["cases"][0]["config"].__setitem__("d", "64"), "cases[0].config"),
        (lambda r: _drop(r, "cases", 0, "out"), "cases[0].out: missing (expected an object)"),
        (lambda r: r["cases"][0]["out"].__setitem__("max_abs", None), "cases[0].out.max_abs: expected int or float"),
        (lambda r: _drop(r, "cases", 0, "lse", "mismatched_nonfinite"), "cases[0].lse.mismatched_nonfinite: missing"),
        (lambda r: r["cases"][0]["bound"].__setitem__("violations", True), "cases[0].bound.violations: expected int"),
        (lambda r: r["cases"][0]["reasons"].append(3), "cases[0].reasons[0]: expected str, got int"),
    ],
)
@pytest.mark.parametrize("command", ["gate", "show", "merge", "summary", "diff"])
def test_a_report_is_checked_below_its_top_level(tmp_path, capsys, spoil, message, command, _one_report):
    """Each command reads nested fields; a report lacking one is named and exit 2, never a KeyError."""
    rep = json.loads(_one_report.read_text())
    spoil(rep)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(rep))
    argv = {"merge": [str(bad), "--out", str(tmp_path / "m")], "diff": [str(bad), str(bad)]}.get(command, [str(bad)])
    assert cli.main([command, *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.fixture(scope="module")
def _one_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    assert cli.main(["run", "--quiet", "--kernel", "fa4-model", "--case", NORMAL, "--out", str(out)]) == 0
    return out / "report.json"


def test_a_case_with_a_bad_verdict_is_named(tmp_path, capsys):
    assert run("--kernel", "fa4-model", "--case", NORMAL, "--out", str(tmp_path)) == 0
    rep = report(tmp_path)
    rep["cases"][0]["verdict"] = "passed"
    (tmp_path / "r.json").write_text(json.dumps(rep))
    assert cli.main(["gate", str(tmp_path / "r.json")]) == 2
    assert f"case {NORMAL} has verdict 'passed'; known: pass, warn" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--config", '{"d": 64, "colour": 1}'], "--config #1: unknown key(s) colour; accepted: dtype, d"),
        (["--config", '{"window": [3]}'], "window [3] must be [left, right]"),
        (["--config", '{"dtype": "float32"}'], "dtype = 'float32' is not accepted; accepted: bfloat16"),
        (["--config", "{d: 64}"], "--config #1 '{d: 64}': not JSON"),
        (["--config", "{}", "--suite", "smoke"], "--suite cannot be combined with --config"),
        (["--case-file", "/nonexistent/cases.json"], "case file /nonexistent/cases.json: cannot be read"),
        (["--resume", "--overwrite"], "pass one of them"),
    ],
)
def test_given_cases_are_validated(tmp_path, capsys, argv, message):
    assert run("--kernel", "fa4-model", *argv, "--out", str(tmp_path)) == 2
    assert message in capsys.readouterr().err


def test_config_and_case_file_run_exactly_the_given_cases(tmp_path):
    cfg = {"dtype": "float16", "d": 64, "dv": 64, "seqlen_q": 40, "seqlen_k": 70, "window": [8, 0], "family": "uniform"}
    assert run("--kernel", "fa4-model", "--config", json.dumps(cfg), "--out", str(tmp_path / "c")) == 0
    rep = report(tmp_path / "c")
    want = json.loads(json.dumps({**Case().as_dict(), **cfg}))  # as JSON holds it: lists for tuples
    assert rep["suite"] == "config" and [c["config"] for c in rep["cases"]] == [want]
    again = tmp_path / "again"
    assert run("--kernel", "fa4-model", "--case-file", str(tmp_path / "c" / "report.json"), "--out", str(again)) == 0
    assert report(again)["cases"][0]["case"] == rep["cases"][0]["case"]


@pytest.mark.slow  # job processes: 25 s CPU
def test_config_and_case_file_run_with_jobs_and_resume(tmp_path):
    """Given cases (two --config, one --case-file) split over --jobs 2; --resume redoes none."""
    cfgs = [{"dtype": "float16", "seqlen_q": 40, "seqlen_k": 70, "family": f} for f in ("uniform", "flat")]
    (tmp_path / "cases.json").write_text(json.dumps([{"d": 64, "dv": 64, "seqlen_q": 33, "family": "peaked"}]))
    argv = ["--kernel", "fa4-model", "--case-file", str(tmp_path / "cases.json"), "--out", str(tmp_path / "o")]
    for c in cfgs:
        argv += ["--config", json.dumps(c)]
    assert run(*argv, "--jobs", "2") == 0
    rep = report(tmp_path / "o")
    assert rep["suite"] == "config+cases.json" and len(rep["cases"]) == 3
    journals = sorted((tmp_path / "o" / "jobs").glob("*/journal.jsonl"))
    before = [j.read_text() for j in journals]
    assert len(journals) == 2 and sum(t.count("\n") - 1 for t in before) == 3  # each case once, over 2 jobs
    assert run(*argv, "--jobs", "2", "--resume") == 0
    assert [j.read_text() for j in journals] == before  # nothing redone
    assert [c["case"] for c in report(tmp_path / "o")["cases"]] == [c["case"] for c in rep["cases"]]


# --- terminal output ---------------------------------------------------------------------------


@pytest.mark.parametrize("terminal", [False, True])
def test_show_never_cuts_a_case_name_at_80_columns(tmp_path, capsys, monkeypatch, terminal):
    import rich.console

    assert run("--kernel", "fa4-model", "--case", "*tile_step_1-*", "--out", str(tmp_path)) == 0
    names = [c["case"] for c in report(tmp_path)["cases"]]
    capsys.readouterr()
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.setattr(rich.console.Console, "is_terminal", property(lambda self: terminal))
    assert cli.main(["show", str(tmp_path / "report.json")]) == 0
    out = capsys.readouterr().out
    assert all(any(n in line for line in out.splitlines()) for n in names), out
    assert ("┃" in out) == terminal  # a table on a terminal, plain lines otherwise


def test_run_results_go_to_stdout_and_progress_to_stderr(tmp_path, capsys):
    assert (
        cli.main(["run", "--kernel", "tests.bugged_kernels:wrong_lse", "--case", "*uniform*", "--out", str(tmp_path)])
        == 1
    )
    cap = capsys.readouterr()
    assert "1 of 1 cases evaluated (fail 1)" in cap.out and "reproduce: fa4-audit run" in cap.out
    assert "evaluated" not in cap.err and "reproduce" not in cap.err


def test_progress_goes_to_stderr_on_a_terminal(tmp_path, capsys, monkeypatch):
    """With a terminal the progress bar is drawn, on stderr; stdout keeps only the results."""
    import rich.console

    monkeypatch.setattr(rich.console.Console, "is_terminal", property(lambda self: True))
    assert cli.main(["run", "--kernel", "fa4-model", "--case", NORMAL, "--out", str(tmp_path)]) == 0
    cap = capsys.readouterr()
    assert "1/1" in cap.err and "1/1" not in cap.out and "1 of 1 cases evaluated" in cap.out


@pytest.mark.parametrize(
    "argv,cell",
    [
        (["bounds"], "float8_e4m3fn"),
        (["bounds"], "mass lost to flush <="),
        pytest.param(["ex2", "--sample", "4096", "--degree", "all", "--quiet"], "-8.49724", marks=pytest.mark.slow),
    ],
)
def test_tables_shorten_no_cell_when_piped(argv, cell, tmp_path, monkeypatch):
    """Not a terminal (a pipe, CI): plain aligned text with every cell whole, at 80 columns too."""
    import subprocess

    if argv[0] == "ex2":
        argv = [*argv, "--out", str(tmp_path)]
    env = {**__import__("os").environ, "COLUMNS": "80"}
    out = subprocess.run([sys.executable, "-m", "audits", *argv], capture_output=True, text=True, env=env).stdout
    assert cell in out and "…" not in out


def test_a_closed_pipe_is_no_traceback(tmp_path):
    """``fa4-audit show R | head -1``: the reader leaves early; no BrokenPipeError traceback."""
    import subprocess

    rep = ROOT / "reports" / "h200" / "release" / "fa4" / "report.json.xz"
    cmd = f"{sys.executable} -m audits show {rep} | head -1"
    p = subprocess.run(
        cmd,
        shell=True,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT)},
    )
    assert p.stdout.startswith("fa4 / release") and "Traceback" not in p.stderr and "BrokenPipe" not in p.stderr


def test_gpu_list_and_pinning(monkeypatch):
    """--gpus, or the GPUs this process sees (its own CUDA_VISIBLE_DEVICES entries), round robin."""
    from audits.common import UsageError, gpu_list, pinned_env

    assert gpu_list("0,1") == ["0", "1"]
    for bad in ("0,0", "a", "", "1,,2"):
        with pytest.raises(UsageError, match="expected distinct GPU indices"):
            gpu_list(bad)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert gpu_list(None) == ["2", "3"]  # children address the physical GPUs the parent was given
    env = {"X": "1"}
    assert [pinned_env(env, ["2", "3"], j)["CUDA_VISIBLE_DEVICES"] for j in range(3)] == ["2", "3", "2"]
    assert pinned_env(env, [], 5) == env


@pytest.mark.slow  # job processes: 15 s CPU
def test_run_jobs_pin_each_job_to_a_gpu(tmp_path, capsys):
    """run --jobs 2 --gpus 0,1: job I runs with CUDA_VISIBLE_DEVICES = gpus[I mod 2] (shown here
    through a kernel that names its pin); --gpus without --jobs, or malformed, is exit 2."""
    argv = ["--kernel", "tests.fake_kernels:says_its_gpu", "--case", "*normal*", "--out", str(tmp_path / "o")]
    run(*argv, "--jobs", "2", "--gpus", "0,1", "--isolate")
    reasons = {r for c in report(tmp_path / "o")["cases"] for r in c["reasons"]}
    pins = {x.rsplit(": ", 1)[-1] for x in reasons}
    assert pins == {"pinned to CUDA_VISIBLE_DEVICES=0", "pinned to CUDA_VISIBLE_DEVICES=1"}
    assert run(*argv, "--gpus", "0,1", "--overwrite") == 2
    assert "it pins the processes of --jobs N" in capsys.readouterr().err
    assert run(*argv, "--jobs", "2", "--gpus", "0,zero", "--overwrite") == 2
    assert "expected distinct GPU indices" in capsys.readouterr().err
