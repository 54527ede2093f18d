"""``fa4-audit bounds``: the range analysis of lazy rescaling."""

from __future__ import annotations

import argparse
import json

from rich.console import Console

from audits.common import EXIT_FAIL, EXIT_OK, UsageError, print_table
from fa4.knobs import PRODUCTION_RESCALING
from numerics.bounds import rescaling_analysis


def _rescaling_settings(args: argparse.Namespace) -> list[tuple]:
    """The (dtype, threshold, max_offset) settings to analyse: production's, or the one variant asked for."""
    variant = any(v is not None for v in (args.dtype, args.threshold, args.max_offset))
    if not variant:
        return [(d, *PRODUCTION_RESCALING[d]) for d in PRODUCTION_RESCALING]
    if args.dtype is None:
        raise UsageError("--threshold/--max-offset need --dtype NAME (one of: " + ", ".join(PRODUCTION_RESCALING) + ")")
    if args.dtype not in PRODUCTION_RESCALING:
        raise UsageError(
            f"--dtype {args.dtype!r} is not a P dtype FA4 uses; accepted: {', '.join(PRODUCTION_RESCALING)}"
        )
    thr, off = PRODUCTION_RESCALING[args.dtype]
    return [
        (
            args.dtype,
            thr if args.threshold is None else args.threshold,
            off if args.max_offset is None else args.max_offset,
        )
    ]


def _analyse(settings: list[tuple]) -> list:
    """One ``rescaling_analysis`` record per setting; a setting it rejects is a usage error."""
    rows = []
    for dt, thr, off in settings:
        try:
            rows.append(rescaling_analysis(dt, thr, off))
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
    return rows


def _print_table(rows: list, seqlen_k: int, max_v: float) -> None:
    """Print the analysis table, then one explanation line per dtype."""
    console = Console()
    columns = [
        "dtype",
        "threshold",
        "max_offset",
        "max P",
        "dtype max",
        "headroom (log2)",
        "min P after cast",
        "mass lost to flush <=",
        "row sum headroom",
        "O headroom",
        "safe",
    ]
    cells = [
        [
            r.dtype,
            f"{r.rescale_threshold:g}",
            str(r.max_offset),
            f"{r.p_max:g}",
            f"{r.dtype_max:g}",
            f"{r.headroom_log2:.3f}",
            f"{r.p_min_after_cast:.3g}",
            f"{r.flush_mass_bound(seqlen_k):.3g}",
            f"{r.row_sum_headroom_log2(seqlen_k):.1f}",
            f"{r.o_accumulator_headroom_log2(seqlen_k, max_v):.1f}",
            "yes" if r.safe else "NO",
        ]
        for r in rows
    ]
    print_table(console, f"lazy rescaling range analysis (seqlen_k {seqlen_k:,}, max|V| {max_v:g})", columns, cells)
    for r in rows:
        print(f"- {r.dtype}: {r.explanation}")


def cmd_bounds(args: argparse.Namespace) -> int:
    settings = _rescaling_settings(args)
    if args.seqlen_k <= 0 or not args.max_v > 0:
        raise UsageError(
            f"--seqlen-k must be a positive integer and --max-v a positive number, got {args.seqlen_k}, {args.max_v}"
        )
    rows = _analyse(settings)
    _print_table(rows, args.seqlen_k, args.max_v)
    if args.json:
        print(json.dumps([r.as_dict(args.seqlen_k, args.max_v) for r in rows], indent=1))
    return EXIT_OK if all(r.safe for r in rows) else EXIT_FAIL


def register(sub) -> None:
    """Add this audit's subcommands to the ``fa4-audit`` parser."""
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
    b.add_argument(
        "--seqlen-k", type=int, default=32768, help="keys per row for the mass and headroom columns (default 32768)"
    )
    b.add_argument("--max-v", type=float, default=1.0, help="max |V| for the O headroom column (default 1)")
    b.add_argument("--json", action="store_true", help="also print the records as JSON")
    b.set_defaults(func=cmd_bounds)
