"""``fa4-audit ex2``: the exp2 audit's command line."""

from __future__ import annotations

import argparse

import torch
from rich.console import Console

from audits.checks.ex2.report import print_summary, write_report
from audits.checks.ex2.sweep import planned_inputs, sweep_ex2
from audits.checks.ex2.verdicts import degree_verdicts, ptx_checks, ptx_verdicts, sweep_degree
from audits.common import EXIT_FAIL, EXIT_OK, UsageError, progress
from audits.common import device as _device
from audits.common import environment as _environment
from audits.report.header import command_line, now
from fa4.ex2 import DEGREES
from fa4.production import ProductionUnavailable, ex2_kernel, require_production


def _parse_degrees(text: str) -> list[int]:
    if text == "all":
        return list(DEGREES)
    try:
        d = int(text)
    except ValueError:
        d = None
    if d not in DEGREES:
        raise UsageError(f"--degree {text!r} is not valid; accepted: {', '.join(map(str, DEGREES))} or 'all'")
    return [d]


def _checked_device(args: argparse.Namespace) -> torch.device:
    """The ``--device`` asked for, after checking ``--sample`` and, for cuda, that production is importable."""
    device = _device(args.device)
    if args.sample <= 0:
        raise UsageError(f"--sample must be a positive number of inputs per class, got {args.sample}")
    if device.type == "cuda":
        try:
            require_production()
        except ProductionUnavailable as exc:
            raise UsageError(f"--device cuda compares with production, which is unavailable: {exc}") from exc
    return device


def _report(args, device, results, verdicts, hardware, ptx) -> dict:
    """The ex2 report record (what ``write_report`` writes as JSON and markdown)."""
    report = {
        "schema": "fa4-audit/ex2/1",
        "command": command_line(args.argv),
        "created": now(),
        "mode": "exhaustive (all 2^32 float32 inputs)"
        if args.exhaustive
        else f"sample (~{args.sample:,} inputs per class, seed {args.seed})",
        "device": str(device),
        "environment": _environment(device),
        "degrees": results,
        "verdicts": verdicts,
    }
    if hardware is not None:
        report["hardware"] = hardware
    if ptx is not None:
        report["ptx"] = {"arch": args.ptx_arch, "checks": ptx}
    return report


def cmd_ex2(args: argparse.Namespace) -> int:
    degrees = _parse_degrees(args.degree)
    device = _checked_device(args)
    console = Console(stderr=True)
    common = dict(exhaustive=args.exhaustive, device=device, sample=args.sample, seed=args.seed)
    if args.chunk:
        common["chunk"] = args.chunk
    n_each = planned_inputs(exhaustive=args.exhaustive, sample=args.sample)
    results, verdicts, failed = [], [], False
    with progress(console, quiet=args.quiet) as bar:

        def sweep(label: str, **kw) -> dict:
            task = bar.add_task(label, total=n_each)
            return sweep_ex2(progress=lambda n: bar.advance(task, n), **common, **kw)

        for deg in degrees:
            entry = sweep_degree(deg, device, sweep)
            lines, bad = degree_verdicts(entry)
            verdicts += lines
            failed |= bad
            results.append(entry)
        ptx = None
        if args.ptx:
            task = bar.add_task(f"compile production exp2 for {args.ptx_arch}", total=2 * len(degrees))
            ptx = ptx_checks(degrees, args.ptx_arch, args.out, advance=lambda: bar.advance(task))
            lines, bad = ptx_verdicts(ptx, args.ptx_arch)
            verdicts += lines
            failed |= bad
        hardware = None
        if device.type == "cuda":
            hardware = sweep("hardware ex2.approx.ftz (MUFU.EX2)", degree=0, function=ex2_kernel("hardware"))
        elif not args.quiet:
            verdicts.append("note: production not compared (--device cpu); use --device cuda with the gpu extra")
    report = _report(args, device, results, verdicts, hardware, ptx)
    paths = write_report(report, args.out)
    print_summary(report, Console())  # results on stdout; the progress bar was on stderr
    print(f"report: {paths['md']} ({paths['json'].name}, {paths['svg'].name})")
    return EXIT_FAIL if failed else EXIT_OK


def register(sub) -> None:
    """Add this audit's subcommands to the ``fa4-audit`` parser."""
    e = sub.add_parser(
        "ex2",
        help="audit the polynomial exp2 emulation: error statistics, proven bound, "
        "bit-exact comparison with production",
        description="Measure fa4.ex2 (the bit-exact model of FA4's polynomial exp2) against exp2 in float64 over "
        "a sample or all 2^32 float32 inputs, beside the proven bound; with --device cuda also compare the "
        "production device functions bit for bit and measure the hardware MUFU.EX2.",
    )
    e.add_argument("--degree", default="3", help="polynomial degree 1-5, or 'all' (default 3, production's)")
    e.add_argument("--exhaustive", action="store_true", help="every float32 bit pattern (2^32) instead of a sample")
    e.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where to run (default cpu)")
    e.add_argument("--out", default="reports/ex2-latest", help="report directory (default reports/ex2-latest)")
    e.add_argument(
        "--sample", type=int, default=1 << 20, help="inputs per input class without --exhaustive (default 2^20)"
    )
    e.add_argument("--seed", type=int, default=0, help="seed of the sample (default 0)")
    e.add_argument("--chunk", type=int, default=0, help="inputs per chunk (default: 2^22)")
    e.add_argument(
        "--ptx",
        action="store_true",
        help="also compile production's scalar and packed exp2 (needs the gpu extra, not a GPU) and check "
        "their f32 instructions (rounding, ftz, packing) and constants against the model",
    )
    e.add_argument(
        "--ptx-arch", default="sm_100a", help="target of --ptx (default sm_100a, what the SM100 kernel runs)"
    )
    e.add_argument("--quiet", action="store_true", help="no progress bar")
    e.set_defaults(func=cmd_ex2)
