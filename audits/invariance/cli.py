"""``fa4-audit invariance``: batch and decode invariance of fixed-length kernels, bitwise on out
and LSE (``audits.invariance.core``); one report per kernel; results on stdout, progress on
stderr.  Exit 0 when every required property holds wherever applicable and something was
compared, 1 when a required property differs (or errors) or nothing was compared, 2 for usage
errors."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import re
import shlex
import sys
import time
from pathlib import Path

from audits.common import EXIT_FAIL, EXIT_OK, UsageError, atomic_write, progress
from audits.common import device as _device
from audits.common import environment as _environment

SCHEMA = "fa4-audit/invariance/1"


def _required(text: str | None) -> list[str]:
    from audits.invariance.core import PROPERTIES

    names = [n.strip() for n in (text or "").split(",") if n.strip()]
    bad = [n for n in names if n not in PROPERTIES]
    if bad:
        raise UsageError(f"--require {text!r}: unknown property {', '.join(bad)}; accepted: {', '.join(PROPERTIES)}")
    return list(dict.fromkeys(names))


def _cases(args: argparse.Namespace) -> tuple[list, str]:
    """(cases, label): ``--config`` cases, or a named suite (default smoke); then ``--case``."""
    import fnmatch

    from audits.cases import case_from_json, suite

    try:
        if args.config:
            if args.suite is not None:
                raise UsageError("--suite cannot be combined with --config: --config gives the cases themselves")
            cases = [case_from_json(t, where=f"--config #{i + 1}") for i, t in enumerate(args.config)]
            label = "config"
        else:
            label = args.suite or "smoke"
            cases = suite(label)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    if args.case:
        cases = [c for c in cases if fnmatch.fnmatch(c.name, args.case)]
        if not cases:
            raise UsageError(f"--case {args.case!r} matches no case of {label!r}")
    return list(dict.fromkeys(cases)), label


def _out_dir(out: Path, kern: str, several: bool) -> Path:
    return out / re.sub(r"[^A-Za-z0-9_.-]+", "_", kern).strip("_") if several else out


def cmd_invariance(args: argparse.Namespace) -> int:
    from rich.console import Console

    from audits.invariance import core
    from audits.kernels import fa4_numerics, get_kernel, kernel_domain, usable_kernels

    required = _required(args.require)
    kernels = usable_kernels(args.kernel)
    cases, label = _cases(args)
    device = _device(args.device)
    env = ", ".join(f"{k} {v}" for k, v in _environment(device).items())
    command = "fa4-audit " + " ".join(shlex.quote(a) for a in args.argv)
    created = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    code = EXIT_OK
    for kern in kernels:
        fn, domain, nmf = get_kernel(kern), kernel_domain(kern), fa4_numerics(kern)
        t0 = time.perf_counter()
        records = []
        with progress(Console(stderr=True), quiet=args.quiet) as bar:
            task = bar.add_task(f"invariance {kern} / {label}", total=len(cases))
            for c in cases:
                records.append(core.run_case(c, fn, device=device, bound_numerics=nmf, domain=domain))
                bar.advance(task)
        summary = core.summarize(records, required)
        report = {
            "schema": SCHEMA, "kernel": kern, "suite": label, "command": command, "created": created,
            "environment": env, "device": str(device), "seconds": round(time.perf_counter() - t0, 2),
            "properties": core.PROPERTIES, "summary": summary, "cases": records,
        }  # fmt: skip
        d = _out_dir(Path(args.out), kern, len(kernels) > 1)
        atomic_write(d / "invariance.json", json.dumps(report, indent=1) + "\n")
        atomic_write(d / "invariance.md", core.markdown(report))
        _print_summary(report, d)
        if not summary["passed"]:
            code = EXIT_FAIL
            if not summary["compared"]:
                print(f"{kern}: nothing was compared: every property was skipped or not applicable", file=sys.stderr)
    return code


def _print_summary(report: dict, d: Path) -> None:
    from audits.invariance.core import cell

    s = report["summary"]
    kern = report["kernel"]
    for p, n in s["counts"].items():
        req = " (required)" if p in s["required"] else ""
        print(f"{kern} {p}{req}: {n['holds']} hold, {n['differs']} differ, {n['not applicable']} n.a., "
              f"{n['skipped']} skipped, {n['error']} error")  # fmt: skip
        for r in report["cases"]:
            res = r["properties"][p]
            if res["result"] in ("differs", "error") and p in s["required"]:
                print(f"  {res['result'].upper()} {r['case']}: {cell(res)}")
    verdict = "pass" if s["passed"] else "FAIL (" + (", ".join(s["failing"]) or "nothing compared") + ")"
    print(f"{kern}: {verdict} in {report['seconds']:.1f} s; report: {d / 'invariance.md'}")


def register(sub) -> None:
    """Add ``invariance`` to the ``fa4-audit`` parser."""
    from audits.invariance.core import PROPERTIES

    r = sub.add_parser(
        "invariance",
        help="batch and decode invariance of a fixed-length kernel, bitwise on out and LSE",
        description="For each case: a sequence alone vs inside the batch (and the batch reversed); the last "
        "rows alone vs inside the prefill; bitwise on out and LSE.  Each property holds, differs (count, steps, "
        "error against FP64, bound), is not applicable (why) or skipped.  Writes OUT/invariance.{json,md} "
        "(OUT/<kernel>/ with several kernels).  Exit 0 when every --require'd property holds and something was "
        "compared, 1 otherwise, 2 for usage errors.",
    )
    r.add_argument(
        "--kernel", required=True, action="append",
        help="a kernel name (fa4-model, sdpa-math, ...), module:attr or path/to/file.py:fn; repeatable",
    )  # fmt: skip
    r.add_argument("--suite", default=None, help="a named suite: smoke (default), release, nightly")
    r.add_argument("--config", action="append", help="a case as JSON (Case fields; absent = default); repeatable")
    r.add_argument("--case", default=None, help="glob over case names")
    r.add_argument("--require", default=None,
                   help=f"comma-separated properties that gate the exit code ({', '.join(PROPERTIES)}); "
                   "the others are reported only")  # fmt: skip
    r.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    r.add_argument("--out", default="reports/invariance-latest",
                   help="report directory (default reports/invariance-latest)")  # fmt: skip
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    r.set_defaults(func=cmd_invariance)
