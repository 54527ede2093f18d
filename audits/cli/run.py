"""``fa4-audit run``: a kernel (or several) on a suite, a case file or given cases; one report
per kernel; results on stdout, progress on stderr.  The commands that read reports are in
``audits.cli.reports``."""

from __future__ import annotations

import argparse
import datetime as _dt
import shlex
import shutil
import sys
from pathlib import Path

from audits.common import EXIT_FAIL, EXIT_INCOMPLETE, EXIT_INTERRUPTED, EXIT_USAGE, UsageError, gpu_list, progress
from audits.common import device as _device
from audits.common import environment as _environment
from audits.kernels import usable_kernels

#: what a run writes into OUT (and OUT/<kernel>/ with several kernels); --overwrite removes
#: exactly these, nothing else a user keeps there
RUN_FILES = ("report.json", "report.md", "report.html", "report.junit.xml", "journal.jsonl")
RUN_DIRS = ("repro", "jobs")
#: failing cases listed (with their reproducers) at the end of a failing run
SHOW_FAILING = 10


def _select_cases(args: argparse.Namespace) -> tuple[list, str]:
    """(cases, label): the shared selection (``audits.suites.selection``: suite, given cases, domain,
    --seed, --case), then run's own --shard."""
    from audits.engine.evaluate import shard_cases
    from audits.engine.shards import parse_shard
    from audits.suites.selection import select_cases

    sel = select_cases(args, kernels=args.kernel)
    cases, label = sel.cases, sel.label
    if sel.domain_info is not None:
        args.domain_info = sel.domain_info  # the domain the suite was built in, for the report
    if args.shard:
        if args.shard == "auto":
            args.shard = _auto_shard(args)
        try:
            i, n = parse_shard(args.shard)
            whole = {c.name: k for k, c in enumerate(cases)}
            cases = shard_cases(cases, i, n, by=args.shard_by)
        except ValueError as exc:
            raise UsageError(f"--shard {args.shard!r}: expected I/N with 0 <= I < N, or auto ({exc})") from exc
        # each case's place in the unsharded run, so that merge puts the shards back in its order
        args.shard_order = {c.name: whole[c.name] for c in cases}
    elif args.shards is not None:
        raise UsageError("--shards N gives the shard count to --shard auto: add --shard auto")
    return cases, label


def _auto_shard(args: argparse.Namespace) -> str:
    """``--shard auto``: "I/N" from a Slurm array's or a Kubernetes Indexed Job's environment
    (``audits.engine.shards``), said on stderr."""
    from audits.engine.shards import ShardEnvError, shard_from_env

    try:
        i, n, src = shard_from_env(shards=args.shards)
    except ShardEnvError as exc:
        raise UsageError(f"--shard auto: {exc}") from exc
    print(f"--shard auto: shard {i}/{n} from the {src}", file=sys.stderr)
    return f"{i}/{n}"


def _previous_run(out: Path) -> list[Path]:
    """Files and folders a run left in ``out`` (and one level of per-kernel folders below it)."""
    found = []
    for d in [out, *(p for p in out.iterdir() if p.is_dir() and p.name not in RUN_DIRS)] if out.is_dir() else []:
        found += [d / f for f in RUN_FILES if (d / f).exists()] + [d / f for f in RUN_DIRS if (d / f).is_dir()]
    return found


def _prepare_out(args: argparse.Namespace) -> None:
    """A fresh run never mixes with another run's files: refuse a used OUT (exit 2) unless
    ``--overwrite`` (then remove exactly what a run writes) or ``--resume``."""
    out = Path(args.out)
    old = _previous_run(out)
    if args.resume or not old:
        return
    if not args.overwrite:
        shown = ", ".join(str(p) for p in old[:4]) + (" ..." if len(old) > 4 else "")
        raise UsageError(
            f"--out {out} holds another run ({shown}); pass --resume to continue that run, "
            "--overwrite to replace it, or another --out"
        )
    for p in old:
        shutil.rmtree(p) if p.is_dir() else p.unlink()


def _run_here(args, kernels, cases, label, th, device, header: dict, stopped: dict) -> dict[str, list[dict]]:
    """The run in this process (``run_suites``); why it stopped early goes into ``stopped``
    (Ctrl-C is caught there, so that the records so far make a partial report)."""
    from rich.console import Console

    from audits.engine.evaluate import FAILING, run_suites
    from audits.engine.journal import JournalMismatch
    from audits.engine.worker import isolation, timeout_setting

    timeout, explicit = timeout_setting(args)
    try:
        isolate = isolation(args.isolate, timeout, explicit)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    deadline = None if args.budget is None else header["started"] + 60.0 * args.budget
    failing = [0]

    def tick(kern: str, rec: dict) -> None:
        failing[0] += rec["verdict"] in FAILING
        bar.update(task, advance=1, failing=failing[0])

    with progress(Console(stderr=True), quiet=args.quiet) as bar:
        task = bar.add_task(f"{', '.join(kernels)} / {label}", total=len(cases) * len(kernels), failing=0)
        try:
            return run_suites(
                kernels,
                cases,
                device=device,
                out_dir=args.out,
                thresholds=th,
                suite=label,
                seed=args.seed,
                resume=args.resume,
                exitfirst=args.exitfirst,
                isolate=isolate,
                progress=tick,
                backward=_backward_options(args),
                per_sequence=args.per_sequence,
                timeout=timeout,
                deadline=deadline,
                stopped=stopped,
                journal_extra={"report": header["report"], "coverage": _kept_bases(header["coverage"])},
            )
        except JournalMismatch as exc:
            raise UsageError(f"--resume refused: {exc}") from exc


def _child_argv(args: argparse.Namespace, kernels: list[str], case_file: Path, label: str) -> list[str]:
    """The ``run`` arguments each ``--jobs`` child gets: the parent's case list as a case file
    (so the children see exactly the parent's cases, whatever defined them)."""
    argv = [a for k in kernels for a in ("--kernel", k)]
    argv += ["--case-file", str(case_file), "--label", label, "--device", args.device, "--quiet"]
    argv += ["--thresholds", args.thresholds] if args.thresholds else []
    argv += ["--resume"] if args.resume else []
    argv += ["-x"] if args.exitfirst else []
    argv += ["--budget", repr(args.budget)] if getattr(args, "budget", None) is not None else []
    argv += [] if args.isolate is None else (["--isolate"] if args.isolate else ["--no-isolate"])
    argv += [] if args.timeout is None else ["--timeout", repr(args.timeout)]
    argv += ["--backward", "--repeat", str(args.repeat)] if args.backward else []
    argv += ["--deterministic"] if args.deterministic else []
    argv += ["--per-sequence"] if args.per_sequence else []
    return argv


def _backward_options(args: argparse.Namespace):
    """``BackwardOptions`` of ``--backward`` / ``--repeat`` / ``--deterministic``, None without."""
    from audits.engine.backward import BackwardOptions

    return BackwardOptions(repeat=args.repeat, deterministic=args.deterministic) if args.backward else None


def _check_backward_args(args: argparse.Namespace, th: dict) -> None:
    """--repeat and --deterministic need --backward; --backward needs [backward] thresholds."""
    from audits.verdict.gate import ThresholdsError, require_backward

    if not args.backward:
        if args.repeat is not None or args.deterministic:
            raise UsageError("--repeat and --deterministic apply to gradients: add --backward")
        return
    if args.repeat is None:
        args.repeat = 2
    if args.repeat < 1:
        raise UsageError(f"--repeat {args.repeat}: expected a number of backward runs >= 1 (default 2)")
    if args.deterministic and args.repeat < 2:
        raise UsageError("--deterministic compares backward runs: it needs --repeat 2 or more")
    try:
        require_backward(th)
    except ThresholdsError as exc:
        raise UsageError(str(exc)) from exc


def _run_jobs(args, kernels, cases, label, stopped: dict) -> dict[str, list[dict]]:
    """``run --jobs N``: N child processes ``run --shard I/N --shard-by key`` (each compiles
    only its own compile keys, so JIT compilation runs N-wide), job I pinned to GPU I mod G of
    the G GPUs (``--gpus``, default all visible; ``audits.common.gpu_list``) on CUDA, journals
    under OUT/jobs/I/, logs in OUT/jobs/I/log.txt; returns each kernel's finished records in
    case order.  Each job runs its own cases in ``run_order``: at any moment the jobs' prefixes
    together span the suite's axes.  Ctrl-C (to this process, or to the terminal's whole group)
    reaches every job, which writes its partial report; ``stopped["reason"]`` says why cases
    are missing ("interrupted", "budget", "exitfirst", "unfinished")."""
    import json
    import os
    import subprocess
    import time

    from rich.console import Console

    from audits.common import atomic_write, gpu_list, pinned_env
    from audits.engine.evaluate import FAILING, kernel_dir
    from audits.engine.journal import read_records

    n, jobs, several = args.jobs, Path(args.out) / "jobs", len(kernels) > 1
    atomic_write(jobs / "cases.json", json.dumps([c.as_dict() for c in cases]) + "\n")
    argv = _child_argv(args, kernels, jobs / "cases.json", label)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))
    gpus = gpu_list(args.gpus) if args.device == "cuda" or args.gpus else []
    journals = [kernel_dir(jobs / str(i), k, several) / "journal.jsonl" for i in range(n) for k in kernels]
    procs = []
    try:
        for i in range(n):
            d = jobs / str(i)
            d.mkdir(parents=True, exist_ok=True)
            with open(d / "log.txt", "a") as log:
                cmd = [sys.executable, "-m", "audits", "run", *argv, "--shard", f"{i}/{n}", "--shard-by", "key"]
                cmd += ["--out", str(d)]
                # a session of its own: a terminal's Ctrl-C reaches this process only, which passes it on
                # once (_interrupt_jobs), so that no job is interrupted again while it writes its report
                procs.append(
                    subprocess.Popen(
                        cmd, stdout=log, stderr=subprocess.STDOUT, env=pinned_env(env, gpus, i), start_new_session=True
                    )
                )
        with progress(Console(stderr=True), quiet=args.quiet) as bar:
            task = bar.add_task(f"{', '.join(kernels)} / {label} ({n} jobs)", total=len(cases) * len(kernels))
            try:
                while any(p.poll() is None for p in procs):
                    time.sleep(1.0)
                    done = [r for j in journals for r in read_records(j).values()]
                    bar.update(task, completed=len(done), failing=sum(r["verdict"] in FAILING for r in done))
            except KeyboardInterrupt:
                stopped["reason"] = "interrupted"
                _interrupt_jobs(procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
    _check_jobs(procs, jobs)
    order = {c.name: i for i, c in enumerate(cases)}
    runs = {}
    for k in kernels:
        recs, src = {}, {}
        for i in range(n):
            got = read_records(kernel_dir(jobs / str(i), k, several) / "journal.jsonl")
            recs.update(got)
            src.update(dict.fromkeys(got, kernel_dir(jobs / str(i), k, several)))
        runs[k] = sorted((r for r in recs.values() if r["case"] in order), key=lambda r: order[r["case"]])
        _gather_maps(runs[k], src, kernel_dir(Path(args.out), k, several))
    if "reason" not in stopped and any(len(r) < len(cases) for r in runs.values()):
        budget = args.budget is not None and any(p.returncode == EXIT_INCOMPLETE for p in procs)
        stopped["reason"] = "budget" if budget else "exitfirst" if args.exitfirst else "unfinished"
    return runs


def _gather_maps(records: list[dict], src: dict, dest: Path) -> None:
    """Each record's error map (``maps/<case>.npz``, written by the job that ran it, under ``src``
    [case]) copied to ``dest``, the parent's report folder, where the record's relative path points
    (copied, not moved: a ``--resume`` of the jobs keeps its own)."""
    import shutil

    for r in records:
        rel = r.get("error_map")
        if rel and (src[r["case"]] / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src[r["case"]] / rel, dest / rel)


def _interrupt_jobs(procs) -> None:
    """Ctrl-C reached this process: pass it to every job still running (a job stops at its case
    boundary and writes its partial report) and give them 30 s to do so."""
    import signal
    import subprocess

    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass


def _check_jobs(procs, jobs: Path) -> None:
    """Stop with exit 2 when a job refused its work (a usage or environment error, e.g. a
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


def _print_failing(kern: str, records: list[dict]) -> None:
    """The failing cases with their reasons and reproducers, on stdout: cases failing for the
    same reason as one entry (its first case, "(xN cases)"), up to ``SHOW_FAILING`` entries."""
    from audits.engine.evaluate import FAILING
    from audits.report.build import collapse_reasons

    bad = collapse_reasons([r for r in records if r["verdict"] in FAILING])
    for r, n in bad[:SHOW_FAILING]:
        also = f" (x{n} cases; the others in the report)" if n > 1 else ""
        print(f"  {r['verdict'].upper()} {r['case']}{also}\n    why: {'; '.join(x for x in r['reasons'] if x)}")
        print(f"    reproduce: {r['repro']}")
    if len(bad) > SHOW_FAILING:
        more = sum(n for _, n in bad[SHOW_FAILING:])
        print(f"  ... and {more} more failing cases ({len(bad) - SHOW_FAILING} other reasons) in the report")


def _run_header(args, device, th) -> dict:
    """What every report of this run records besides its cases (command, time, environment,
    thresholds), fixed before the first case: the journals' headers keep it too, so that a
    journal read directly (``show``/``gate``/``summary`` on journal.jsonl) gives the report's view."""
    import json
    import time

    from audits.engine.journal import package_version

    env = {**_environment(device), "fa4_audit": package_version()}  # merge refuses shards of other versions
    report = {
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "command": "fa4-audit " + " ".join(shlex.quote(a) for a in args.argv),
        "device": str(device),
        "environment": env,
        "thresholds": th,
        "shard": args.shard,
    }
    report = json.loads(json.dumps(report, default=str))  # as a journal line holds it (a TOML date as text)
    return {"started": time.monotonic(), "report": report}


def _coverage_bases(args: argparse.Namespace, kernels: list[str]) -> dict[str, dict]:
    """Each kernel's coverage basis (``audits.verdict.coverage``): its declared domain narrowed by the
    ``--domain`` file, and its architecture (``fn.fa4_audit_arch``).  With
    ``--require-coverage``, a section that cannot be judged for a kernel (head dims unrestricted,
    no architecture) is a usage error before any case runs, naming the kernel and what to declare."""
    from audits.kernels import get_kernel
    from audits.suites.selection import kernels_domains
    from audits.verdict.coverage import arch_of, unjudgeable

    own = kernels_domains(kernels, args.domain)[1]
    bases = {}
    for kern in kernels:
        try:
            bases[kern] = {"domain": own[kern], "arch": arch_of(get_kernel(kern))}
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
    if args.require_coverage:
        why = [f"{k}: {w}" for k, b in bases.items() for w in unjudgeable(require=args.require_coverage, **b)]
        if why:
            raise UsageError(f"--require-coverage {args.require_coverage} cannot be judged: " + "; ".join(why))
    return bases


def _kept_bases(bases: dict[str, dict]) -> dict[str, dict]:
    """The coverage bases as the journal's header keeps them (a report read from the journal
    computes its coverage on them: ``audits.report.build.report_from_journal``)."""
    return {k: {"domain": b["domain"].as_dict(), "arch": b["arch"]} for k, b in bases.items()}


def _require_coverage(args: argparse.Namespace, kern: str, rep: dict) -> bool:
    """``--require-coverage``: what the report's coverage missed of the sections required, into
    the coverage (``required``) and on stdout; whether the requirement was met."""
    from audits.verdict.coverage import missed

    gone = missed(rep["coverage"], require=args.require_coverage)
    rep["coverage"]["required"] = {"require": args.require_coverage, "missed": gone, "met": not gone}
    if gone:
        print(f"{kern}: --require-coverage {args.require_coverage}: the run missed {len(gone)} item(s):")
        for line in gone:
            print(f"  missed {line}")
    return not gone


#: what a run that stopped early says on stderr, by ``stopped`` reason
_STOP_ADVICE = {
    "interrupted": "interrupted (Ctrl-C)",
    "budget": "the --budget of {budget:g} minutes was spent (no case starts after it)",
    "exitfirst": "-x: stopped at the first failing case",
    "unfinished": "cases did not finish (see OUT/jobs/*/log.txt)",
}


def _report_runs(args, runs, cases, label, th, device, header: dict, stopped: str | None) -> int:
    """Write each kernel's report (partial when cases were not run: ``stopped`` says why),
    print its verdicts and failing cases; the exit code (``report.exit_code``; 130 for an
    interrupted run in which nothing failed)."""
    from audits.engine.evaluate import kernel_dir
    from audits.report.build import build_report, exit_code, summary_line, write_report
    from audits.verdict.coverage import coverage_summary

    code = 0
    for kern, records in runs.items():
        missing = len(cases) - len(records)
        rep = build_report(
            kernel=kern,
            suite=label,
            seed=args.seed,
            records=records,
            selected=len(cases),
            stopped=(stopped or "unfinished") if missing else None,
            coverage_basis=header["coverage"][kern],
            backward=args.backward,
            **header["report"],
        )
        if getattr(args, "shard_order", None):
            rep["shard_order"] = {r["case"]: args.shard_order[r["case"]] for r in records}
        if getattr(args, "domain_info", None):
            rep["domain"] = args.domain_info  # the domain the suite was built in, its coverage
        met = _require_coverage(args, kern, rep) if args.require_coverage else True
        out = kernel_dir(args.out, kern, len(runs) > 1)
        paths = write_report(rep, out, maps=args.maps)
        print(f"{kern}: {summary_line(rep)}; report: {paths['md']}")
        print(f"{kern}: coverage: {coverage_summary(rep['coverage'])} (fa4-audit coverage {shlex.quote(str(out))})")
        _print_failing(kern, records)
        kcode = exit_code(rep)
        code = max(code, EXIT_FAIL if not met and kcode in (0, EXIT_INCOMPLETE) else kcode)
        if not rep["summary"]["evaluated"] and not missing:
            print(f"{kern}: nothing was audited: no case was compared with the reference", file=sys.stderr)
        if missing:
            why = _STOP_ADVICE[rep["summary"]["stopped"]].format(budget=args.budget or 0)
            print(
                f"{kern}: {why}: {len(records)} of {len(cases)} selected cases run, {missing} not run "
                "(not checked); the report is partial. --resume continues the run",
                file=sys.stderr,
            )
    if stopped == "interrupted" and code != 1:
        return EXIT_INTERRUPTED
    return code


def cmd_run(args: argparse.Namespace) -> int:
    from audits.common import finishing
    from audits.verdict.gate import ThresholdsError, load_thresholds

    if args.jobs < 1:
        raise UsageError(f"--jobs {args.jobs}: expected a positive number of processes")
    if args.maps < 0:
        raise UsageError(f"--maps {args.maps}: expected a count of error maps to render (0: none)")
    if args.jobs > 1 and args.shard:
        raise UsageError("--jobs and --shard cannot be combined: --jobs N already runs N key shards")
    if args.gpus is not None:
        if args.jobs < 2:
            raise UsageError(f"--gpus {args.gpus}: it pins the processes of --jobs N (N >= 2) to GPUs; add --jobs")
        gpu_list(args.gpus)  # a malformed list is a usage error before anything starts
    if args.resume and args.overwrite:
        raise UsageError("--resume continues the run in OUT, --overwrite replaces it: pass one of them")
    if args.budget is not None and not 0 < args.budget < float("inf"):
        raise UsageError(f"--budget {args.budget:g}: expected a positive number of minutes")
    kernels = usable_kernels(args.kernel)
    cases, label = _select_cases(args)
    label = args.label or label
    try:
        th = load_thresholds(args.thresholds)
    except ThresholdsError as exc:
        raise UsageError(str(exc)) from exc
    _check_backward_args(args, th)
    bases = _coverage_bases(args, kernels)
    device = _device(args.device)
    _prepare_out(args)
    header, stopped = {**_run_header(args, device, th), "coverage": bases}, {}
    if args.jobs > 1:
        runs = _run_jobs(args, kernels, cases, label, stopped)
    else:
        runs = _run_here(args, kernels, cases, label, th, device, header, stopped)
    with finishing("the report"):  # every case run is in the report, even when Ctrl-C comes now
        return _report_runs(args, runs, cases, label, th, device, header, stopped.get("reason"))


def register(sub) -> None:
    """Add ``run`` to the ``fa4-audit`` parser."""
    from audits.engine.worker import RUN_DEFAULT_NOTE, add_timeout_argument
    from audits.report.maps import DEFAULT_MAPS
    from audits.suites.selection import add_case_arguments
    from audits.verdict.coverage import REQUIRE

    r = sub.add_parser(
        "run",
        help="audit a kernel on a suite or given cases: FP64 reference, metrics, bounds, verdicts, report",
        description="Run every case of a suite (or of --config / --case-file) for a kernel; write "
        "OUT/report.{json,md,html,junit.xml} (OUT/<kernel>/report.* with several --kernel); print the verdicts "
        "and the failing cases with their reproducers.  Exit 0 when every case passes, 1 when any fails, errors, "
        "crashes or times out (--timeout) or none was evaluated, 2 for usage and environment errors.",
    )
    r.add_argument(
        "--kernel",
        required=True,
        action="append",
        help="fa4, fa4-model, fa4-model-sm90, fa4-model-sm90-tc, sdpa-math, sdpa-flash, sdpa-efficient, sdpa-cudnn, "
        "module:attr or path/to/file.py:fn; repeat to audit several kernels on shared inputs and references",
    )
    add_case_arguments(r, default_suite="smoke")
    r.add_argument("--label", default=None, help=argparse.SUPPRESS)  # the parent's label, for --jobs children
    r.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the kernels run (default cpu)")
    r.add_argument("--out", default="reports/run-latest", help="report directory (default reports/run-latest)")
    r.add_argument(
        "--maps",
        type=int,
        default=DEFAULT_MAPS,
        metavar="N",
        help=f"render error maps of the N worst failing cases as OUT/maps/CASE.png and .svg, shown in report.html "
        f"(default {DEFAULT_MAPS}; 0: none; the map data is saved for every failing case)",
    )
    r.add_argument("--thresholds", default=None, help="thresholds TOML (default: audits/verdict/thresholds.toml)")
    r.add_argument("--resume", action="store_true", help="continue the run in OUT (refused if OUT holds another run)")
    r.add_argument("--overwrite", action="store_true", help="replace the run OUT holds (default: refuse, exit 2)")
    r.add_argument(
        "-x",
        "--exitfirst",
        action="store_true",
        help="stop at the first failing case (the report is partial: it says how many cases were selected and not run)",
    )
    r.add_argument(
        "--budget",
        type=float,
        default=None,
        metavar="MINUTES",
        help="stop cleanly once MINUTES have passed: no case starts after it; the report is partial (selected / run "
        "/ not-run counts), exit 1 if a case failed, else 3 (incomplete, never a pass); --resume continues. Cases "
        "run in a stratified order, so the cases run span the suite's axes",
    )
    r.add_argument(
        "--shard",
        default=None,
        help="I/N: run a deterministic, balanced 1/N slice; auto: I and N from a Slurm array task "
        "(SLURM_ARRAY_TASK_ID, _MIN, _COUNT or _MAX) or a Kubernetes Indexed Job (JOB_COMPLETION_INDEX with "
        "--shards N or FA4_AUDIT_SHARDS)",
    )
    r.add_argument("--shards", type=int, default=None, help="N: the shard count for --shard auto (Kubernetes)")
    r.add_argument(
        "--shard-by",
        default="cost",
        choices=["cost", "key"],
        help="balance shards by case cost, or keep compile-key groups whole (default cost)",
    )
    r.add_argument("--jobs", type=int, default=1, help="N parallel processes, one compile-key shard each")
    r.add_argument(
        "--gpus",
        default=None,
        help="with --jobs on CUDA: the GPUs the jobs are pinned to, job I on GPU I mod G, e.g. 0,1 "
        "(default: all visible)",
    )
    r.add_argument(
        "--isolate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the kernel in a worker process so that a crash is one case's verdict "
        "(default: on for fa4 and user kernels, off for the built-in model and SDPA; on for every kernel with "
        "--timeout)",
    )
    add_timeout_argument(r, note=RUN_DEFAULT_NOTE)
    r.add_argument(
        "--quiet",
        action="store_true",
        help="no progress on stderr (default: a bar on a terminal, else a line every 30 s and at each tenth)",
    )
    r.add_argument(
        "--backward",
        action="store_true",
        help="audit the gradients too: a seeded dO per case, dq/dk/dv (and dsink) by torch.autograd.grad against "
        "FP64 gradients, the backward bound and FA's backward criterion",
    )
    r.add_argument(
        "--repeat",
        type=int,
        default=None,
        help="with --backward: backward runs per case on the same inputs (default 2); reports the elements that "
        "differ run to run",
    )
    r.add_argument(
        "--deterministic",
        action="store_true",
        help="with --backward: pass deterministic=True to kernels that take it and fail any run-to-run difference",
    )
    r.add_argument(
        "--require-coverage",
        default=None,
        choices=REQUIRE,
        help="after writing the report, exit 1 when the run missed any head dim the kernel's domain accepts "
        "(head_dims), any code-path class of its architecture (classes), or either (all), in the forward and, with "
        "--backward, the backward (docs/runner.md, 'Coverage'); exit 2 up front when the kernel declares no head dims "
        "or no architecture to judge",
    )
    r.add_argument(
        "--per-sequence",
        action="store_true",
        help="audit a fixed-length kernel on varlen cases (docs/varlen.md) one sequence at a time: a batch-1 call per "
        "sequence on its rows and used keys (without it, such a kernel skips varlen cases; kernels with a varlen "
        "entry, fn.fa4_audit_contract = 'varlen', run them through it either way)",
    )
    r.set_defaults(func=cmd_run)
