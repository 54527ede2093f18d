"""pytest plugin (entry point ``pytest11``): audit your own kernels inside your test suite.

    def test_my_kernel(fa4_audit):
        fa4_audit("mypkg.attention:my_kernel", suite="smoke")

The ``fa4_audit`` fixture runs a suite for a kernel (a registered name or ``module:attr``)
exactly as ``fa4-audit run`` does, writes the report under pytest's temporary directory, and
fails the test with the failing cases, their reasons and reproducers; it returns the report.

Under pytest-xdist (``pytest -n N``) every test that uses the fixture runs once per worker, each
instance auditing its shard ``I/N`` of the cases (``shard_cases``, balanced by cost), so the
workers share one audit; each worker is pinned to one GPU (``CUDA_VISIBLE_DEVICES`` = worker
index mod the GPU count) when there are several, and at the end of the session the controller
merges the shards into one report per test (``fa4-audit merge``), named in the terminal summary.
"""

from __future__ import annotations

import fnmatch
import os
import re
from pathlib import Path

import pytest

__all__ = ["fa4_audit"]


@pytest.fixture
def fa4_audit_shard(request) -> str | None:
    """The shard ``"I/N"`` this instance of a test audits under pytest-xdist, else None."""
    return getattr(request, "param", None)


@pytest.fixture
def fa4_audit(tmp_path, fa4_audit_shard, request):
    """Callable ``(kernel, *, suite="smoke", case="*", device="cpu", thresholds=None,
    isolate=False, backward=False, repeat=2, deterministic=False) -> report dict``; fails the
    calling test when any case fails.  ``backward``: audit the gradients too (``run --backward``)."""
    import torch

    from audits.runner.engine import FAILING, run_suite
    from audits.runner.gate import load_thresholds
    from audits.runner.report import build_report, exit_code, summary_line, write_report

    def audit(
        kernel: str,
        *,
        suite: str = "smoke",
        case: str = "*",
        device: str = "cpu",
        thresholds=None,
        isolate: bool = False,
        backward: bool = False,
        repeat: int = 2,
        deterministic: bool = False,
    ) -> dict:
        from audits.runner.backward import BackwardOptions

        cases = [c for c in _cases(kernel, suite) if fnmatch.fnmatch(c.name, case)]
        if fa4_audit_shard is not None:
            from audits.runner.engine import shard_cases

            i, n = (int(x) for x in fa4_audit_shard.split("/"))
            cases = shard_cases(cases, i, n, by="cost")
        th = load_thresholds(thresholds)
        out = tmp_path / f"fa4-audit-{Path(suite).stem}"
        bwd = BackwardOptions(repeat=repeat, deterministic=deterministic) if backward else None
        records = run_suite(
            kernel, cases, device=torch.device(device), out_dir=out, thresholds=th, suite=suite, isolate=isolate,
            backward=bwd,
        )  # fmt: skip
        rep = build_report(
            kernel=kernel,
            suite=suite,
            seed=0,
            device=device,
            environment={},
            thresholds=th,
            records=records,
            command=f"fa4_audit({kernel!r}, suite={suite!r}, case={case!r})",
            created="",
            shard=fa4_audit_shard,
        )
        paths = write_report(rep, out)
        if fa4_audit_shard is not None:  # for the controller's merge at the session's end
            _keep_shard(request, paths["json"], fa4_audit_shard)
        if exit_code(rep):
            bad = [r for r in records if r["verdict"] in FAILING]
            lines = [f"  {r['verdict']}: {r['case']}: {'; '.join(x for x in r['reasons'] if x)}\n"
                     f"    reproduce: {r['repro']}" for r in bad[:10]]  # fmt: skip
            why = f"fails {len(bad)} case(s)" if bad else "evaluated no case (nothing was audited)"
            pytest.fail(
                f"fa4-audit: {kernel} {why} of suite {suite}; {summary_line(rep)} (report {paths['md']}):\n"
                + "\n".join(lines),
                pytrace=False,
            )
        return rep

    return audit


def pytest_configure(config):
    config.addinivalue_line("markers", "fa4_audit: a test that audits an attention kernel with fa4-audit")
    worker = getattr(config, "workerinput", None)
    if worker is not None and "CUDA_VISIBLE_DEVICES" not in os.environ:
        gpu = worker_gpu(worker["workerid"], _gpu_count())
        if gpu is not None:  # before anything in this worker initialises CUDA
            os.environ["CUDA_VISIBLE_DEVICES"] = gpu


def worker_gpu(worker_id: str, gpus: int) -> str | None:
    """The GPU an xdist worker (``gw0``, ``gw1``, ...) is pinned to: its index mod ``gpus``;
    None with fewer than two GPUs (nothing to choose)."""
    m = re.fullmatch(r"gw(\d+)", worker_id)
    return str(int(m.group(1)) % gpus) if m and gpus > 1 else None


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_generate_tests(metafunc):
    """Under xdist with N workers, a test using ``fa4_audit`` becomes N instances, shard I/N each."""
    n = int(getattr(metafunc.config, "workerinput", {}).get("workercount", 1))
    if "fa4_audit" in metafunc.fixturenames and n > 1:
        metafunc.parametrize("fa4_audit_shard", [f"{i}/{n}" for i in range(n)], indirect=True,
                             ids=[f"shard{i}of{n}" for i in range(n)])  # fmt: skip


def _shard_dir(config) -> Path:
    """Where the shard reports wait for the merge: in the controller's temporary root (each
    xdist worker's root is a folder of it, ``popen-gwN``)."""
    base = Path(config._tmp_path_factory.getbasetemp())
    return (base.parent if hasattr(config, "workerinput") else base) / "fa4-audit-shards"


def _keep_shard(request, report: Path, shard: str) -> None:
    """Copy a shard's report where the controller finds it: one folder per test (its node id
    without the shard parameter)."""
    import shutil

    test = re.sub(r"\[shard\d+of\d+\]$", "", request.node.nodeid)
    d = _shard_dir(request.config) / re.sub(r"[^A-Za-z0-9_.-]+", "_", test)
    d.mkdir(parents=True, exist_ok=True)
    shutil.copy(report, d / f"shard-{shard.replace('/', 'of')}.json")


def pytest_sessionfinish(session, exitstatus):
    """On the xdist controller: merge each test's shard reports into one (``fa4-audit merge``)."""
    if hasattr(session.config, "workerinput") or not hasattr(session.config, "_tmp_path_factory"):
        return
    root = _shard_dir(session.config)
    merged = []
    for d in sorted(p for p in root.glob("*") if p.is_dir()) if root.is_dir() else []:
        import argparse

        from audits.runner.cli_reports import cmd_merge

        shards = sorted(str(p) for p in d.glob("shard-*.json"))
        argv = ["merge", *shards, "--out", str(d / "merged")]
        cmd_merge(argparse.Namespace(reports=shards, out=str(d / "merged"), argv=argv))
        merged.append(d / "merged" / "report.md")
    session.config._fa4_audit_merged = merged


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    for path in getattr(config, "_fa4_audit_merged", []):
        terminalreporter.write_line(f"fa4-audit: merged report of the shards: {path}")


def _cases(kernel: str, suite: str) -> list:
    """The suite's cases as ``fa4-audit run`` builds them for this one kernel: a named suite
    (or a suite file, ``audits.suite_file``) within the kernel's declared domain."""
    from audits.domain import Domain, named_suite_within
    from audits.kernels import kernel_domain
    from audits.suite_file import build, is_suite_file, load

    d = kernel_domain(kernel)
    if is_suite_file(suite):  # its [[case]]s outside the domain stay: the engine skips them, with the reason
        return build(load(suite), d, cases_in=Domain())["cases"]
    return named_suite_within(suite, d)["cases"]
