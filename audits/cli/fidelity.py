"""``fa4-audit fidelity``: the model against production on identical inputs.  The cases are
selected as ``run`` selects them (``audits.suites.selection``): the fidelity list is filtered to the
production kernel's declared domain narrowed by ``--domain FILE``, and the report (``domain``)
and the summary say how many of its cases lay outside."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console

from audits.cli.run_options import IN_PROCESS_NOTE, add_timeout_argument, timeout_setting
from audits.common import EXIT_FAIL, EXIT_OK, UsageError, atomic_write, progress
from audits.common import device as _device
from audits.common import environment as _environment
from audits.engine.worker import Isolated
from audits.kernels import get_kernel
from audits.report.header import command_line, now
from fa4.production import ProductionUnavailable, flash_attn, require_production


def _production(spec: str):
    """The kernel to compare with: production (``fa4``, exit 2 where it cannot run) or any kernel."""
    if spec == "fa4":
        try:
            require_production()
        except ProductionUnavailable as exc:
            raise UsageError(f"fidelity compares with the production kernel, which is unavailable: {exc}") from exc
        return flash_attn
    try:
        return get_kernel(spec)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc


def _run_cases(cases, production, device, quiet: bool, mma: str = "exact", unfinished=None) -> list[dict]:
    """Each case's result (``audits.checks.fidelity.core.run_cases``) under a progress bar; a case
    that timed out or crashed goes into ``unfinished`` instead."""
    # lazy: the fidelity check loads the forward model and numba (about 0.3 s), which the parser,
    # built for every fa4-audit command, must not pay
    from audits.checks.fidelity import core as fidelity

    with progress(Console(stderr=True), quiet=quiet) as bar:
        task = bar.add_task("fidelity", total=len(cases))
        results, gone = fidelity.run_cases(cases, production, device, mma=mma, advance=lambda: bar.advance(task))
    unfinished.extend(gone)
    return results


def _in_worker(args, production, device):
    """(the production kernel, run in a worker process under ``--timeout`` when it is given
    above 0, and that worker to close; else the kernel itself and None)."""
    timeout, explicit = timeout_setting(args)
    if not (explicit and timeout):
        return production, None
    iso = Isolated(args.production, device, timeout=timeout)
    return iso, iso


def _outside(sel) -> int:
    """How many cases of the selected fixed list lay outside the domain it was filtered to: the
    fidelity list is filtered, not built, within the production kernel's declared domain narrowed
    by ``--domain`` (``audits.suites.selection``, ``audits.suites.cases.build_suite``); 0 when no domain
    restricted it or the cases were given."""
    return int((sel.domain_info or {}).get("cases_outside", 0))


def cmd_fidelity(args: argparse.Namespace) -> int:
    # lazy: the fidelity check loads the forward model and numba (about 0.3 s), which the parser,
    # built for every fa4-audit command, must not pay
    from audits.checks.fidelity import core as fidelity
    from audits.checks.fidelity.mufu import measure_mufu
    from audits.cli.options import selection_from_args

    if args.cases is not None:  # the old spelling: the same glob, now over names and labels alike
        print("fa4-audit fidelity: --cases is deprecated; use --case GLOB", file=sys.stderr)
        if args.case is not None:
            raise UsageError(f"--cases {args.cases!r} and --case {args.case!r}: give the glob once, as --case")
        args.case = args.cases
    if args.production == "fa4" and args.device != "cuda":  # before anything is loaded
        raise UsageError(
            f"--device {args.device}: fidelity compares the model with the production kernel (fa4), which runs on "
            "CUDA only: pass --device cuda (or --production KERNEL to compare the model with another kernel here)"
        )
    device = _device(args.device)
    if args.mufu and device.type != "cuda":  # before any case runs
        raise UsageError("--mufu measures the GPU's MUFU.EX2: it needs --device cuda and the production package")
    production = _production(args.production)
    sel = selection_from_args(args, kernels=[args.production])
    labels = {c: n for n, c in fidelity.CASES.items()}  # the fidelity suite's labels; other cases by name
    cases = [(labels.get(c, c.name), c) for c in sel.cases]
    production, worker = _in_worker(args, production, device)
    unfinished: list[dict] = []
    try:
        results = _run_cases(cases, production, device, args.quiet, args.mma, unfinished)
    finally:
        if worker is not None:
            worker.close()
    if not results:  # every case timed out or crashed: no figure to summarize
        for u in unfinished:
            print(f"{u['verdict'].upper()} {u['case']}: {u['reason']}")
        print(f"fidelity: none of {len(cases)} cases finished", file=sys.stderr)
        return EXIT_FAIL
    report = {
        "schema": "fa4-audit/fidelity/1",
        "command": command_line(args.argv),
        "created": now(),
        "environment": ", ".join(f"{k} {v}" for k, v in _environment(device).items()),
        "production": args.production,
        "suite": sel.label,
        "summary": fidelity.summarize(results),
        "results": results,
        "unfinished": unfinished,  # cases whose production call timed out or crashed (--timeout)
    }
    outside = _outside(sel)
    if sel.domain_info is not None:  # the domain the selection was built in (audits.suites.selection), as run's report
        report["domain"] = {**sel.domain_info, "cases_outside": outside}
    if args.mufu:
        report["mufu_ex2_vs_model"] = fidelity.mufu_vs_model(device)
        report["mufu_accuracy"] = measure_mufu(device)
    out = Path(args.out)
    atomic_write(out / "fidelity.json", json.dumps(report, separators=(",", ":")) + "\n")
    atomic_write(out / "fidelity.md", fidelity.markdown(report))
    s = report["summary"]
    print(
        f"{s['cases_ok']}/{s['cases']} cases ok; {100 * s['fraction_within_1']:.3f}% of outputs identical "
        f"or 1 ULP apart ({100 * s['fraction_identical']:.3f}% identical), {s['outputs']['>2']} beyond 2 ULP; "
        f"LSE {100 * s['lse_fraction_identical']:.3f}% identical; report: {out / 'fidelity.md'}"
    )
    if outside:
        print(
            f"{outside} case(s) of {sel.label!r} lie outside the kernels' domain (declared, narrowed by --domain) "
            "and were not run (report: domain)"
        )
    for u in unfinished:
        print(f"{u['verdict'].upper()} {u['case']}: {u['reason']}")
    return EXIT_OK if s["cases_ok"] == s["cases"] and not unfinished else EXIT_FAIL


def register(sub) -> None:
    """Add this audit's subcommands to the ``fa4-audit`` parser."""
    from audits.cli.options import add_case_arguments

    f = sub.add_parser(
        "fidelity",
        help="compare the SM90 numerics model with the production kernel on identical inputs",
        description="Run production flash_attn_func (its SM90 path on Hopper) and fa4.model with "
        "FA4Numerics.sm90 on the same inputs; report the output differences in ULPs, the LSE "
        "difference and both errors against FP64, on the fidelity suite (or any other selection).  Exit 1 "
        "when a case has fewer than 99% of its outputs identical or 1 ULP apart, 2 for usage errors (the "
        "production kernel needs --device cuda).",
    )
    f.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="where the kernels run (default cpu, as everywhere; the production kernel fa4 needs --device cuda)",
    )
    f.add_argument(
        "--production",
        default="fa4",
        help="the kernel to compare: fa4 (production), another kernel name, or module:attr",
    )
    add_case_arguments(f, default_suite="fidelity")
    f.add_argument("--cases", default=None, help=argparse.SUPPRESS)  # deprecated spelling of --case
    f.add_argument("--out", default="reports/fidelity-latest", help="report directory")
    f.add_argument(
        "--mufu",
        action="store_true",
        help="also compare MUFU.EX2 with the model's hardware exp2 over all 2^32 inputs (cuda)",
    )
    f.add_argument(
        "--mma",
        default="exact",
        choices=["exact", "tensor_core"],
        help="the model's MMA summation: exact products summed and rounded once (default), or the "
        "tensor cores' as measured on the H200 (numerics.tensor_core, docs/tensor-cores.md)",
    )
    f.add_argument("--quiet", action="store_true", help="no progress bar")
    add_timeout_argument(f, note=IN_PROCESS_NOTE)
    f.set_defaults(func=cmd_fidelity)
