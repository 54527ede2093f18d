"""``run --jobs N``: a run spread over N child processes (``audits.engine.child``), each a compile-key
shard of the cases (so that JIT compilation runs N-wide), pinned to a GPU on CUDA.

Each child gets its work as files, never as command-line text: ``OUT/jobs/cases.json`` (the
parent's cases, whatever selected them) and ``OUT/jobs/I/job.json`` (the kernels, the
:class:`~audits.engine.options.RunOptions` of its shard, the report header); it writes its
journal, report and log (``log.txt``) under ``OUT/jobs/I/``.  The parent follows the journals,
passes a Ctrl-C on once, and gathers each kernel's records (and error maps) in case order."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from audits.common import EXIT_INCOMPLETE, EXIT_INTERRUPTED, EXIT_USAGE, UsageError, atomic_write, gpu_list, pinned_env
from audits.engine.journal import read_records
from audits.engine.options import RunOptions
from audits.engine.run import Runs, kernel_dir
from audits.engine.stop import StopReason
from audits.suites.cases import Case

__all__ = ["run_jobs", "write_jobs", "interrupt_jobs", "check_jobs", "gather_maps", "JOB_FILE", "CASE_FILE"]

#: each job's work, under OUT/jobs/I/; the parent's cases, under OUT/jobs/
JOB_FILE, CASE_FILE = "job.json", "cases.json"
#: how often the parent reads the jobs' journals, in seconds
POLL_S = 1.0


def write_jobs(
    kernels: list[str], cases: list[Case], options: RunOptions, *, header: dict, coverage: dict
) -> list[Path]:
    """The files of ``options.jobs`` jobs under ``OUT/jobs/``: the cases once, and per job its
    ``job.json`` (kernels, its options: shard I/N, its own folder, no progress, one process; the
    report ``header`` and the kept coverage bases the parent's report has); the job files' paths."""
    n, jobs = options.jobs, Path(options.out) / "jobs"
    atomic_write(jobs / CASE_FILE, json.dumps([c.as_dict() for c in cases]) + "\n")
    paths = []
    for i in range(n):
        d = jobs / str(i)
        d.mkdir(parents=True, exist_ok=True)
        mine = options.replace(out=str(d), jobs=1, gpus=None, quiet=True, shard=f"{i}/{n}")
        job = {
            "kernels": list(kernels),
            "cases": str(jobs / CASE_FILE),
            "options": mine.as_dict(),
            "header": header,
            "coverage": coverage,
        }
        atomic_write(d / JOB_FILE, json.dumps(job, indent=1) + "\n")
        paths.append(d / JOB_FILE)
    return paths


def run_jobs(
    kernels: list[str],
    cases: list[Case],
    options: RunOptions,
    *,
    header: dict,
    coverage: dict,
    progress: Callable[[str, dict], None] | None = None,
) -> Runs:
    """Run ``cases`` in ``options.jobs`` children (``python -m audits.engine.child OUT/jobs/I/job.json``),
    job I pinned to GPU I mod G of the G GPUs (``options.gpus``, default all visible;
    ``audits.common.gpu_list``) on CUDA; ``progress(kernel, record)`` for each record as the
    jobs' journals show it; each kernel's finished records in case order.  Each job runs its own
    cases in ``run_order``: at any moment the jobs' prefixes together span the suite's axes.
    Ctrl-C (to this process, or to the terminal's whole group) reaches every job, which writes its
    partial report; the result's ``stopped`` says why cases are missing (interrupted, budget,
    exitfirst, unfinished).  A job that refused its work is a :class:`UsageError`."""
    n, jobs, several = options.jobs, Path(options.out) / "jobs", len(kernels) > 1
    files = write_jobs(kernels, cases, options, header=header, coverage=coverage)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))
    gpus = gpu_list(options.gpus) if options.device == "cuda" or options.gpus else []
    journals = {(k, i): kernel_dir(jobs / str(i), k, several) / "journal.jsonl" for i in range(n) for k in kernels}
    procs, stopped, seen = [], None, set()
    try:
        for i, job in enumerate(files):
            with open(job.parent / "log.txt", "a") as log:
                # a session of its own: a terminal's Ctrl-C reaches this process only, which passes it on
                # once (interrupt_jobs), so that no job is interrupted again while it writes its report
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "audits.engine.child", str(job)],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=pinned_env(env, gpus, i),
                        start_new_session=True,
                    )
                )
        try:
            while any(p.poll() is None for p in procs):
                time.sleep(POLL_S)
                _report_progress(journals, seen, progress)
        except KeyboardInterrupt:
            stopped = StopReason.INTERRUPTED
            interrupt_jobs(procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
    check_jobs(procs, jobs)
    order = {c.name: i for i, c in enumerate(cases)}
    runs = {}
    for k in kernels:
        recs, src = {}, {}
        for i in range(n):
            got = read_records(journals[k, i])
            recs.update(got)
            src.update(dict.fromkeys(got, kernel_dir(jobs / str(i), k, several)))
        runs[k] = sorted((r for r in recs.values() if r["case"] in order), key=lambda r: order[r["case"]])
        gather_maps(runs[k], src, kernel_dir(Path(options.out), k, several))
    if stopped is None and any(len(r) < len(cases) for r in runs.values()):
        budget = options.budget is not None and any(p.returncode == EXIT_INCOMPLETE for p in procs)
        stopped = StopReason.BUDGET if budget else StopReason.EXITFIRST if options.exitfirst else StopReason.UNFINISHED
    return Runs(runs, stopped)


def _report_progress(journals: dict, seen: set, progress: Callable[[str, dict], None] | None) -> None:
    """``progress`` for each record the jobs' journals hold that was not reported yet."""
    if progress is None:
        return
    for (kern, _), path in journals.items():
        for name, rec in read_records(path).items():
            if (kern, name) not in seen:
                seen.add((kern, name))
                progress(kern, rec)


def gather_maps(records: list[dict], src: dict, dest: Path) -> None:
    """Each record's error map (``maps/<case>.npz``, written by the job that ran it, under ``src``
    [case]) copied to ``dest``, the parent's report folder, where the record's relative path points
    (copied, not moved: a ``--resume`` of the jobs keeps its own)."""
    for r in records:
        rel = r.get("error_map")
        if rel and (src[r["case"]] / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src[r["case"]] / rel, dest / rel)


def interrupt_jobs(procs: list[subprocess.Popen]) -> None:
    """Ctrl-C reached this process: pass it to every job still running (a job stops at its case
    boundary and writes its partial report) and give them 30 s to do so."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass


def check_jobs(procs: list[subprocess.Popen], jobs: Path) -> None:
    """A :class:`UsageError` when a job refused its work (a usage or environment error, e.g. a
    ``--resume`` onto another run's journal): its journal's records are not this run's, so no
    report may be built from them.  A job that died otherwise keeps its finished records (its
    journal header was checked); the cases it left are reported as unfinished."""
    for i, p in enumerate(procs):
        if p.returncode in (0, 1, EXIT_INCOMPLETE, EXIT_INTERRUPTED):  # passed, failed, stopped with a report
            continue
        log = jobs / str(i) / "log.txt"
        if p.returncode == EXIT_USAGE:
            lines = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
            raise UsageError(f"job {i} refused to run: {lines[-1] if lines else '(empty log)'} (log: {log})")
        print(f"job {i} exited with code {p.returncode}; see {log}", file=sys.stderr)
