"""``fa4-audit static``: production's SM100 PTX against the model."""

from __future__ import annotations

import argparse
import datetime as _dt
import sys

import torch

from audits.common import EXIT_FAIL, EXIT_OK, EXIT_USAGE, UsageError, atomic_write, progress


def _config_cases(configs: list[str]) -> list:
    """The cases given as ``--config`` JSON objects (``audits.cases.case_from_dict``, family
    normal: the input family does not change what is compiled)."""
    from audits.cases import case_from_json

    try:
        return [case_from_json(text, where=f"--config #{i + 1}", family="normal") for i, text in enumerate(configs)]
    except ValueError as exc:
        raise UsageError(str(exc)) from exc


def _cases(args: argparse.Namespace) -> list:
    """The cases to audit: ``--config``'s, else the suite's."""
    from audits.cases import suite

    if args.config:
        return _config_cases(args.config)
    try:
        return suite(args.suite)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc


def _production_versions() -> dict | None:
    """Versions of the production packages; None (after saying why on stderr) when not importable."""
    try:
        import importlib
        from importlib.metadata import version

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


def _audit_groups(groups: list, *, ptx_dir, no_driver: bool, jobs: int, quiet: bool) -> list[dict]:
    """Compile and audit every group, ``jobs`` at once; records in suite order (StaticError propagates)."""
    from rich.console import Console

    from audits.static.core import audit_group

    console = Console(stderr=True)
    with progress(console, quiet=quiet) as bar:
        task = bar.add_task(f"static sm_100a / {len(groups)} compile groups", total=len(groups))
        # each compile is its own process: threads are enough to run --jobs of them at once
        from concurrent.futures import ThreadPoolExecutor

        def one(group):
            rec = audit_group(group[0], group[1], ptx_dir=ptx_dir, no_driver=no_driver)
            bar.advance(task)
            return rec

        with ThreadPoolExecutor(max_workers=jobs) as pool:
            return list(pool.map(one, groups))  # suite order; the first StaticError propagates


def _print_outcome(counts: dict, records: list[dict], out) -> int:
    """Print the summary line and every divergence; the exit code."""
    print(
        f"{counts['match']} match, {counts['diverged']} diverged, {counts['skipped']} skipped (production refuses) "
        f"of {len(records)} compile groups; report: {out / 'static.md'}"
    )
    for r in records:
        for d in r.get("differences", []):
            print(f"DIVERGED {r['group']}: {d['fact']}: production {d['production']}, model {d['model']}")
    if not counts["match"] + counts["diverged"]:
        print("nothing was audited: production refused every compile group", file=sys.stderr)
        return EXIT_FAIL
    return EXIT_FAIL if counts["diverged"] else EXIT_OK


def cmd_static(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from audits.static.core import StaticError, static_groups

    if args.arch != "sm_100a":
        raise UsageError(
            f"--arch {args.arch!r}: only sm_100a (the Blackwell forward kernel FA4Numerics.sm100 models) is audited"
        )
    cases = _cases(args)
    versions = _production_versions()
    if versions is None:
        return EXIT_USAGE
    no_driver = args.compile_on == "cpu"
    if not no_driver and not torch.cuda.is_available():
        print(
            "fa4-audit static: no CUDA device to compile on; pass --compile-on cpu to cross-compile without a GPU "
            "(it stands in for the driver's SM-count query, which sizes only the launch grid)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if args.jobs < 1:
        raise UsageError(f"--jobs {args.jobs}: expected a positive number of parallel compiles")
    groups = static_groups(cases)
    out = Path(args.out)
    ptx_dir = Path(args.ptx_dir) if args.ptx_dir else out / "ptx"
    try:
        records = _audit_groups(groups, ptx_dir=ptx_dir, no_driver=no_driver, jobs=args.jobs, quiet=args.quiet)
    except StaticError as exc:
        print(f"fa4-audit static: {exc}", file=sys.stderr)
        return EXIT_USAGE
    counts = {v: sum(r["verdict"] == v for r in records) for v in ("match", "diverged", "skipped")}
    report = {
        "schema": "fa4-audit/static/1",
        "arch": args.arch,
        "suite": None if args.config else args.suite,
        "versions": versions,
        "compile_on": args.compile_on,
        "command": "fa4-audit " + " ".join(args.argv),
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "summary": counts,
        "groups": records,
    }
    atomic_write(out / "static.json", json.dumps(report, separators=(",", ":")) + "\n")
    atomic_write(out / "static.md", _static_markdown(report))
    return _print_outcome(counts, records, out)


def _static_markdown(rep: dict) -> str:
    s = rep["summary"]
    L = [
        "# fa4-audit static: production SM100 forward PTX against FA4Numerics.sm100",
        "",
        f"`{rep['command']}` on {rep['created']}; flash-attn-4 {rep['versions']['flash-attn-4']}, "
        f"nvidia-cutlass-dsl {rep['versions']['nvidia-cutlass-dsl']}; compiled on {rep['compile_on']}.",
        "",
        f"{s['match']} compile groups match, {s['diverged']} diverged, {s['skipped']} skipped "
        "(production refuses the configuration).",
        "",
    ]
    bad = [r for r in rep["groups"] if r["verdict"] == "diverged"]
    if bad:
        L += ["## Divergences", "", "| group | fact | production | model |", "|---|---|---|---|"]
        L += [
            f"| {r['group']} | {d['fact']} | `{d['production']}` | `{d['model']}` |"
            for r in bad
            for d in r["differences"]
        ]
        L.append("")
    L += [
        "## Compile groups",
        "",
        "| group | cases | verdict | 2-CTA | emulated/step | degree | threshold | max_offset | P convert "
        "| ex2 hw | steps |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rep["groups"]:
        if r["verdict"] == "skipped":
            L.append(f"| {r['group']} | {r['cases']} | skipped: {r['reason'][:80]} | | | | | | | | |")
            continue
        f = r["facts"]
        L.append(
            f"| {r['group']} | {r['cases']} | {r['verdict']} | {r['production'].get('use_2cta_instrs')} "
            f"| {f['exp2.emulated_per_step']:g}/{r['production'].get('n_block_size')} "
            f"| {f['exp2.poly_degree']} | {f['rescale.threshold']} | {f['max_offset']} "
            f"| {', '.join(f['p_convert'])} | {sum(f['exp2.hardware'].values())} | {f['softmax.steps']} |"
        )
    return "\n".join(L) + "\n"


def register(sub) -> None:
    """Add this audit's subcommands to the ``fa4-audit`` parser."""
    st = sub.add_parser(
        "static",
        help="compile production's SM100 forward kernel per compile group and check its PTX against the model",
        description="Cross-compile FlashAttentionForwardSm100 to sm_100a PTX for each compile group of a suite "
        "(or --config), extract its numerics facts and compare them with FA4Numerics.sm100.  Exit 0 when every fact "
        "matches, 1 when any diverged, 2 when facts could not be produced (no production package, no CUDA without "
        "--compile-on cpu, a failed compile, PTX the extractor does not understand).",
    )
    st.add_argument(
        "--arch", default="sm_100a", help="compile target (only sm_100a, the kernel FA4Numerics.sm100 models)"
    )
    st.add_argument(
        "--suite", default="smoke", help="suite whose compile groups are audited (default smoke; release: 142 groups)"
    )
    st.add_argument(
        "--config",
        action="append",
        default=None,
        help='a Case as JSON, e.g. \'{"dtype": "bfloat16", "d": 128, "causal": true}\'; repeatable',
    )
    st.add_argument(
        "--compile-on",
        default="cuda",
        choices=["cuda", "cpu"],
        help="cpu: cross-compile without any GPU (opt-in; see docs/static.md)",
    )
    st.add_argument(
        "--jobs", type=int, default=1, help="compiles at once (each is a single-threaded process; default 1)"
    )
    st.add_argument("--ptx-dir", default=None, help="where compressed PTX is kept and reused (default OUT/ptx)")
    st.add_argument(
        "--out",
        default="reports/static-latest",
        help="writes OUT/static.json (schema fa4-audit/static/1) and OUT/static.md",
    )
    st.add_argument("--quiet", action="store_true")
    st.set_defaults(func=cmd_static)
