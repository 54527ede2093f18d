"""``fa4-audit run``: a kernel (or several) on a suite, a case file or given cases; one report
per kernel; results on stdout, progress on stderr.  The commands that read reports are in
``audits.cli.reports``."""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
import time
from pathlib import Path

import torch
from rich.console import Console

from audits.api import Report, RunOptions, audit
from audits.cli.options import add_case_arguments, selection_from_args
from audits.cli.run_options import RUN_DEFAULT_NOTE, add_known_arguments, add_timeout_argument, run_options_from_args
from audits.common import EXIT_FAIL, EXIT_INCOMPLETE, EXIT_INTERRUPTED, UsageError, finishing, gpu_list, progress
from audits.common import device as _device
from audits.engine.journal import JournalMismatch
from audits.engine.run import kernel_dir
from audits.engine.shards import ShardEnvError, parse_shard, shard_cases, shard_from_env
from audits.engine.stop import StopReason
from audits.kernels import get_kernel, usable_kernels
from audits.report.build import collapse_reasons, exit_code, summary_line, write_report
from audits.report.header import report_header
from audits.report.maps import DEFAULT_MAPS
from audits.report.schema import FAILING
from audits.verdict.coverage import REQUIRE, arch_of, coverage_summary, missed, unjudgeable
from audits.verdict.gate import ThresholdsError, load_thresholds, require_backward
from audits.verdict.known import known_lines
from audits.verdict.separators import cause_groups, cause_lines, cause_text

#: what a run writes into OUT (and OUT/<kernel>/ with several kernels); --overwrite removes
#: exactly these, nothing else a user keeps there
RUN_FILES = (
    "report.json", "report.md", "report.html", "report.junit.xml", "journal.jsonl",
    "compare.json", "compare.md", "compare.html",
)  # fmt: skip
RUN_DIRS = ("repro", "jobs")
#: failing cases listed (with their reproducers) at the end of a failing run
SHOW_FAILING = 10


def _select_cases(args: argparse.Namespace) -> tuple[list, str]:
    """(cases, label): the shared selection (``audits.suites.selection``: suite, given cases, domain,
    --seed, --case), then run's own --shard."""
    sel = selection_from_args(args, kernels=args.kernel)
    cases, label = sel.cases, sel.label
    if sel.domain_info is not None:
        args.domain_info = sel.domain_info  # the domain the suite was built in, for the report
    args.kernel_domains = sel.kernel_domains  # each kernel's declared domain, resolved once for the run
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


def audit_run(kernels: list[str], cases: list, options: RunOptions, header: dict) -> Report:
    """The run (``audits.api.audit``: in this process, or with ``--jobs`` in its children) under a
    progress bar on stderr; ``--resume`` onto another run's journal is a usage error."""
    failing = [0]

    def tick(kern: str, rec: dict) -> None:
        failing[0] += rec["verdict"] in FAILING
        bar.update(task, advance=1, failing=failing[0])

    label = f"{', '.join(kernels)} / {options.label}" + (f" ({options.jobs} jobs)" if options.jobs > 1 else "")
    with progress(Console(stderr=True), quiet=options.quiet) as bar:
        task = bar.add_task(label, total=len(cases) * len(kernels), failing=0)
        try:
            return audit(
                kernels,
                cases,
                options,
                header=header["report"],
                coverage=header["coverage"],
                progress=tick,
                started=header["started"],
            )
        except JournalMismatch as exc:
            raise UsageError(f"--resume refused: {exc}") from exc


def _check_backward_args(args: argparse.Namespace, th: dict) -> None:
    """--repeat and --deterministic need --backward; --backward needs [backward] thresholds."""
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


def _print_failing(kern: str, records: list[dict]) -> None:
    """The failing cases with their reasons and reproducers, on stdout: cases failing for the
    same reason as one entry (its first case, "(xN cases)"), up to ``SHOW_FAILING`` entries."""
    bad = collapse_reasons([r for r in records if r["verdict"] in FAILING])
    for r, n in bad[:SHOW_FAILING]:
        also = f" (x{n} cases; the others in the report)" if n > 1 else ""
        print(f"  {r['verdict'].upper()} {r['case']}{also}")
        lines = cause_lines(r)
        # the best tested cause first (report.md lists them all); with none, what each poisoned
        # re-run showed (forward and backward: a backward failure's answer is the backward's)
        for line in lines if lines and lines[0].startswith("poisoned (") else lines[:1]:
            print(f"    {line}")
        print(f"    why: {'; '.join(x for x in r['reasons'] if x)}")
        print(f"    reproduce: {r['repro']}")
    if len(bad) > SHOW_FAILING:
        more = sum(n for _, n in bad[SHOW_FAILING:])
        print(f"  ... and {more} more failing cases ({len(bad) - SHOW_FAILING} other reasons) in the report")
    if sum(n for _, n in bad) > 1 and (tally := cause_text(cause_groups(records))):
        print(f"  {tally}")  # the causes over every failing case, as the report's views say it


def _run_header(args: argparse.Namespace, device: torch.device) -> dict:
    """What every report of this run records besides its cases (``report``: created, command,
    environment with this package's version, which merge compares), fixed before the first case,
    and when it ``started`` (``--budget`` counts from it): the journals' headers keep it too, so
    that a journal read directly (``show``/``gate``/``summary`` on journal.jsonl) gives the report's view."""
    return {"started": time.monotonic(), "report": report_header(args.argv, device=device)}


def _coverage_bases(args: argparse.Namespace, kernels: list[str]) -> dict[str, dict]:
    """Each kernel's coverage basis (``audits.verdict.coverage``): its declared domain narrowed by the
    ``--domain`` file, and its architecture (``fn.fa4_audit_arch``).  With
    ``--require-coverage``, a section that cannot be judged for a kernel (head dims unrestricted,
    no architecture) is a usage error before any case runs, naming the kernel and what to declare."""
    own = args.kernel_domains  # narrowed by the --domain file, resolved once by the case selection
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


def _require_coverage(args: argparse.Namespace, kern: str, rep: dict) -> bool:
    """``--require-coverage``: what the report's coverage missed of the sections required, into
    the coverage (``required``) and on stdout; whether the requirement was met."""
    gone = missed(rep["coverage"], require=args.require_coverage)
    rep["coverage"]["required"] = {"require": args.require_coverage, "missed": gone, "met": not gone}
    if gone:
        print(f"{kern}: --require-coverage {args.require_coverage}: the run missed {len(gone)} item(s):")
        for line in gone:
            print(f"  missed {line}")
    return not gone


#: what a run that stopped early says on stderr, by its ``StopReason``
_STOP_ADVICE = {
    StopReason.INTERRUPTED: "interrupted (Ctrl-C)",
    StopReason.BUDGET: "the --budget of {budget:g} minutes was spent (no case starts after it)",
    StopReason.EXITFIRST: "-x: stopped at the first failing case",
    StopReason.UNFINISHED: "cases did not finish (see OUT/jobs/*/log.txt)",
}


def report_runs(args: argparse.Namespace, report: Report) -> int:
    """Write each kernel's report (partial when cases were not run: ``report.stopped`` says why),
    print its verdicts and failing cases; the exit code (``report.exit_code``; 1 for a
    ``--require-coverage`` missed)."""
    code = 0
    several = len(report.reports) > 1
    for kern, rep in report.reports.items():
        records = rep["cases"]
        missing = report.selected - len(records)
        if getattr(args, "shard_order", None):
            rep["shard_order"] = {r["case"]: args.shard_order[r["case"]] for r in records}
        if getattr(args, "domain_info", None):
            rep["domain"] = args.domain_info  # the domain the suite was built in, its coverage
        met = _require_coverage(args, kern, rep) if args.require_coverage else True
        out = kernel_dir(args.out, kern, several)
        paths = write_report(rep, out, maps=args.maps)
        print(f"{kern}: {summary_line(rep)}; report: {paths['md']}")
        print(f"{kern}: coverage: {coverage_summary(rep['coverage'])} (fa4-audit coverage {shlex.quote(str(out))})")
        for line in known_lines(rep):  # --known: the known defects met, apart from the failures
            print(f"{kern}: {line}")
        _print_failing(kern, records)
        kcode = exit_code(rep)
        code = max(code, EXIT_FAIL if not met and kcode in (0, EXIT_INCOMPLETE) else kcode)
        if not rep["summary"]["evaluated"] and not missing:
            print(f"{kern}: nothing was audited: no case was compared with the reference", file=sys.stderr)
        if missing:
            why = _STOP_ADVICE[rep["summary"]["stopped"]].format(budget=args.budget or 0)
            print(
                f"{kern}: {why}: {len(records)} of {report.selected} selected cases run, {missing} not run "
                "(not checked); the report is partial. --resume continues the run",
                file=sys.stderr,
            )
    if report.stopped == StopReason.INTERRUPTED and code != 1:
        return EXIT_INTERRUPTED
    return code


def prepare_run(args: argparse.Namespace) -> tuple[list[str], list, RunOptions, dict]:
    """(kernels, cases, options, report header) of a ``run`` (or ``compare``) from its flags, OUT
    prepared; a ``UsageError`` (exit 2) for anything wrong before a case runs."""
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
    kernels = usable_kernels(args.kernel, domains=False)  # the case selection resolves them next
    cases, label = _select_cases(args)
    label = args.label or label
    try:
        th = load_thresholds(args.thresholds)
    except ThresholdsError as exc:
        raise UsageError(str(exc)) from exc
    _check_backward_args(args, th)
    options = run_options_from_args(args, thresholds=th, label=label)
    bases = _coverage_bases(args, kernels)
    device = _device(args.device)
    _prepare_out(args)
    header = {**_run_header(args, device), "coverage": bases}
    return kernels, cases, options, header


def cmd_run(args: argparse.Namespace) -> int:

    kernels, cases, options, header = prepare_run(args)
    report = audit_run(kernels, cases, options, header)
    with finishing("the report"):  # every case run is in the report, even when Ctrl-C comes now
        return report_runs(args, report)


def register(sub) -> None:
    """Add ``run`` to the ``fa4-audit`` parser."""
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
        "flex, a model variant MODEL:knob=value[,knob=value...] (e.g. fa4-model:poly_degree=5; fa4-audit list names "
        "the knobs), fa4@DIR (production from a release installed with pip install --no-deps --target DIR "
        "flash-attn-4==VERSION; runs in a worker), module:attr or path/to/file.py:fn; repeat to audit several kernels "
        "on shared inputs and references",
    )
    add_run_arguments(r)
    r.set_defaults(func=cmd_run)


def add_run_arguments(r: argparse.ArgumentParser) -> None:
    """Every flag of ``run`` but ``--kernel``: the case selection, where and how the cases run,
    the report (``compare`` takes the same)."""
    add_case_arguments(r, default_suite="smoke")
    r.add_argument("--label", default=None, help=argparse.SUPPRESS)  # the reports' suite label (hidden)
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
    add_known_arguments(r)
    r.add_argument(
        "--poison",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="re-run each failing case's kernel call with fresh memory filled with NaN, then a finite pattern, and "
        "name the result's dependence on memory the kernel never wrote (causes unwritten_output, uninitialized_read; "
        "docs/diagnosis.md, 'Poisoned runs'); a case the checks accept is re-run too where its result holds NaN, inf "
        "or 0 or its reference is non-finite, and fails where memory supplied them; default on",
    )
    r.add_argument(
        "--time-calls",
        action="store_true",
        help="call the kernel twice on each case and keep both calls' seconds and whether the second call's result "
        "has the same bits (the first call's excess is compilation and first use; compare sums them per kernel)",
    )
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
