"""pytest plugin (entry point ``pytest11``): audit your own kernels inside your test suite.

    def test_my_kernel(fa4_audit):
        fa4_audit("mypkg.attention:my_kernel", suite="smoke")

The ``fa4_audit`` fixture runs a suite for a kernel (a registered name or ``module:attr``)
exactly as ``fa4-audit run`` does, writes the report under pytest's temporary directory, and
fails the test with the failing cases, their reasons and reproducers; it returns the report.

Under pytest-xdist (``pytest -n N``) every test that uses the fixture runs once per worker, each
instance auditing its shard ``I/N`` of the cases (``shard_cases``, balanced by cost), so the
workers share one audit; at the end of the session the controller merges the shards into one
report per test (``audits.report.merge``, as ``fa4-audit merge``), named in the terminal summary.

The entry point loads this module into every pytest run of the environment, so loading it has
no side effect: it imports nothing heavy (torch, numpy and the audit modules are imported by the
fixture, when a test asks for it), sets no environment variable, and uses only public pytest and
xdist API (the ``tmp_path_factory`` fixture; xdist's ``workerinput``/``workeroutput``).

GPU pinning is opt-in: with ``--fa4-audit-pin-gpus`` (or ``fa4_audit_pin_gpus = true`` in the
ini file) the xdist controller hands each worker its GPU, and worker ``gwI`` sets
``CUDA_VISIBLE_DEVICES`` to GPU ``I mod G`` of the G GPUs the controller sees (the entries of its
``CUDA_VISIBLE_DEVICES``, or all of them), before anything in the worker initialises CUDA;
nothing happens with fewer than two GPUs or without xdist.  It is an option and not a marker
because the choice must be made when the worker starts, before any test (or marker) is seen.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
from pathlib import Path

import pytest

__all__ = ["fa4_audit", "visible_gpus", "worker_gpu"]

#: the controller's set of folders where the workers left shard reports (from their ``workeroutput``)
_SHARD_ROOTS = pytest.StashKey[set]()
#: the merged reports, for the terminal summary
_MERGED = pytest.StashKey[list]()
#: the ``workerinput``/``workeroutput`` keys this plugin uses
_GPUS_KEY, _SHARDS_KEY = "fa4_audit_gpus", "fa4_audit_shards"


@pytest.fixture
def fa4_audit_shard(request) -> str | None:
    """The shard ``"I/N"`` this instance of a test audits under pytest-xdist, else None."""
    return getattr(request, "param", None)


@pytest.fixture
def fa4_audit(tmp_path, tmp_path_factory, fa4_audit_shard, request):
    """Callable ``(kernel, *, suite="smoke", case="*", device="cpu", thresholds=None,
    isolate=False, backward=False, repeat=2, deterministic=False, known=None, strict_known=False)
    -> report dict``; fails the calling test when any case fails.  ``backward``: audit the
    gradients too (``run --backward``); ``known``: a known-defects file (``run --known``: a TOML
    path, or ``"fa4"``), whose failures get the verdict known and do not fail the test;
    ``strict_known``: an entry no longer reproducing does (``--strict-known``)."""
    # imported here, not at the top: loading the plugin must stay light (module doc)
    from audits.api import RunOptions, StopReason
    from audits.api import audit as run_audit
    from audits.engine.backward import BackwardOptions
    from audits.engine.shards import shard_cases
    from audits.report.build import summary_line, write_report
    from audits.report.schema import FAILING
    from audits.verdict.gate import load_thresholds
    from audits.verdict.known import known_lines, load_known, strict_failed

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
        known: str | None = None,
        strict_known: bool = False,
    ) -> dict:
        cases = [c for c in _cases(kernel, suite) if fnmatch.fnmatch(c.name, case)]
        if fa4_audit_shard is not None:
            i, n = (int(x) for x in fa4_audit_shard.split("/"))
            cases = shard_cases(cases, i, n, by="cost")
        out = tmp_path / f"fa4-audit-{Path(suite).stem}"
        options = RunOptions(
            device=device,
            out=out,
            thresholds=load_thresholds(thresholds),
            label=suite,
            isolate=isolate,
            backward=BackwardOptions(repeat=repeat, deterministic=deterministic) if backward else None,
            shard=fa4_audit_shard,
            known=None if known is None else load_known(known),  # a bad file: KnownError, naming it
            strict_known=strict_known,
        )
        header = {"command": f"fa4_audit({kernel!r}, suite={suite!r}, case={case!r})", "created": "", "environment": {}}
        result = run_audit(kernel, cases, options, header=header)
        if result.stopped == StopReason.INTERRUPTED:  # Ctrl-C ends the test session, as it would without the audit
            raise KeyboardInterrupt
        rep = result.reports[kernel]
        paths = write_report(rep, out)
        if fa4_audit_shard is not None:  # for the controller's merge at the session's end
            _keep_shard(request, tmp_path_factory, paths["json"], fa4_audit_shard)
        if result.exit_code:
            bad = [r for r in rep["cases"] if r["verdict"] in FAILING]
            lines = [
                f"  {r['verdict']}: {r['case']}: {'; '.join(x for x in r['reasons'] if x)}\n    reproduce: {r['repro']}"
                for r in bad[:10]
            ]
            why = f"fails {len(bad)} case(s)" if bad else "evaluated no case (nothing was audited)"
            if not bad and strict_failed(rep):
                why = "has a known defect no longer reproducing (strict_known)"
            lines += known_lines(rep)  # known=: the known defects, apart from the failures
            pytest.fail(
                f"fa4-audit: {kernel} {why} of suite {suite}; {summary_line(rep)} (report {paths['md']}):\n"
                + "\n".join(lines),
                pytrace=False,
            )
        return rep

    return audit


def pytest_addoption(parser):
    group = parser.getgroup("fa4-audit", "fa4-audit (the fa4_audit fixture)")
    group.addoption(
        "--fa4-audit-pin-gpus",
        action="store_true",
        default=None,
        help="under pytest-xdist, pin worker gwI to GPU I mod G of the G GPUs this process sees "
        "(CUDA_VISIBLE_DEVICES); off by default (ini: fa4_audit_pin_gpus)",
    )
    parser.addini(
        "fa4_audit_pin_gpus",
        type="bool",
        default=False,
        help="as --fa4-audit-pin-gpus: pin each pytest-xdist worker to one GPU",
    )


def pytest_configure(config):
    config.addinivalue_line("markers", "fa4_audit: a test that audits an attention kernel with fa4-audit")
    worker = getattr(config, "workerinput", None)
    gpus = worker.get(_GPUS_KEY) if worker is not None else None
    if gpus:  # the controller was asked to pin (pytest_configure_node); before anything here initialises CUDA
        gpu = worker_gpu(worker["workerid"], len(gpus))
        if gpu is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = gpus[int(gpu)]


def _pin_gpus_asked(config) -> bool:
    """Whether the user asked for GPU pinning: ``--fa4-audit-pin-gpus``, else the ini option."""
    opt = config.getoption("fa4_audit_pin_gpus", default=None)
    return bool(config.getini("fa4_audit_pin_gpus")) if opt is None else bool(opt)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """On the xdist controller, when pinning is asked: hand each worker the GPUs to choose from."""
    if _pin_gpus_asked(node.config):
        node.workerinput[_GPUS_KEY] = visible_gpus()


def worker_gpu(worker_id: str, gpus: int) -> str | None:
    """The index (into the visible GPUs) an xdist worker (``gw0``, ``gw1``, ...) is pinned to: its
    number mod ``gpus``; None with fewer than two GPUs (nothing to choose)."""
    m = re.fullmatch(r"gw(\d+)", worker_id)
    return str(int(m.group(1)) % gpus) if m and gpus > 1 else None


def visible_gpus() -> list[str]:
    """The GPUs this process sees, as ``CUDA_VISIBLE_DEVICES`` names them: that variable's entries
    when set (torch is not imported then), else ``0 .. count-1`` (as ``audits.common.gpu_list``)."""
    seen = os.environ.get("CUDA_VISIBLE_DEVICES")
    if seen is not None:
        return [x.strip() for x in seen.split(",") if x.strip()]
    return [str(i) for i in range(_gpu_count())]


def _gpu_count() -> int:
    """torch's device count (NVML first: no CUDA context in the controller)."""
    import torch

    return torch.cuda.device_count()


def pytest_generate_tests(metafunc):
    """Under xdist with N workers, a test using ``fa4_audit`` becomes N instances, shard I/N each."""
    n = int(getattr(metafunc.config, "workerinput", {}).get("workercount", 1))
    if "fa4_audit" in metafunc.fixturenames and n > 1:
        metafunc.parametrize(
            "fa4_audit_shard", [f"{i}/{n}" for i in range(n)], indirect=True, ids=[f"shard{i}of{n}" for i in range(n)]
        )


def _keep_shard(request, tmp_path_factory, report: Path, shard: str) -> None:
    """Copy a shard's report where the controller finds it: one folder per test (its node id
    without the shard parameter), under the parent of this worker's temporary root (xdist makes
    each worker's root a folder of the controller's, ``popen-gwN``); the folder goes back to the
    controller in the worker's ``workeroutput``."""
    root = tmp_path_factory.getbasetemp().parent / "fa4-audit-shards"
    test = re.sub(r"\[shard\d+of\d+\]$", "", request.node.nodeid)
    d = root / re.sub(r"[^A-Za-z0-9_.-]+", "_", test)
    d.mkdir(parents=True, exist_ok=True)
    shutil.copy(report, d / f"shard-{shard.replace('/', 'of')}.json")
    output = getattr(request.config, "workeroutput", None)
    if output is not None:
        output[_SHARDS_KEY] = str(root)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """On the xdist controller: note where a finished worker left shard reports."""
    root = (getattr(node, "workeroutput", None) or {}).get(_SHARDS_KEY)
    if root:
        node.config.stash.setdefault(_SHARD_ROOTS, set()).add(root)


def pytest_sessionfinish(session, exitstatus):
    """On the xdist controller: merge each test's shard reports into one (``audits.report.merge``)."""
    config = session.config
    if hasattr(config, "workerinput") or not config.stash.get(_SHARD_ROOTS, None):
        return
    tests: dict[str, list[Path]] = {}
    for root in sorted(Path(r) for r in config.stash[_SHARD_ROOTS]):
        for d in sorted(p for p in root.glob("*") if p.is_dir()):
            tests.setdefault(d.name, []).append(d)
    from audits.report.header import command_line
    from audits.report.merge import merge_files  # here, not at the top: the plugin loads light (module doc)

    merged = []
    for dirs in tests.values():
        shards = sorted(str(p) for d in dirs for p in d.glob("shard-*.json"))
        out = dirs[0] / "merged"
        rep, paths = merge_files(shards, out, command=command_line(["merge", *shards, "--out", str(out)]))
        print(f"merged {len(shards)} reports, {len(rep['cases'])} cases: {paths['md']}")
        merged.append(paths["md"])
    config.stash[_MERGED] = merged


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    for path in config.stash.get(_MERGED, []):
        terminalreporter.write_line(f"fa4-audit: merged report of the shards: {path}")


def _cases(kernel: str, suite: str) -> list:
    """The suite's cases as ``fa4-audit run`` builds them for this one kernel: a named suite
    (or a suite file, ``audits.suites.suite_file``) within the kernel's declared domain."""
    from audits.kernels import kernel_domain
    from audits.suites.cases import build_suite
    from audits.suites.domain import Domain
    from audits.suites.suite_file import build, is_suite_file, load

    d = kernel_domain(kernel)
    if is_suite_file(suite):  # its [[case]]s outside the domain stay: the engine skips them, with the reason
        return build(load(suite), d, cases_in=Domain())["cases"]
    return build_suite(suite, d)["cases"]
