"""``fa4-audit static``: production's SM100 PTX against the model."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import version
from pathlib import Path

import torch
from rich.console import Console

from audits.checks.static import backward as static_backward
from audits.checks.static import core
from audits.checks.static.report import backward_markdown, static_markdown
from audits.common import EXIT_FAIL, EXIT_OK, EXIT_USAGE, UsageError, atomic_write, gpu_list, progress
from audits.report.header import command_line, now


def _production_versions() -> dict | None:
    """Versions of the production packages; None (after saying why on stderr) when not importable."""
    try:
        versions = {"flash-attn-4": version("flash-attn-4"), "nvidia-cutlass-dsl": version("nvidia-cutlass-dsl")}
        importlib.import_module("flash_attn.cute")  # importable, not just installed
    except Exception as exc:
        print(
            f"fa4-audit static: the production package is not importable ({type(exc).__name__}: {exc}); "
            "install the gpu extra: pip install -e '.[gpu]'",
            file=sys.stderr,
        )
        return None
    return versions


def _audit_groups(
    groups: list, audit, *, ptx_dir, no_driver: bool, jobs: int, quiet: bool, gpus: list[str] = ()
) -> list[dict]:
    """Compile and audit (``audit``: ``core.audit_group`` or ``backward.audit_backward_group``)
    every group, ``jobs`` at once, group i's compile on GPU ``gpus[i % len(gpus)]`` when compiling
    on CUDA over several GPUs; records in suite order (StaticError propagates)."""
    console = Console(stderr=True)
    with progress(console, quiet=quiet) as bar:
        task = bar.add_task(f"static sm_100a / {len(groups)} compile groups", total=len(groups))

        # each compile is its own process: threads are enough to run --jobs of them at once
        def one(i, group):
            gpu = gpus[i % len(gpus)] if gpus and not no_driver else None
            rec = audit(group[0], group[1], ptx_dir=ptx_dir, no_driver=no_driver, gpu=gpu)
            bar.advance(task)
            return rec

        with ThreadPoolExecutor(max_workers=jobs) as pool:
            return list(pool.map(one, range(len(groups)), groups))  # suite order; the first StaticError propagates


def _print_outcome(counts: dict, records: list[dict], md) -> int:
    """Print the summary line and every divergence; the exit code."""
    print(
        f"{counts['match']} match, {counts['diverged']} diverged, {counts['skipped']} skipped (production refuses) "
        f"of {len(records)} compile groups; report: {md}"
    )
    for r in records:
        for d in r.get("differences", []):
            print(f"DIVERGED {r['group']}: {d['fact']}: production {d['production']}, model {d['model']}")
    if not counts["match"] + counts["diverged"]:
        print("nothing was audited: production refused every compile group", file=sys.stderr)
        return EXIT_FAIL
    return EXIT_FAIL if counts["diverged"] else EXIT_OK


def _groups_and_audit(cases: list, backward: bool) -> tuple[list, object, dict]:
    """The compile groups, the per-group audit and the report's name / schema / extra summary."""
    if backward:
        extra = {"fp8_cases_not_audited": sum(map(static_backward.is_fp8, cases))}  # production has no fp8 backward
        meta = {"name": "static-backward", "schema": "fa4-audit/static-backward/1", "extra": extra}
        return static_backward.backward_groups(cases), static_backward.audit_backward_group, meta
    return core.static_groups(cases), core.audit_group, {"name": "static", "schema": "fa4-audit/static/1", "extra": {}}


def _check_environment(args: argparse.Namespace) -> dict | None:
    """The production versions, or None (after saying why) when the audit cannot compile here."""
    if args.jobs < 1:
        raise UsageError(f"--jobs {args.jobs}: expected a positive number of parallel compiles")
    versions = _production_versions()
    if versions is not None and args.compile_on == "cuda" and not torch.cuda.is_available():
        print(
            "fa4-audit static: no CUDA device to compile on; pass --compile-on cpu to cross-compile without a GPU "
            "(it stands in for the driver's SM-count query, which sizes only the launch grid)",
            file=sys.stderr,
        )
        return None
    return versions


def cmd_static(args: argparse.Namespace) -> int:
    from audits.cli.options import selection_from_args

    if args.arch != "sm_100a":
        raise UsageError(
            f"--arch {args.arch!r}: only sm_100a (the Blackwell kernels FA4Numerics.sm100 and fa4.model_bwd model) "
            "is audited"
        )
    sel = selection_from_args(args)  # static runs no kernel: suites within the --domain file alone
    groups, audit, meta = _groups_and_audit(sel.cases, args.backward)
    if not groups:
        why = "fp8 or varlen cases (production has no fp8 backward)" if args.backward else "varlen cases"
        raise UsageError(
            f"the selection {sel.label!r} yields no compile group: its {len(sel.cases)} cases are all {why}, "
            "which the static audit does not compile (it audits flash_attn_func's kernels)"
        )
    versions = _check_environment(args)
    if versions is None:
        return EXIT_USAGE
    out = Path(args.out)
    ptx_dir = Path(args.ptx_dir) if args.ptx_dir else out / "ptx"
    no_driver = args.compile_on == "cpu"
    try:
        records = _audit_groups(
            groups,
            audit,
            ptx_dir=ptx_dir,
            no_driver=no_driver,
            jobs=args.jobs,
            quiet=args.quiet,
            gpus=gpu_list(args.gpus) if args.jobs > 1 and not no_driver else [],
        )
    except core.StaticError as exc:
        print(f"fa4-audit static: {exc}", file=sys.stderr)
        return EXIT_USAGE
    counts = {v: sum(r["verdict"] == v for r in records) for v in ("match", "diverged", "skipped")}
    report = {
        "schema": meta["schema"],
        "arch": args.arch,
        "suite": sel.label,
        "versions": versions,
        "compile_on": args.compile_on,
        "command": command_line(args.argv),
        "created": now(),
        "summary": {**counts, **meta["extra"]},
        "groups": records,
    }
    atomic_write(out / f"{meta['name']}.json", json.dumps(report, separators=(",", ":")) + "\n")
    markdown = backward_markdown if args.backward else static_markdown
    atomic_write(out / f"{meta['name']}.md", markdown(report))
    return _print_outcome(counts, records, out / f"{meta['name']}.md")


def register(sub) -> None:
    """Add this audit's subcommands to the ``fa4-audit`` parser."""
    from audits.cli.options import add_case_arguments

    st = sub.add_parser(
        "static",
        help="compile production's SM100 forward kernel per compile group and check its PTX against the model",
        description="Cross-compile FlashAttentionForwardSm100 to sm_100a PTX for each compile group of a suite "
        "(or --config), extract its numerics facts and compare them with FA4Numerics.sm100.  Exit 0 when every fact "
        "matches, 1 when any diverged, 2 when facts could not be produced (no production package, no CUDA without "
        "--compile-on cpu, a failed compile, PTX the extractor does not understand).",
    )
    st.add_argument(
        "--arch",
        default="sm_100a",
        help="compile target (only sm_100a, the kernels FA4Numerics.sm100 and fa4.model_bwd model)",
    )
    add_case_arguments(st, default_suite="smoke")
    st.add_argument(
        "--compile-on",
        default="cuda",
        choices=["cuda", "cpu"],
        help="cpu: cross-compile without any GPU (opt-in; see docs/static.md)",
    )
    st.add_argument(
        "--jobs", type=int, default=1, help="compiles at once (each is a single-threaded process; default 1)"
    )
    st.add_argument(
        "--gpus",
        default=None,
        help="with --jobs and --compile-on cuda: the GPUs the compiles are spread over, e.g. 0,1 "
        "(default: all visible)",
    )
    st.add_argument("--ptx-dir", default=None, help="where compressed PTX is kept and reused (default OUT/ptx)")
    st.add_argument(
        "--out",
        default="reports/static-latest",
        help="writes OUT/static.json (schema fa4-audit/static/1) and OUT/static.md; with --backward "
        "OUT/static-backward.json (fa4-audit/static-backward/1) and OUT/static-backward.md",
    )
    st.add_argument(
        "--backward",
        action="store_true",
        help="audit the backward kernels (preprocess, FlashAttentionBackwardSm100 / the hd256 kernel, postprocess) "
        "against fa4.model_bwd; writes OUT/static-backward.json and .md (docs/static.md)",
    )
    st.add_argument("--quiet", action="store_true", help="no progress bar")
    st.set_defaults(func=cmd_static)
