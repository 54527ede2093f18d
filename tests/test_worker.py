"""The kernel harness (audits/engine/worker.py): time limits, worker deaths, exceptions that do not
pickle, memory exhaustion; and verdicts decided by record fields, never message text (old reports
upgraded where they are read)."""

import copy
import json
import shlex
import signal
import time
from pathlib import Path

import pytest
import torch

from audits import cli
from audits.engine import worker
from audits.engine.failures import RemoteError, failure_reason
from audits.engine.worker import Isolated, KernelTimeout, WorkerCrashed, death_reason
from audits.report.schema import FAILING, VERDICTS, upgrade_case
from audits.verdict.gate import judge, load_thresholds, rejudge

ROOT = Path(__file__).parents[1]
HANG = "tests.hanging_kernels"
CASE = {"dtype": "bfloat16", "d": 64, "dv": 64, "batch": 1, "heads_q": 2, "heads_kv": 2, "seqlen_q": 16, "seqlen_k": 16}


def config(**kw) -> str:
    return json.dumps({**CASE, **kw})


@pytest.fixture(autouse=True)
def _cwd(monkeypatch):
    monkeypatch.chdir(ROOT)  # tests.hanging_kernels resolves as module:attr, here and in the workers


@pytest.fixture
def deadline():
    """``deadline(s)``: fail the test (instead of hanging the suite) if it is still running after s
    seconds: what a harness without a time limit would do on these kernels."""

    def expire(signum, frame):
        raise AssertionError("the audit did not finish in bounded time")

    old = signal.signal(signal.SIGALRM, expire)
    yield lambda s: signal.alarm(s)
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def qkv(sq=8):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, n, 2, 64, generator=g) for n in (sq, 8, 8)]


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not reaped by a container's init, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


# ---- the worker itself ----------------------------------------------------------------------


def test_an_exception_that_does_not_pickle_comes_back_and_the_worker_keeps_running():
    """A compiled-kernel-style exception holding a module (torch inductor's InductorError): its
    type name, message and the worker's traceback reach the parent; the same worker (same pid)
    takes the next call."""
    iso = Isolated(f"{HANG}:raises_on_seqlen_7", "cpu", timeout=60)
    try:
        out, lse = iso(*qkv())
        pid = iso.pid
        assert out.shape == (1, 8, 2, 64) and pid is not None
        with pytest.raises(RemoteError) as err:
            iso(*qkv(sq=7))
        e = err.value
        assert e.type_name == "CompiledKernelError" and str(e) == "unpicklable on seqlen 7"
        assert e.qualified_type == "tests.hanging_kernels.CompiledKernelError"
        assert "raises_on_seqlen_7" in e.worker_traceback and "CompiledKernelError: unpicklable" in e.worker_traceback
        assert failure_reason(e) == ("exception", "kernel raised CompiledKernelError: unpicklable on seqlen 7")
        iso(*qkv())
        assert iso.pid == pid and iso.deaths == 0  # no respawn after an exception
    finally:
        iso.close()


def test_an_exception_that_pickles_but_does_not_unpickle_comes_back_as_its_description():
    """Its __init__ wants a keyword pickle does not pass: sent as itself, it would fail in the
    parent's unpickling, with an error about __init__ instead of the kernel's."""
    iso = Isolated(f"{HANG}:raises_unrestorable", "cpu", timeout=60)
    try:
        with pytest.raises(RemoteError) as err:
            iso(*qkv())
        assert (err.value.type_name, str(err.value)) == ("NeedsKeyword", "needs a keyword: tile 128x128")
    finally:
        iso.close()


def test_a_call_past_the_limit_kills_the_worker_and_everything_it_started(deadline, tmp_path, monkeypatch):
    """The kernel waits forever on a process of its own: the call ends at the limit, the worker
    and that process are killed (the worker's process group), and a fresh worker answers next."""
    deadline(240)
    pidfile = tmp_path / "child.pid"
    monkeypatch.setenv("FA4_TEST_PIDFILE", str(pidfile))  # the spawned worker inherits it
    iso = Isolated(f"{HANG}:hangs_in_a_child", "cpu", timeout=2)
    try:
        iso._worker()  # started (and ready) before the clock: a spawn imports torch
        first = iso.pid
        t0 = time.perf_counter()
        with pytest.raises(KernelTimeout, match=r"forward call did not return within 2 s \(--timeout\)"):
            iso(*qkv())
        assert 2 <= time.perf_counter() - t0 < 30
        child = int(pidfile.read_text())
        for _ in range(50):  # SIGKILL is delivered at once; the exit shows in /proc a moment later
            if not (_alive(first) or _alive(child)):
                break
            time.sleep(0.1)
        assert not _alive(first) and not _alive(child)
        assert iso.pid is None and iso.deaths == 1
    finally:
        iso.close()


@pytest.mark.slow  # two worker spawns and a spare: 48 s on the loaded 2-core machine
def test_a_busy_loop_in_python_dies_at_the_limit_and_the_spare_takes_over(deadline):
    """Holding the GIL in a loop does not protect a kernel from the kill; after the first death
    a spare worker warms up, so the next timeout costs about the limit, not a spawn more."""
    deadline(240)
    iso = Isolated(f"{HANG}:busy_loop", "cpu", timeout=1)
    try:
        pids = []
        for _ in range(2):
            iso._worker()
            pids.append(iso.pid)
            with pytest.raises(KernelTimeout):
                iso(*qkv())
        assert pids[0] != pids[1] and iso.deaths == 2
        assert iso.spare is not None  # kept warming for the next call
    finally:
        iso.close()


def test_a_worker_killed_by_sigkill_is_said_to_be_likely_the_oom_killer():
    iso = Isolated(f"{HANG}:killed", "cpu", timeout=60)
    try:
        with pytest.raises(WorkerCrashed) as err:
            iso(*qkv())
        assert "killed (SIGKILL, exit code -9)" in str(err.value) and "out-of-memory killer" in str(err.value)
        assert iso.pid is None and iso.deaths == 1
    finally:
        iso.close()


def test_death_reasons_name_the_signal_or_the_exit_code():
    assert "killed (SIGKILL, exit code -9)" in death_reason(-9) and "out-of-memory killer" in death_reason(-9)
    assert death_reason(-11) == "the kernel's worker process died of SIGSEGV (exit code -11) on this case"
    assert death_reason(1) == "the kernel's worker process died (exit code 1) on this case"


def test_memory_exhaustion_has_its_own_reason():
    """torch.OutOfMemoryError (torch.cuda.OutOfMemoryError is the same class) and MemoryError,
    raised here or come back from a worker, say out of memory; only the first line of CUDA's
    message is kept."""
    gpu = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\nmore detail")
    assert failure_reason(gpu) == (
        "out-of-memory",
        "kernel ran out of GPU memory (OutOfMemoryError): CUDA out of memory. Tried to allocate 2.00 GiB.",
    )
    assert failure_reason(MemoryError("64 GiB"), "backward") == (
        "out-of-memory",
        "backward ran out of host memory (MemoryError): 64 GiB",
    )
    info = {
        "name": "OutOfMemoryError",
        "type": "torch.OutOfMemoryError",
        "message": "CUDA out of memory",
        "traceback": "",
        "kind": "gpu-oom",
    }
    assert failure_reason(RemoteError(info))[0] == "out-of-memory"
    assert failure_reason(RuntimeError("x")) == ("exception", "kernel raised RuntimeError: x")


def test_the_case_record_of_an_oom_in_the_kernel(tmp_path, capsys):
    """In the audit's process (no worker): the case is an error whose reason says out of memory."""
    rc = cli.main(
        [
            "run",
            "--quiet",
            "--kernel",
            f"{HANG}:raises_gpu_oom",
            "--no-isolate",
            "--config",
            config(),
            "--out",
            str(tmp_path),
        ]
    )
    (rec,) = json.loads((tmp_path / "report.json").read_text())["cases"]
    assert rc == 1 and rec["verdict"] == "error" and rec["cause"] == "out-of-memory"
    assert rec["reasons"] == [
        "kernel ran out of GPU memory (OutOfMemoryError): CUDA out of memory. Tried to allocate "
        "2.00 GiB. GPU 0 has a total capacity of 139.7 GiB"
    ]


def test_the_case_record_of_an_oom_in_the_kernels_worker(tmp_path):
    """A user kernel runs in its worker by default: the MemoryError comes back as itself, the
    reason says out of host memory, and the traceback is the worker's."""
    rc = cli.main(
        ["run", "--quiet", "--kernel", f"{HANG}:raises_host_oom", "--config", config(), "--out", str(tmp_path)]
    )
    (rec,) = json.loads((tmp_path / "report.json").read_text())["cases"]
    assert rc == 1 and rec["verdict"] == "error" and rec["cause"] == "out-of-memory"
    assert rec["reasons"] == ["kernel ran out of host memory (MemoryError): simulated: cannot allocate 64 GiB"]
    assert "in raises_host_oom" in rec["traceback"]


# ---- --timeout on the subcommands -----------------------------------------------------------


def _subcommands():
    parser = cli.build_parser()
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    return sub.choices


@pytest.mark.parametrize("name", ["run", "invariance", "fuzz", "fidelity"])
def test_every_kernel_calling_subcommand_takes_the_same_timeout(name):
    (action,) = [a for a in _subcommands()[name]._actions if "--timeout" in a.option_strings]
    assert action.help and "0: no limit" in action.help and action.default is None
    assert action.type("2.5") == 2.5 and action.type("0") == 0.0
    with pytest.raises(Exception, match="expected a finite number of seconds >= 0"):
        action.type("-1")


def test_timeout_setting_and_isolation():
    from argparse import Namespace

    from audits.cli.run_options import timeout_setting
    from audits.engine.worker import DEFAULT_TIMEOUT_S, isolation

    assert timeout_setting(Namespace(timeout=None)) == (DEFAULT_TIMEOUT_S, False)
    assert timeout_setting(Namespace(timeout=0.0)) == (None, True)
    assert timeout_setting(Namespace(timeout=3.0)) == (3.0, True)
    assert isolation(None, 3.0, True) is True  # every kernel, built-ins included
    assert isolation(None, DEFAULT_TIMEOUT_S, False)("fa4-model") is False
    assert isolation(None, DEFAULT_TIMEOUT_S, False)("m:f") is True
    assert isolation(False, None, True) is False  # --timeout 0: no limit, nothing to isolate for
    with pytest.raises(ValueError, match="--timeout 3 stops a kernel call by killing its worker process"):
        isolation(False, 3.0, True)


def test_no_isolate_with_a_timeout_is_a_usage_error(tmp_path, capsys):
    rc = cli.main(
        [
            "run",
            "--quiet",
            "--kernel",
            "fa4-model",
            "--no-isolate",
            "--timeout",
            "3",
            "--config",
            config(),
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 2 and "drop --no-isolate, or pass --timeout 0" in capsys.readouterr().err


@pytest.mark.slow
def test_run_with_a_kernel_that_hangs_on_some_cases(tmp_path, capsys, deadline, monkeypatch):
    """Causal cases hang, the others pass: each hanging case is a timeout after about the limit,
    the run goes on with a fresh worker, and every view shows the verdict."""
    deadline(400)
    out = tmp_path / "r"
    t0 = time.perf_counter()
    rc = cli.main(
        [
            "run",
            "--quiet",
            "--kernel",
            f"{HANG}:hangs_when_causal",
            "--timeout",
            "2",
            "--out",
            str(out),
            "--config",
            config(causal=True),
            "--config",
            config(),
            "--config",
            config(causal=True, seed=1),
        ]
    )
    elapsed = time.perf_counter() - t0
    printed = capsys.readouterr().out
    rep = json.loads((out / "report.json").read_text())
    verdicts = [(c["config"]["causal"], c["verdict"]) for c in rep["cases"]]
    assert rc == 1 and sorted(verdicts) == [(False, "pass"), (True, "timeout"), (True, "timeout")]
    assert rep["summary"]["verdicts"]["timeout"] == 2 and "timeout 2" in printed and "TIMEOUT" in printed
    assert elapsed < 300  # two limits of 2 s and the spawns of this loaded machine; without a limit: never
    why = next(c["reasons"][0] for c in rep["cases"] if c["verdict"] == "timeout")
    assert why.startswith("the kernel's forward call did not return within 2 s (--timeout)")
    junit = (out / "report.junit.xml").read_text()
    assert junit.count('type="timeout"') == 2 and 'errors="2"' in junit
    assert "| timeout |" in (out / "report.md").read_text()
    assert ",.timeout{background:#fde2e1}" in (out / "report.html").read_text()
    # gate re-judges from the fields: still timeouts, still failing
    assert cli.main(["gate", str(out / "report.json"), "--out", str(tmp_path / "g")]) == 1
    gated = json.loads((tmp_path / "g" / "report.json").read_text())
    assert [c["verdict"] for c in gated["cases"]] == [c["verdict"] for c in rep["cases"]]
    assert "TIMEOUT" in capsys.readouterr().out
    # the printed reproducer carries the run's limit: run from elsewhere, it times out after 2 s again
    repro = next(c["repro"] for c in rep["cases"] if c["verdict"] == "timeout")
    assert " --timeout 2 " in repro
    monkeypatch.chdir(tmp_path)
    assert cli.main(shlex.split(repro)[1:]) == 1
    again = json.loads((tmp_path / "fa4-audit-repro" / "report.json").read_text())
    assert [c["verdict"] for c in again["cases"]] == ["timeout"]


@pytest.mark.slow
def test_run_with_kernels_that_sleep_or_busy_loop_forever(tmp_path, capsys, deadline):
    """Two kernels on one run, each in its own worker: every case is a timeout, in bounded time."""
    deadline(400)
    rc = cli.main(
        [
            "run",
            "--quiet",
            "--kernel",
            f"{HANG}:sleeps_forever",
            "--kernel",
            f"{HANG}:busy_loop",
            "--timeout",
            "1",
            "--out",
            str(tmp_path),
            "--config",
            config(),
            "--config",
            config(causal=True),
        ]
    )
    assert rc == 1
    for kern in ("tests.hanging_kernels.sleeps_forever", "tests.hanging_kernels.busy_loop"):
        rep = json.loads((tmp_path / kern / "report.json").read_text())
        assert [c["verdict"] for c in rep["cases"]] == ["timeout", "timeout"], kern


@pytest.mark.slow
def test_invariance_with_a_timeout(tmp_path, capsys, deadline):
    """The causal case's properties time out (each in a fresh worker), the other's hold."""
    deadline(400)
    rc = cli.main(
        [
            "invariance",
            "--quiet",
            "--kernel",
            f"{HANG}:hangs_when_causal",
            "--timeout",
            "2",
            "--require",
            "batch",
            "--out",
            str(tmp_path),
            "--config",
            config(causal=True, seqlen_q=8),
            "--config",
            config(batch=2),
        ]
    )
    rep = json.loads((tmp_path / "invariance.json").read_text())
    res = {c["config"]["causal"]: c["properties"] for c in rep["cases"]}
    assert rc == 1 and res[True]["batch"]["result"] == "timeout" and res[True]["decode"]["result"] == "timeout"
    assert res[False]["batch"]["result"] == "holds"
    assert rep["summary"]["failing"] == ["batch"] and rep["summary"]["counts"]["batch"]["timeout"] == 1
    assert "1 timeout" in capsys.readouterr().out


@pytest.mark.slow
def test_fidelity_with_a_production_kernel_that_hangs(tmp_path, capsys, deadline):
    deadline(300)
    rc = cli.main(
        [
            "fidelity",
            "--quiet",
            "--production",
            f"{HANG}:sleeps_forever",
            "--timeout",
            "1",
            "--config",
            config(),
            "--out",
            str(tmp_path),
        ]
    )
    cap = capsys.readouterr()
    assert rc == 1 and "TIMEOUT" in cap.out and "none of 1 cases finished" in cap.err


def test_fuzz_passes_its_timeout_to_the_worker(tmp_path, monkeypatch):
    """``fuzz --timeout`` runs the kernel in a worker with that limit (recorded here by a
    stand-in for the worker that calls the kernel in this process)."""
    from audits.kernels import get_kernel

    made = []

    class Recorder:
        def __init__(self, kernel, device, *, timeout=None):
            made.append((kernel, timeout))
            self.fn = get_kernel(kernel)

        def __call__(self, *a, **kw):
            return self.fn(*a, **kw)

        def close(self):
            made.append("closed")

    monkeypatch.setattr(worker, "Isolated", Recorder)
    argv = [
        "fuzz",
        "--kernel",
        "sdpa-math",
        "--budget",
        "1",
        "--seed",
        "0",
        "--max-seqlen",
        "16",
        "--out",
        str(tmp_path),
        "--database",
        str(tmp_path / "db"),
    ]
    assert cli.main([*argv, "--timeout", "7"]) == 0
    assert made == [("sdpa-math", 7.0), "closed"]
    assert cli.main(argv) == 0 and len(made) == 2  # without --timeout: in this process


# ---- verdicts from fields, old reports upgraded ---------------------------------------------


def _ran(**over) -> dict:
    """A ran case's measurements whose output has NaN where the reference is finite."""
    m = {
        "status": "ran",
        "config": {"dtype": "bfloat16"},
        "lse_returned": True,
        "out": {"max_abs": 1.0, "nonfinite_where_ref_finite": 3, "nan_swallowed": 0},
    }
    return {**m, **over}


@pytest.mark.parametrize("kind", ["float32-range", "nonfinite-inputs"])
def test_rewording_the_out_of_domain_message_does_not_change_the_verdict(kind):
    th = load_thresholds()
    for claim in (False, True):
        th["policy"]["claim_float32_overflow"] = claim
        verdicts = {
            judge(_ran(out_of_domain=msg, out_of_domain_kind=kind), th)[0]
            for msg in ("inputs contain NaN/inf and k claims no semantics for them", "reworded", "x")
        }
        expect = "out-of-domain" if kind == "nonfinite-inputs" or not claim else "fail"
        assert verdicts == {expect}, (kind, claim)
    assert judge(_ran(out_of_domain=None, out_of_domain_kind=None), th)[0] == "fail"


def test_timeout_is_a_failing_verdict_everywhere():
    assert "timeout" in VERDICTS and "timeout" in FAILING
    th = load_thresholds()
    assert judge({"status": "timeout", "reason": "past 2 s"}, th) == ("timeout", ["past 2 s"])
    b = _ran(out={"max_abs": 0.0, "nonfinite_where_ref_finite": 0, "nan_swallowed": 0})
    b["backward"] = {"status": "timeout", "reason": "the kernel's backward call did not return within 2 s"}
    assert judge(b, th)[0] == "timeout"


def test_old_records_are_upgraded_from_their_text_once():
    old = {"out_of_domain": "inputs contain NaN/inf and sdpa-math claims no semantics for them", "reasons": []}
    assert upgrade_case(copy.deepcopy(old))["out_of_domain_kind"] == "nonfinite-inputs"
    assert upgrade_case({"out_of_domain": "logits can reach 1e39 > float32 max"})["out_of_domain_kind"] == (
        "float32-range"
    )
    kept = upgrade_case({"out_of_domain": "claims no semantics", "out_of_domain_kind": "float32-range"})
    assert kept["out_of_domain_kind"] == "float32-range"  # a field, once written, is never re-read from text
    oom = {"reasons": ["the audit's FP64 reference or bound ran out of GPU memory: CUDA out of memory"]}
    assert upgrade_case(oom)["audit_error"] is True


def test_an_old_schema_report_rejudges_identically(tmp_path, capsys):
    """sdpa-math on NaN/inf inputs (out-of-domain: it claims no semantics for them) and a normal
    case: the report written now, the same report as written before the structured fields (no
    ``out_of_domain_kind``, no ``timeout`` count) and one with every message reworded all
    re-judge to the same verdicts."""
    from audits.cli.reports import load_report

    out = tmp_path / "r"
    rc = cli.main(
        [
            "run",
            "--quiet",
            "--kernel",
            "sdpa-math",
            "--out",
            str(out),
            "--config",
            config(seqlen_q=1, seqlen_k=40, window=[8, 0], family="nan_inf_masked"),
            "--config",
            config(),
        ]
    )
    assert rc == 0
    new = json.loads((out / "report.json").read_text())
    assert [c["verdict"] for c in new["cases"]] == ["out-of-domain", "warn"]  # warn: SDPA returns no LSE
    assert new["cases"][0]["out_of_domain_kind"] == "nonfinite-inputs"
    old = copy.deepcopy(new)
    del old["summary"]["verdicts"]["timeout"]
    for c in old["cases"]:
        c.pop("out_of_domain_kind", None)
    reworded = copy.deepcopy(new)
    for c in reworded["cases"]:
        if c.get("out_of_domain"):
            c["out_of_domain"] = "the inputs hold non-finite values outside what this kernel documents"
    th = load_thresholds()
    for name, rep in (("old", old), ("reworded", reworded)):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(rep))
        got = rejudge(load_report(str(path)), th)
        assert [c["verdict"] for c in got["cases"]] == ["out-of-domain", "warn"], name
        assert cli.main(["gate", str(path)]) == 0, name
    assert "timeout" not in capsys.readouterr().out
