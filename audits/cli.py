"""The ``fa4-audit`` command line (also ``python -m audits``).

Exit codes (DESIGN.md): 0 every check passed; 1 a check failed (a bound violated, a bit
mismatch with production); 2 a usage or configuration error (bad arguments, CUDA or the
production package missing where they are required), with a message saying what to do.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import platform
import shlex
import sys
from typing import Sequence

import torch

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """A problem with the command line or the environment: exit 2 with this message."""


def _environment(device: torch.device) -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        import numba

        env["numba"] = numba.__version__
    except ImportError:
        pass
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["compute_capability"] = "sm_%d%d" % torch.cuda.get_device_capability(device)
        try:
            from importlib.metadata import version

            env["flash-attn-4"] = version("flash-attn-4")
            env["nvidia-cutlass-dsl"] = version("nvidia-cutlass-dsl")
        except Exception:  # metadata absent when staged without dist-info
            pass
    else:
        env["cpu"] = platform.processor() or platform.machine()
        env["threads"] = torch.get_num_threads()
    return env


def _parse_degrees(text: str) -> list[int]:
    from fa4.ex2 import DEGREES

    if text == "all":
        return list(DEGREES)
    try:
        d = int(text)
    except ValueError:
        d = None
    if d not in DEGREES:
        raise UsageError(f"--degree {text!r} is not valid; accepted: {', '.join(map(str, DEGREES))} or 'all'")
    return [d]


def _device(name: str) -> torch.device:
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UsageError(
            "--device cuda was requested but torch sees no CUDA device "
            f"(torch {torch.__version__}); run on a GPU machine or use --device cpu"
        )
    return torch.device("cuda")


def _ptx_checks(degrees: list[int], arch: str, out: str, bar) -> list[dict]:
    """Compile production's scalar and packed exp2 for ``arch`` and check them (audits.ex2_ptx)."""
    import importlib.util
    from pathlib import Path

    from audits.ex2_ptx import check_ptx, compile_ptx

    missing = [m for m in ("cutlass", "flash_attn") if importlib.util.find_spec(m) is None]
    if missing:
        from fa4.production import INSTALL_HINT

        raise UsageError(f"--ptx needs the production package to compile (missing: {', '.join(missing)}); {INSTALL_HINT}")
    rows = []
    task = bar.add_task(f"compile production exp2 for {arch}", total=2 * len(degrees))
    for deg in degrees:
        for variant in ("scalar", "packed"):
            try:
                text = compile_ptx(variant, deg, arch=arch, dump_dir=Path(out) / "ptx-dump")
            except RuntimeError as exc:
                raise UsageError(str(exc)) from exc
            rows.append({"degree": deg, "variant": variant, "differences": check_ptx(text, variant=variant, degree=deg)})
            bar.advance(task)
    return rows


def cmd_ex2(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from audits.ex2_report import print_summary, write_report
    from audits.ex2_sweep import planned_inputs, sweep_ex2
    from numerics.bounds import ex2_bound_details

    degrees = _parse_degrees(args.degree)
    device = _device(args.device)
    if args.sample <= 0:
        raise UsageError(f"--sample must be a positive number of inputs per class, got {args.sample}")
    if device.type == "cuda":
        from fa4.production import ProductionUnavailable, ex2_kernel, require_production

        try:
            require_production()
        except ProductionUnavailable as exc:
            raise UsageError(f"--device cuda compares with production, which is unavailable: {exc}") from exc
    console = Console(stderr=True)
    common = dict(exhaustive=args.exhaustive, device=device, sample=args.sample, seed=args.seed)
    if args.chunk:
        common["chunk"] = args.chunk
    n_each = planned_inputs(exhaustive=args.exhaustive, sample=args.sample)
    results, verdicts, failed = [], [], False
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, disable=args.quiet,
    ) as bar:

        def sweep(label: str, **kw) -> dict:
            task = bar.add_task(label, total=n_each)
            return sweep_ex2(progress=lambda n: bar.advance(task, n), **common, **kw)

        for deg in degrees:
            entry = {"degree": deg}
            details = ex2_bound_details(deg)
            entry["bound"] = details["bound"]
            entry["bound_details"] = details
            prod_entry = {}
            if device.type == "cuda":
                entry["sweep"] = sweep(f"degree {deg}: model vs production scalar", degree=deg, production=ex2_kernel("scalar", deg))
                prod_entry["scalar"] = entry["sweep"].pop("production")
                try:
                    packed = ex2_kernel("packed", deg)
                    packed(torch.zeros(512, device=device))  # compile now: fails before sm_100
                except NotImplementedError as exc:
                    prod_entry["packed"] = {"skipped": str(exc)}
                else:
                    ps = sweep(f"degree {deg}: packed model vs production packed", degree=deg, packed=True, production=packed)
                    prod_entry["packed"] = ps["production"]
            else:
                entry["sweep"] = sweep(f"degree {deg}: model", degree=deg)
            entry["production"] = prod_entry
            n = entry["sweep"]["classes"]["normal"]
            if n["max_rel_error"] > entry["bound"]:
                failed = True
                verdicts.append(
                    f"FAIL degree {deg}: measured max relative error {n['max_rel_error']:.6e} at x = "
                    f"{n['argmax_x']!r} exceeds the proven bound {entry['bound']:.6e} — the model or the analysis is wrong"
                )
            else:
                verdicts.append(
                    f"ok degree {deg}: measured max {n['max_rel_error']:.6e} <= proven bound {entry['bound']:.6e} "
                    f"(bound/measured = {entry['bound'] / n['max_rel_error']:.4f})"
                )
            for variant, p in prod_entry.items():
                if "mismatches" in p:
                    ok = p["mismatches"] == 0
                    failed |= not ok
                    verdicts.append(
                        f"{'ok' if ok else 'FAIL'} degree {deg}: production {variant} vs model: "
                        f"{p['mismatches']:,} bit mismatches in {p['compared']:,} inputs"
                    )
                else:
                    verdicts.append(f"note degree {deg}: production {variant} not compared: {p['skipped']}")
            results.append(entry)
        ptx = None
        if args.ptx:
            ptx = _ptx_checks(degrees, args.ptx_arch, args.out, bar)
            for row in ptx:
                ok = not row["differences"]
                failed |= not ok
                verdicts.append(
                    f"{'ok' if ok else 'FAIL'} degree {row['degree']}: production {row['variant']} PTX for {args.ptx_arch} "
                    + ("matches the model's instructions" if ok else "differs from the model: " + "; ".join(row["differences"]))
                )
        hardware = None
        if device.type == "cuda":
            hardware = sweep("hardware ex2.approx.ftz (MUFU.EX2)", degree=0, function=ex2_kernel("hardware"))
        elif not args.quiet:
            verdicts.append("note: production not compared (--device cpu); use --device cuda with the gpu extra")
    report = {
        "schema": "fa4-audit/ex2/1",
        "command": "fa4-audit " + " ".join(shlex.quote(a) for a in args.argv),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "mode": "exhaustive (all 2^32 float32 inputs)" if args.exhaustive else f"sample (~{args.sample:,} inputs per class, seed {args.seed})",
        "device": str(device),
        "environment": _environment(device),
        "degrees": results,
        "verdicts": verdicts,
    }
    if hardware is not None:
        report["hardware"] = hardware
    if ptx is not None:
        report["ptx"] = {"arch": args.ptx_arch, "checks": ptx}
    paths = write_report(report, args.out)
    print_summary(report, console)
    console.print(f"report: {paths['md']} ({paths['json'].name}, {paths['svg'].name})")
    return EXIT_FAIL if failed else EXIT_OK


def cmd_fidelity(args: argparse.Namespace) -> int:
    import fnmatch
    import json
    from pathlib import Path

    from rich.console import Console
    from rich.progress import Progress

    from audits import fidelity
    from audits.ex2_report import atomic_write

    device = _device(args.device)
    if args.production == "fa4":
        from fa4.production import ProductionUnavailable, flash_attn, require_production

        try:
            require_production()
        except ProductionUnavailable as exc:
            raise UsageError(f"fidelity compares with the production kernel, which is unavailable: {exc}") from exc
        production = flash_attn
    else:
        from audits.kernels import get_kernel

        try:
            production = get_kernel(args.production)
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
    cases = [c for c in fidelity.CASES if fnmatch.fnmatch(c.name, args.cases)]
    if not cases:
        raise UsageError(f"--cases {args.cases!r} matches none of: {', '.join(c.name for c in fidelity.CASES)}")
    console = Console(stderr=True)
    results = []
    with Progress(console=console, disable=args.quiet) as bar:
        task = bar.add_task("fidelity", total=len(cases))
        for c in cases:
            results.append(fidelity.run_case(c, production, device))
            bar.advance(task)
    report = {
        "schema": "fa4-audit/fidelity/1",
        "command": "fa4-audit " + " ".join(shlex.quote(a) for a in args.argv),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "environment": ", ".join(f"{k} {v}" for k, v in _environment(device).items()),
        "production": args.production,
        "summary": fidelity.summarize(results),
        "results": results,
    }
    if args.mufu:
        if device.type != "cuda":
            raise UsageError("--mufu measures the GPU's MUFU.EX2: it needs --device cuda and the production package")
        from audits.mufu import measure_mufu

        report["mufu_ex2_vs_model"] = fidelity.mufu_vs_model(device)
        report["mufu_accuracy"] = measure_mufu(device)
    out = Path(args.out)
    atomic_write(out / "fidelity.json", json.dumps(report, separators=(",", ":")) + "\n")
    atomic_write(out / "fidelity.md", fidelity.markdown(report))
    s = report["summary"]
    console.print(
        f"{s['cases_ok']}/{s['cases']} cases ok; {100 * s['fraction_within_1']:.3f}% of outputs identical or 1 ULP apart, "
        f"{s['outputs']['>2']} beyond 2 ULP; report: {out / 'fidelity.md'}"
    )
    return EXIT_OK if s["cases_ok"] == s["cases"] else EXIT_FAIL


def cmd_bounds(args: argparse.Namespace) -> int:
    import json

    from rich.console import Console
    from rich.table import Table

    from numerics.bounds import PRODUCTION_RESCALING, rescaling_analysis

    variant = any(v is not None for v in (args.dtype, args.threshold, args.max_offset))
    if variant:
        if args.dtype is None:
            raise UsageError("--threshold/--max-offset need --dtype NAME (one of: " + ", ".join(PRODUCTION_RESCALING) + ")")
        if args.dtype not in PRODUCTION_RESCALING:
            raise UsageError(f"--dtype {args.dtype!r} is not a P dtype FA4 uses; accepted: {', '.join(PRODUCTION_RESCALING)}")
        thr, off = PRODUCTION_RESCALING[args.dtype]
        settings = [(args.dtype, thr if args.threshold is None else args.threshold, off if args.max_offset is None else args.max_offset)]
    else:
        settings = [(d, *PRODUCTION_RESCALING[d]) for d in PRODUCTION_RESCALING]
    if args.seqlen_k <= 0 or not args.max_v > 0:
        raise UsageError(f"--seqlen-k must be a positive integer and --max-v a positive number, got {args.seqlen_k}, {args.max_v}")
    rows = []
    for dt, thr, off in settings:
        try:
            rows.append(rescaling_analysis(dt, thr, off))
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
    console = Console()
    t = Table(title=f"lazy rescaling range analysis (seqlen_k {args.seqlen_k:,}, max|V| {args.max_v:g})")
    for col in ("dtype", "threshold", "max_offset", "max P", "dtype max", "headroom (log2)", "min P after cast", "mass lost to flush <=", "row sum headroom", "O headroom", "safe"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(
            r.dtype, f"{r.rescale_threshold:g}", str(r.max_offset), f"{r.p_max:g}", f"{r.dtype_max:g}", f"{r.headroom_log2:.3f}",
            f"{r.p_min_after_cast:.3g}", f"{r.flush_mass_bound(args.seqlen_k):.3g}", f"{r.row_sum_headroom_log2(args.seqlen_k):.1f}",
            f"{r.o_accumulator_headroom_log2(args.seqlen_k, args.max_v):.1f}", "yes" if r.safe else "NO",
        )
    console.print(t)
    for r in rows:
        console.print(f"- {r.dtype}: {r.explanation}")
    if args.json:
        print(json.dumps([r.as_dict(args.seqlen_k, args.max_v) for r in rows], indent=1))
    return EXIT_OK if all(r.safe for r in rows) else EXIT_FAIL


def cmd_run(args: argparse.Namespace) -> int:
    import dataclasses
    import fnmatch

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from audits.configs import suite
    from audits.gate import ThresholdsError, load_thresholds
    from audits.kernels import get_kernel
    from audits.report import build_report, exit_code, write_report
    from audits.runner import kernel_dir, run_suites, shard_cases

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
        raise UsageError("--jobs and --shard cannot be combined: --jobs N already runs N key shards (--shard I/N --shard-by key)")
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
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console, disable=args.quiet) as bar:
            task = bar.add_task(f"{', '.join(kernels)} / {args.suite}", total=len(cases) * len(kernels))
            runs = run_suites(
                kernels, cases, device=device, out_dir=args.out, thresholds=th, resume=args.resume, exitfirst=args.exitfirst,
                isolate=isolate, repro_cmd=repro, progress=lambda kern, r: bar.advance(task),
            )
    env = _environment(device)
    created = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    command = "fa4-audit " + " ".join(shlex.quote(a) for a in args.argv)
    code = 0
    for kern, records in runs.items():
        rep = build_report(
            kernel=kern, suite=args.suite, seed=args.seed, device=str(device), environment=env, thresholds=th,
            records=records, command=command, created=created, shard=shard,
        )
        paths = write_report(rep, kernel_dir(args.out, kern, len(kernels) > 1))
        v = rep["summary"]["verdicts"]
        console.print(f"{kern}: " + ", ".join(f"{k} {n}" for k, n in v.items() if n) + f" of {len(records)} cases; report: {paths['md']}")
        code = max(code, exit_code(rep))
        missing = len(cases) - len(records)
        if missing and not args.exitfirst:
            console.print(f"{kern}: {missing} of {len(cases)} cases did not finish (see OUT/jobs/*/log.txt); rerun with --resume to complete them")
            code = max(code, 1)
    return code


def _run_jobs(args: argparse.Namespace, kernels: list[str], cases: list, console) -> dict[str, list[dict]]:
    """``run --jobs N``: N child processes ``run --shard I/N --shard-by key`` (each compiles
    only its own compile keys, so JIT compilation runs N-wide), journals under OUT/jobs/I/,
    logs in OUT/jobs/I/log.txt; returns each kernel's finished records in suite order."""
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from audits.runner import kernel_dir, read_journal

    n = args.jobs
    argv = [a for k in kernels for a in ("--kernel", k)] + ["--suite", args.suite, "--device", args.device, "--seed", str(args.seed), "--quiet"]
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
            cmd = [sys.executable, "-m", "audits", "run", *argv, "--shard", f"{i}/{n}", "--shard-by", "key", "--out", str(d)]
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
            log.close()
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console, disable=args.quiet) as bar:
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
    from audits.report import build_report

    return build_report(
        kernel=rep["kernel"], suite=rep["suite"], seed=rep["seed"], device=rep["device"], environment=rep["environment"],
        thresholds=rep["thresholds"], records=rep["cases"], command=rep["command"], created=rep["created"], shard=rep.get("shard"),
    )


def cmd_gate(args: argparse.Namespace) -> int:
    from audits.gate import ThresholdsError, load_thresholds, rejudge
    from audits.report import exit_code

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
    print(", ".join(f"{k} {n}" for k, n in v.items() if n) + f" of {new['summary']['cases']} cases under {th['path']}" + (f" against {args.baseline}" if base else ""))
    if args.out:
        from audits.report import write_report

        new["command"] = f"{new['command']}; re-judged: fa4-audit " + " ".join(args.argv)
        print(f"re-judged report: {write_report(new, args.out)['md']}")
    return exit_code(new)


def cmd_show(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from audits.report import case_cells

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
    from audits.report import exit_code, write_report

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
    merged = _summarize({**reps[0], "cases": cases, "shard": None, "command": "fa4-audit " + " ".join(shlex.quote(a) for a in args.argv)})
    paths = write_report(merged, args.out)
    print(f"merged {len(reps)} reports, {len(cases)} cases: {paths['md']}")
    return exit_code(merged)


def cmd_static(args: argparse.Namespace) -> int:
    import dataclasses
    import json
    from pathlib import Path

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from audits.configs import Case, suite
    from audits.ex2_report import atomic_write
    from audits.static import StaticError, audit_group, static_groups

    if args.arch != "sm_100a":
        raise UsageError(f"--arch {args.arch!r}: only sm_100a (the Blackwell forward kernel FA4Numerics.sm100 models) is audited")
    if args.config:
        cases = []
        for text in args.config:
            try:
                c = Case(**{**json.loads(text), "family": "normal"})
            except (json.JSONDecodeError, TypeError) as exc:
                raise UsageError(f"--config {text!r}: expected a JSON object of audits.configs.Case fields ({exc})") from exc
            dtypes = ("bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")
            if c.dtype not in dtypes or not all(isinstance(n, int) and n > 0 for n in (c.d, c.dv, c.heads_q, c.heads_kv, c.seqlen_q, c.seqlen_k)) or c.heads_q % c.heads_kv:
                raise UsageError(f"--config {text!r}: dtype must be one of {', '.join(dtypes)}; d, dv, heads and seqlens positive integers; heads_q a multiple of heads_kv")
            cases.append(dataclasses.replace(c, window=tuple(c.window)))
    else:
        try:
            cases = suite(args.suite)
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
    try:
        import importlib
        from importlib.metadata import version

        versions = {"flash-attn-4": version("flash-attn-4"), "nvidia-cutlass-dsl": version("nvidia-cutlass-dsl")}
        importlib.import_module("flash_attn.cute")  # importable, not just installed
    except Exception as exc:
        print(f"fa4-audit static: the production package is not importable ({type(exc).__name__}: {exc}); "
              "install the gpu extra: pip install -e '.[gpu]'", file=sys.stderr)
        return EXIT_USAGE
    no_driver = args.compile_on == "cpu"
    if not no_driver and not torch.cuda.is_available():
        print("fa4-audit static: no CUDA device to compile on; pass --compile-on cpu to cross-compile without a GPU "
              "(it stands in for the driver's SM-count query, which sizes only the launch grid)", file=sys.stderr)
        return EXIT_USAGE
    if args.jobs < 1:
        raise UsageError(f"--jobs {args.jobs}: expected a positive number of parallel compiles")
    groups = static_groups(cases)
    out = Path(args.out)
    ptx_dir = Path(args.ptx_dir) if args.ptx_dir else out / "ptx"
    console = Console(stderr=True)
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console, disable=args.quiet) as bar:
            task = bar.add_task(f"static sm_100a / {len(groups)} compile groups", total=len(groups))
            # each compile is its own process: threads are enough to run --jobs of them at once
            from concurrent.futures import ThreadPoolExecutor

            def one(group):
                rec = audit_group(group[0], group[1], ptx_dir=ptx_dir, no_driver=no_driver)
                bar.advance(task)
                return rec

            with ThreadPoolExecutor(max_workers=args.jobs) as pool:
                records = list(pool.map(one, groups))  # suite order; the first StaticError propagates
    except StaticError as exc:
        print(f"fa4-audit static: {exc}", file=sys.stderr)
        return EXIT_USAGE
    counts = {v: sum(r["verdict"] == v for r in records) for v in ("match", "diverged", "skipped")}
    report = {
        "schema": "fa4-audit/static/1", "arch": args.arch, "suite": None if args.config else args.suite,
        "versions": versions, "compile_on": args.compile_on, "command": "fa4-audit " + " ".join(args.argv),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "summary": counts, "groups": records,
    }
    atomic_write(out / "static.json", json.dumps(report, separators=(",", ":")) + "\n")
    atomic_write(out / "static.md", _static_markdown(report))
    console.print(f"{counts['match']} match, {counts['diverged']} diverged, {counts['skipped']} skipped of {len(records)} compile groups; report: {out / 'static.md'}")
    for r in records:
        for d in r.get("differences", []):
            console.print(f"DIVERGED {r['group']}: {d['fact']}: production {d['production']}, model {d['model']}")
    return 1 if counts["diverged"] else 0


def _static_markdown(rep: dict) -> str:
    s = rep["summary"]
    L = ["# fa4-audit static: production SM100 forward PTX against FA4Numerics.sm100", "",
         f"`{rep['command']}` on {rep['created']}; flash-attn-4 {rep['versions']['flash-attn-4']}, nvidia-cutlass-dsl "
         f"{rep['versions']['nvidia-cutlass-dsl']}; compiled on {rep['compile_on']}.", "",
         f"{s['match']} compile groups match, {s['diverged']} diverged, {s['skipped']} skipped (production refuses the configuration).", ""]
    bad = [r for r in rep["groups"] if r["verdict"] == "diverged"]
    if bad:
        L += ["## Divergences", "", "| group | fact | production | model |", "|---|---|---|---|"]
        L += [f"| {r['group']} | {d['fact']} | `{d['production']}` | `{d['model']}` |" for r in bad for d in r["differences"]]
        L.append("")
    L += ["## Compile groups", "", "| group | cases | verdict | 2-CTA | emulated/step | degree | threshold | max_offset | P convert | ex2 hw | steps |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rep["groups"]:
        if r["verdict"] == "skipped":
            L.append(f"| {r['group']} | {r['cases']} | skipped: {r['reason'][:80]} | | | | | | | | |")
            continue
        f = r["facts"]
        L.append(f"| {r['group']} | {r['cases']} | {r['verdict']} | {r['production'].get('use_2cta_instrs')} | {f['exp2.emulated_per_step']:g}/{r['production'].get('n_block_size')} "
                 f"| {f['exp2.poly_degree']} | {f['rescale.threshold']} | {f['max_offset']} | {', '.join(f['p_convert'])} | {sum(f['exp2.hardware'].values())} | {f['softmax.steps']} |")
    return "\n".join(L) + "\n"


def cmd_summary(args: argparse.Namespace) -> int:
    from pathlib import Path

    from audits.ex2_report import atomic_write
    from audits.summary import plot_errors, summary_markdown

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
    from audits.configs import SUITES
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

    from audits.ex2_report import atomic_write
    from audits.gate import ThresholdsError, load_thresholds
    from audits.kernels import get_kernel
    from audits.strategies import fuzz

    try:
        get_kernel(args.kernel)
        th = load_thresholds(args.thresholds)
    except (ValueError, ThresholdsError) as exc:
        raise UsageError(str(exc)) from exc
    if args.budget <= 0 or args.max_seqlen <= 0:
        raise UsageError(f"--budget and --max-seqlen must be positive, got {args.budget}, {args.max_seqlen}")
    device = _device(args.device)
    res = fuzz(args.kernel, budget=args.budget, device=device, thresholds=th, database=args.database, max_seqlen=args.max_seqlen, seed=args.seed)
    atomic_write(Path(args.out) / "fuzz.json", json.dumps(res, indent=1) + "\n")
    print(f"{res['examples']} examples; largest error/bound {res['best_tightness']} ({res['best_case']})")
    if res["failure"]:
        f = res["failure"]
        print(f"FAILING (shrunk): {f['name']}: {f['verdict']}: {'; '.join(f['reasons'])}\nreproduce: {f['repro']}")
        return EXIT_FAIL
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fa4-audit",
        description="Numerics audits of the FlashAttention-4 kernel (exit 0 pass, 1 fail, 2 usage error).",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    e = sub.add_parser(
        "ex2",
        help="audit the polynomial exp2 emulation: error statistics, proven bound, bit-exact comparison with production",
        description="Measure fa4.ex2 (the bit-exact model of FA4's polynomial exp2) against exp2 in float64 over "
        "a sample or all 2^32 float32 inputs, beside the proven bound; with --device cuda also compare the "
        "production device functions bit for bit and measure the hardware MUFU.EX2.",
    )
    e.add_argument("--degree", default="3", help="polynomial degree 1-5, or 'all' (default 3, production's)")
    e.add_argument("--exhaustive", action="store_true", help="every float32 bit pattern (2^32) instead of a sample")
    e.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where to run (default cpu)")
    e.add_argument("--out", default="reports/ex2-latest", help="report directory (default reports/ex2-latest)")
    e.add_argument("--sample", type=int, default=1 << 20, help="inputs per input class without --exhaustive (default 2^20)")
    e.add_argument("--seed", type=int, default=0, help="seed of the sample (default 0)")
    e.add_argument("--chunk", type=int, default=0, help="inputs per chunk (default: 2^22)")
    e.add_argument(
        "--ptx", action="store_true",
        help="also compile production's scalar and packed exp2 (needs the gpu extra, not a GPU) and check "
        "their f32 instructions (rounding, ftz, packing) and constants against the model",
    )
    e.add_argument("--ptx-arch", default="sm_100a", help="target of --ptx (default sm_100a, what the SM100 kernel runs)")
    e.add_argument("--quiet", action="store_true", help="no progress bar")
    e.set_defaults(func=cmd_ex2)
    f = sub.add_parser(
        "fidelity",
        help="compare the SM90 numerics model with the production kernel on identical inputs",
        description="Run production flash_attn_func (its SM90 path on Hopper) and fa4.model with "
        "FA4Numerics.sm90 on the same inputs; report the output differences in ULPs, the LSE "
        "difference and both errors against FP64.  Exit 1 when a case has fewer than 99%% of its "
        "outputs identical or 1 ULP apart.",
    )
    f.add_argument("--device", default="cuda", choices=["cpu", "cuda"], help="default cuda")
    f.add_argument("--production", default="fa4", help="the kernel to compare: fa4 (production), another kernel name, or module:attr")
    f.add_argument("--cases", default="*", help="glob over case names (default all)")
    f.add_argument("--out", default="reports/fidelity-latest", help="report directory")
    f.add_argument("--mufu", action="store_true", help="also compare MUFU.EX2 with the model's hardware exp2 over all 2^32 inputs (cuda)")
    f.add_argument("--quiet", action="store_true")
    f.set_defaults(func=cmd_fidelity)
    b = sub.add_parser(
        "bounds",
        help="range analysis of lazy rescaling: does P fit its dtype, what underflows, float32 headroom",
        description="Without options: the analysis for every P dtype with production's settings (16-bit: "
        "threshold 8, max_offset 0; fp8: 0 and 8).  With --dtype and --threshold/--max-offset: a variant.  "
        "Exit 1 when a setting lets P saturate its dtype, 2 for bad settings.",
    )
    b.add_argument("--dtype", default=None, help="bfloat16, float16, float8_e4m3fn or float8_e5m2")
    b.add_argument("--threshold", type=float, default=None, help="rescale threshold, log2 units (default production's)")
    b.add_argument("--max-offset", type=int, default=None, help="max_offset, log2 units (default production's)")
    b.add_argument("--seqlen-k", type=int, default=32768, help="keys per row for the mass and headroom columns (default 32768)")
    b.add_argument("--max-v", type=float, default=1.0, help="max |V| for the O headroom column (default 1)")
    b.add_argument("--json", action="store_true", help="also print the records as JSON")
    b.set_defaults(func=cmd_bounds)
    r = sub.add_parser(
        "run",
        help="audit a kernel on a suite: FP64 reference, metrics, bounds, verdicts, report",
        description="Run every case of a suite for a kernel; write OUT/report.{json,md,html,junit.xml} "
        "(OUT/<kernel>/report.* with several --kernel).  "
        "Exit 0 when every case passes, 1 when any fails, errors or crashes or none could run, 2 for usage errors.",
    )
    r.add_argument(
        "--kernel", required=True, action="append",
        help="fa4, fa4-model, fa4-model-sm90, sdpa-math, sdpa-flash, sdpa-efficient, sdpa-cudnn, or module:attr; "
        "repeat to audit several kernels on shared inputs and references (one OUT/<kernel>/ report each)",
    )
    r.add_argument("--suite", default="smoke", help="suite name (default smoke)")
    r.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    r.add_argument("--seed", type=int, default=0, help="added to every case's seed (default 0)")
    r.add_argument("--out", default="reports/run-latest", help="report directory (default reports/run-latest)")
    r.add_argument("--thresholds", default=None, help="thresholds TOML (default: the shipped audits/thresholds.toml)")
    r.add_argument("--resume", action="store_true", help="continue from OUT/journal.jsonl without redoing finished cases")
    r.add_argument("-x", "--exitfirst", action="store_true", help="stop at the first failing case")
    r.add_argument("--shard", default=None, help="I/N: run a deterministic, balanced 1/N slice")
    r.add_argument("--shard-by", default="cost", choices=["cost", "key"], help="balance shards by case cost, or keep compile-key groups whole (default cost)")
    r.add_argument("--jobs", type=int, default=1, help="N parallel processes, one compile-key shard each (GPU audits: compilation dominates); reports as one run")
    r.add_argument("--case", default=None, help="glob over case names (e.g. a reproducer's name)")
    r.add_argument(
        "--isolate", action=argparse.BooleanOptionalAction, default=None,
        help="run the kernel in a worker process so that a crash is one case's verdict "
        "(default: on for fa4 and module:attr kernels, off for the built-in model and SDPA)",
    )
    r.add_argument("--quiet", action="store_true")
    r.set_defaults(func=cmd_run)
    g = sub.add_parser("gate", help="re-judge a report under thresholds (and against a baseline report)")
    g.add_argument("report")
    g.add_argument("--thresholds", default=None)
    g.add_argument("--baseline", default=None, help="BASE.json: fail cases worse than the baseline by more than [baseline] max_ratio")
    g.add_argument("--out", default=None, help="also write the re-judged report (json, md, html, junit) into this directory")
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
    fz.add_argument("--database", default=".hypothesis/fa4-audit", help="Hypothesis example database (kept between runs)")
    fz.add_argument("--thresholds", default=None)
    fz.add_argument("--seed", type=int, default=None, help="a fixed search (Hypothesis then neither reads nor writes the database)")
    fz.add_argument("--out", default="reports/fuzz-latest")
    fz.set_defaults(func=cmd_fuzz)
    ls = sub.add_parser("list", help="kernels, suites (case and compile-key counts) and input families")
    ls.set_defaults(func=cmd_list)
    sm = sub.add_parser("summary", help="several kernels' reports side by side, per configuration group")
    sm.add_argument("reports", nargs="+", help="report.json (or .json.gz) files, one per kernel")
    sm.add_argument("--by", default="dtype,mask", help="grouping: comma-separated Case fields, mask or heads (default dtype,mask)")
    sm.add_argument("--out", default=None, help="also write OUT/summary.md and OUT/summary.svg")
    sm.set_defaults(func=cmd_summary)
    st = sub.add_parser(
        "static", help="compile production's SM100 forward kernel per compile group and check its PTX against the model",
        description="Cross-compile FlashAttentionForwardSm100 to sm_100a PTX for each compile group of a suite (or --config), "
        "extract its numerics facts and compare them with FA4Numerics.sm100.  Exit 0 when every fact matches, 1 when any "
        "diverged, 2 when facts could not be produced (no production package, no CUDA without --compile-on cpu, a failed "
        "compile, PTX the extractor does not understand).",
    )
    st.add_argument("--arch", default="sm_100a", help="compile target (only sm_100a, the kernel FA4Numerics.sm100 models)")
    st.add_argument("--suite", default="smoke", help="suite whose compile groups are audited (default smoke; release: 142 groups)")
    st.add_argument("--config", action="append", default=None, help="a Case as JSON, e.g. '{\"dtype\": \"bfloat16\", \"d\": 128, \"causal\": true}'; repeatable")
    st.add_argument("--compile-on", default="cuda", choices=["cuda", "cpu"], help="cpu: cross-compile without any GPU (opt-in; see README)")
    st.add_argument("--jobs", type=int, default=1, help="compiles at once (each is a single-threaded process; default 1)")
    st.add_argument("--ptx-dir", default=None, help="where compressed PTX is kept and reused (default OUT/ptx)")
    st.add_argument("--out", default="reports/static-latest", help="writes OUT/static.json (schema fa4-audit/static/1) and OUT/static.md")
    st.add_argument("--quiet", action="store_true")
    st.set_defaults(func=cmd_static)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on usage errors, 0 on --help
        return int(exc.code or 0)
    args.argv = argv
    try:
        return args.func(args)
    except UsageError as exc:
        print(f"fa4-audit {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"fa4-audit {args.command}: interrupted; finished cases are in the journal, --resume continues", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
