"""``fa4-audit run`` and the commands that read its reports: gate, show, diff, merge, summary, list, fuzz."""

from __future__ import annotations

import argparse
import datetime as _dt
import shlex
import sys

from audits.common import EXIT_FAIL, EXIT_OK, UsageError, atomic_write
from audits.common import device as _device
from audits.common import environment as _environment


def cmd_run(args: argparse.Namespace) -> int:
    import dataclasses
    import fnmatch

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from audits.cases import suite
    from audits.kernels import get_kernel
    from audits.runner.engine import kernel_dir, run_suites, shard_cases
    from audits.runner.gate import ThresholdsError, load_thresholds
    from audits.runner.report import build_report, exit_code, write_report

    kernels = list(dict.fromkeys(args.kernel))
    for kern in kernels:
        try:
            get_kernel(kern)
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
    try:
        cases = suite(args.suite)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    try:
        th = load_thresholds(args.thresholds)
    except ThresholdsError as exc:
        raise UsageError(str(exc)) from exc
    device = _device(args.device)
    isolate = args.isolate if args.isolate is not None else (lambda kern: kern == "fa4" or ":" in kern)
    if args.seed:
        cases = [dataclasses.replace(c, seed=c.seed + args.seed) for c in cases]
    if args.case:
        cases = [c for c in cases if fnmatch.fnmatch(c.name, args.case)]
        if not cases:
            raise UsageError(f"--case {args.case!r} matches no case of suite {args.suite!r}")
    shard = None
    if args.shard:
        try:
            i, n = (int(x) for x in args.shard.split("/"))
            cases = shard_cases(cases, i, n, by=args.shard_by)
        except ValueError as exc:
            raise UsageError(f"--shard {args.shard!r}: expected I/N with 0 <= I < N ({exc})") from exc
        shard = args.shard
    if args.jobs < 1:
        raise UsageError(f"--jobs {args.jobs}: expected a positive number of processes")
    if args.jobs > 1 and args.shard:
        raise UsageError(
            "--jobs and --shard cannot be combined: --jobs N already runs N key shards (--shard I/N --shard-by key)"
        )
    console = Console(stderr=True)
    if args.jobs > 1:
        runs = _run_jobs(args, kernels, cases, console)
        shard = None
    else:
        runs = None

    def repro(kern, c):
        base = f"fa4-audit run --kernel {shlex.quote(kern)} --suite {args.suite} --device {args.device}"
        return f"{base} --case {shlex.quote(c.name)}" + (f" --seed {args.seed}" if args.seed else "")

    if runs is None:
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            disable=args.quiet,
        ) as bar:
            task = bar.add_task(f"{', '.join(kernels)} / {args.suite}", total=len(cases) * len(kernels))
            runs = run_suites(
                kernels,
                cases,
                device=device,
                out_dir=args.out,
                thresholds=th,
                resume=args.resume,
                exitfirst=args.exitfirst,
                isolate=isolate,
                repro_cmd=repro,
                progress=lambda kern, r: bar.advance(task),
            )
    env = _environment(device)
    created = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    command = "fa4-audit " + " ".join(shlex.quote(a) for a in args.argv)
    code = 0
    for kern, records in runs.items():
        rep = build_report(
            kernel=kern,
            suite=args.suite,
            seed=args.seed,
            device=str(device),
            environment=env,
            thresholds=th,
            records=records,
            command=command,
            created=created,
            shard=shard,
        )
        paths = write_report(rep, kernel_dir(args.out, kern, len(kernels) > 1))
        v = rep["summary"]["verdicts"]
        console.print(
            f"{kern}: "
            + ", ".join(f"{k} {n}" for k, n in v.items() if n)
            + f" of {len(records)} cases; report: {paths['md']}"
        )
        code = max(code, exit_code(rep))
        missing = len(cases) - len(records)
        if missing and not args.exitfirst:
            console.print(
                f"{kern}: {missing} of {len(cases)} cases did not finish (see OUT/jobs/*/log.txt); rerun with --resume to complete them"
            )
            code = max(code, 1)
    return code


def _run_jobs(args: argparse.Namespace, kernels: list[str], cases: list, console) -> dict[str, list[dict]]:
    """``run --jobs N``: N child processes ``run --shard I/N --shard-by key`` (each compiles
    only its own compile keys, so JIT compilation runs N-wide), journals under OUT/jobs/I/,
    logs in OUT/jobs/I/log.txt; returns each kernel's finished records in suite order."""
    import os
    import subprocess
    import time
    from pathlib import Path

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from audits.runner.engine import kernel_dir, read_journal

    n = args.jobs
    argv = [a for k in kernels for a in ("--kernel", k)] + [
        "--suite",
        args.suite,
        "--device",
        args.device,
        "--seed",
        str(args.seed),
        "--quiet",
    ]
    argv += ["--thresholds", args.thresholds] if args.thresholds else []
    argv += ["--case", args.case] if args.case else []
    argv += ["--resume"] if args.resume else []
    argv += ["-x"] if args.exitfirst else []
    argv += [] if args.isolate is None else (["--isolate"] if args.isolate else ["--no-isolate"])
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))
    jobs = Path(args.out) / "jobs"
    several = len(kernels) > 1
    journals = [kernel_dir(jobs / str(i), k, several) / "journal.jsonl" for i in range(n) for k in kernels]
    procs = []
    try:
        for i in range(n):
            d = jobs / str(i)
            d.mkdir(parents=True, exist_ok=True)
            log = open(d / "log.txt", "a")
            cmd = [
                sys.executable,
                "-m",
                "audits",
                "run",
                *argv,
                "--shard",
                f"{i}/{n}",
                "--shard-by",
                "key",
                "--out",
                str(d),
            ]
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
            log.close()
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            disable=args.quiet,
        ) as bar:
            task = bar.add_task(f"{', '.join(kernels)} / {args.suite} ({n} jobs)", total=len(cases) * len(kernels))
            while any(p.poll() is None for p in procs):
                time.sleep(1.0)
                bar.update(task, completed=sum(sum(1 for _ in open(j)) for j in journals if j.exists()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
    for i, p in enumerate(procs):
        if p.returncode not in (0, 1):
            console.print(f"job {i} exited with code {p.returncode}; see {jobs / str(i) / 'log.txt'}")
    order = {c.name: i for i, c in enumerate(cases)}
    runs = {}
    for k in kernels:
        recs = {}
        for i in range(n):
            recs.update(read_journal(kernel_dir(jobs / str(i), k, several) / "journal.jsonl"))
        runs[k] = sorted((r for r in recs.values() if r["case"] in order), key=lambda r: order[r["case"]])
    return runs


def _load_report(path: str) -> dict:
    import json
    from pathlib import Path

    try:
        raw = Path(path).read_bytes()
        if path.endswith(".gz"):  # committed reports are kept compressed
            import gzip

            raw = gzip.decompress(raw)
        elif path.endswith(".xz"):
            import lzma

            raw = lzma.decompress(raw)
        rep = json.loads(raw)
    except FileNotFoundError as exc:
        raise UsageError(f"{path}: no such report") from exc
    except json.JSONDecodeError as exc:
        raise UsageError(f"{path}: not JSON ({exc})") from exc
    if rep.get("schema") != "fa4-audit/report/1":
        raise UsageError(f"{path}: schema {rep.get('schema')!r} is not fa4-audit/report/1")
    return rep


def _summarize(rep: dict) -> dict:
    from audits.runner.report import build_report

    return build_report(
        kernel=rep["kernel"],
        suite=rep["suite"],
        seed=rep["seed"],
        device=rep["device"],
        environment=rep["environment"],
        thresholds=rep["thresholds"],
        records=rep["cases"],
        command=rep["command"],
        created=rep["created"],
        shard=rep.get("shard"),
    )


def cmd_gate(args: argparse.Namespace) -> int:
    from audits.runner.gate import ThresholdsError, load_thresholds, rejudge
    from audits.runner.report import exit_code

    rep = _load_report(args.report)
    try:
        th = load_thresholds(args.thresholds)
    except ThresholdsError as exc:
        raise UsageError(str(exc)) from exc
    base = _load_report(args.baseline) if args.baseline else None
    new = _summarize(rejudge(rep, th, base))
    for c in new["cases"]:
        if c["verdict"] in ("fail", "error", "crash"):
            print(f"{c['verdict'].upper():6s} {c['case']}: {'; '.join(c['reasons'])}")
    v = new["summary"]["verdicts"]
    print(
        ", ".join(f"{k} {n}" for k, n in v.items() if n)
        + f" of {new['summary']['cases']} cases under {th['path']}"
        + (f" against {args.baseline}" if base else "")
    )
    if args.out:
        from audits.runner.report import write_report

        new["command"] = f"{new['command']}; re-judged: fa4-audit " + " ".join(args.argv)
        print(f"re-judged report: {write_report(new, args.out)['md']}")
    return exit_code(new)


def cmd_show(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from audits.runner.report import case_cells

    rep = _load_report(args.report)
    t = Table(title=f"{rep['kernel']} / {rep['suite']} ({rep['created']})")
    for col in ("case", "verdict", "max abs err", "LSE err", "err/bound", "reasons"):
        t.add_column(col)
    for r in rep["cases"]:
        c = case_cells(r)
        t.add_row(r["case"], r["verdict"], c["max_abs"], c["lse"], c["tightness"], c["reasons"])
    Console().print(t)
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    a, b = _load_report(args.base), _load_report(args.cand)
    ca, cb = {c["case"]: c for c in a["cases"]}, {c["case"]: c for c in b["cases"]}
    changed = 0
    for name in sorted(set(ca) | set(cb)):
        x, y = ca.get(name), cb.get(name)
        if x is None or y is None:
            print(f"{'only in cand' if x is None else 'only in base'}: {name}")
            changed += 1
            continue
        ex, ey = (x.get("out") or {}).get("max_abs"), (y.get("out") or {}).get("max_abs")
        moved = ex is not None and ey is not None and (ex != ey)
        if x["verdict"] != y["verdict"] or moved:
            changed += 1
            err = f"max |err| {ex:.3g} -> {ey:.3g}" if moved else ""
            print(f"{name}: {x['verdict']} -> {y['verdict']} {err}")
    print(f"{changed} of {len(set(ca) | set(cb))} cases differ")
    return 0


def cmd_merge(args: argparse.Namespace) -> int:
    from audits.runner.report import exit_code, write_report

    reps = [_load_report(p) for p in args.reports]
    keys = {(r["kernel"], r["suite"], r["seed"]) for r in reps}
    if len(keys) != 1:
        raise UsageError(f"shard reports must share kernel, suite and seed; got {sorted(keys)}")
    seen, cases = set(), []
    for r in reps:
        for c in r["cases"]:
            if c["case"] in seen:
                raise UsageError(f"case {c['case']} appears in two shard reports")
            seen.add(c["case"])
            cases.append(c)
    merged = _summarize(
        {
            **reps[0],
            "cases": cases,
            "shard": None,
            "command": "fa4-audit " + " ".join(shlex.quote(a) for a in args.argv),
        }
    )
    paths = write_report(merged, args.out)
    print(f"merged {len(reps)} reports, {len(cases)} cases: {paths['md']}")
    return exit_code(merged)


def cmd_summary(args: argparse.Namespace) -> int:
    from pathlib import Path

    from audits.runner.summary import plot_errors, summary_markdown

    reps = [_load_report(p) for p in args.reports]
    by = tuple(b.strip() for b in args.by.split(",") if b.strip())
    known = {"mask", "heads", "dtype", "d", "dv", "softcap", "sink", "layout", "family", "seqlen_k", "seqlen_q"}
    if not by or set(by) - known:
        raise UsageError(f"--by {args.by!r}: expected a comma-separated list of {', '.join(sorted(known))}")
    text = summary_markdown(reps, by)
    print(text, end="")
    if args.out:
        out = Path(args.out)
        atomic_write(out / "summary.md", text)
        plot_errors(reps, out / "summary.svg")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from audits.cases import SUITES
    from audits.inputs import FAMILIES
    from audits.kernels import KERNELS

    print("kernels: " + ", ".join(KERNELS) + ", or module:attr")
    print("suites:")
    for name, make in SUITES.items():
        cases = make()
        print(f"  {name:8s} {len(cases):5d} cases, {len({c.compile_key for c in cases}):3d} compile keys")
    print("input families:")
    for name, fam in FAMILIES.items():
        print(f"  {name:18s} {fam.hunts}")
    return 0


def cmd_fuzz(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from audits.kernels import get_kernel
    from audits.runner.fuzz import fuzz
    from audits.runner.gate import ThresholdsError, load_thresholds

    try:
        get_kernel(args.kernel)
        th = load_thresholds(args.thresholds)
    except (ValueError, ThresholdsError) as exc:
        raise UsageError(str(exc)) from exc
    if args.budget <= 0 or args.max_seqlen <= 0:
        raise UsageError(f"--budget and --max-seqlen must be positive, got {args.budget}, {args.max_seqlen}")
    device = _device(args.device)
    res = fuzz(
        args.kernel,
        budget=args.budget,
        device=device,
        thresholds=th,
        database=args.database,
        max_seqlen=args.max_seqlen,
        seed=args.seed,
    )
    atomic_write(Path(args.out) / "fuzz.json", json.dumps(res, indent=1) + "\n")
    print(f"{res['examples']} examples; largest error/bound {res['best_tightness']} ({res['best_case']})")
    if res["failure"]:
        f = res["failure"]
        print(f"FAILING (shrunk): {f['name']}: {f['verdict']}: {'; '.join(f['reasons'])}\nreproduce: {f['repro']}")
        return EXIT_FAIL
    return EXIT_OK


def register(sub) -> None:
    """Add this audit's subcommands to the ``fa4-audit`` parser."""
    r = sub.add_parser(
        "run",
        help="audit a kernel on a suite: FP64 reference, metrics, bounds, verdicts, report",
        description="Run every case of a suite for a kernel; write OUT/report.{json,md,html,junit.xml} "
        "(OUT/<kernel>/report.* with several --kernel).  "
        "Exit 0 when every case passes, 1 when any fails, errors or crashes or none could run, 2 for usage errors.",
    )
    r.add_argument(
        "--kernel",
        required=True,
        action="append",
        help="fa4, fa4-model, fa4-model-sm90, sdpa-math, sdpa-flash, sdpa-efficient, sdpa-cudnn, or module:attr; "
        "repeat to audit several kernels on shared inputs and references (one OUT/<kernel>/ report each)",
    )
    r.add_argument("--suite", default="smoke", help="suite name (default smoke)")
    r.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    r.add_argument("--seed", type=int, default=0, help="added to every case's seed (default 0)")
    r.add_argument("--out", default="reports/run-latest", help="report directory (default reports/run-latest)")
    r.add_argument("--thresholds", default=None, help="thresholds TOML (default: the shipped audits/thresholds.toml)")
    r.add_argument(
        "--resume", action="store_true", help="continue from OUT/journal.jsonl without redoing finished cases"
    )
    r.add_argument("-x", "--exitfirst", action="store_true", help="stop at the first failing case")
    r.add_argument("--shard", default=None, help="I/N: run a deterministic, balanced 1/N slice")
    r.add_argument(
        "--shard-by",
        default="cost",
        choices=["cost", "key"],
        help="balance shards by case cost, or keep compile-key groups whole (default cost)",
    )
    r.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="N parallel processes, one compile-key shard each (GPU audits: compilation dominates); reports as one run",
    )
    r.add_argument("--case", default=None, help="glob over case names (e.g. a reproducer's name)")
    r.add_argument(
        "--isolate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the kernel in a worker process so that a crash is one case's verdict "
        "(default: on for fa4 and module:attr kernels, off for the built-in model and SDPA)",
    )
    r.add_argument("--quiet", action="store_true")
    r.set_defaults(func=cmd_run)
    g = sub.add_parser("gate", help="re-judge a report under thresholds (and against a baseline report)")
    g.add_argument("report")
    g.add_argument("--thresholds", default=None)
    g.add_argument(
        "--baseline",
        default=None,
        help="BASE.json: fail cases worse than the baseline by more than [baseline] max_ratio",
    )
    g.add_argument(
        "--out", default=None, help="also write the re-judged report (json, md, html, junit) into this directory"
    )
    g.set_defaults(func=cmd_gate)
    sh = sub.add_parser("show", help="print a report as a table")
    sh.add_argument("report")
    sh.set_defaults(func=cmd_show)
    df = sub.add_parser("diff", help="where two reports differ (verdicts, max errors)")
    df.add_argument("base")
    df.add_argument("cand")
    df.set_defaults(func=cmd_diff)
    mg = sub.add_parser("merge", help="combine shard reports (run --shard I/N) into one")
    mg.add_argument("reports", nargs="+")
    mg.add_argument("--out", required=True)
    mg.set_defaults(func=cmd_merge)
    fz = sub.add_parser("fuzz", help="Hypothesis search for a failing case, climbing toward the largest error/bound")
    fz.add_argument("--kernel", required=True)
    fz.add_argument("--budget", type=int, default=200, help="examples to try (default 200)")
    fz.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    fz.add_argument("--max-seqlen", type=int, default=512)
    fz.add_argument(
        "--database", default=".hypothesis/fa4-audit", help="Hypothesis example database (kept between runs)"
    )
    fz.add_argument("--thresholds", default=None)
    fz.add_argument(
        "--seed", type=int, default=None, help="a fixed search (Hypothesis then neither reads nor writes the database)"
    )
    fz.add_argument("--out", default="reports/fuzz-latest")
    fz.set_defaults(func=cmd_fuzz)
    ls = sub.add_parser("list", help="kernels, suites (case and compile-key counts) and input families")
    ls.set_defaults(func=cmd_list)
    sm = sub.add_parser("summary", help="several kernels' reports side by side, per configuration group")
    sm.add_argument("reports", nargs="+", help="report.json (or .json.gz) files, one per kernel")
    sm.add_argument(
        "--by", default="dtype,mask", help="grouping: comma-separated Case fields, mask or heads (default dtype,mask)"
    )
    sm.add_argument("--out", default=None, help="also write OUT/summary.md and OUT/summary.svg")
    sm.set_defaults(func=cmd_summary)
