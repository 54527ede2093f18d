"""``fa4-audit invariance``: batch, decode, split-KV, paged-KV and pack_gqa invariance of a kernel
on out and LSE (``audits.checks.invariance.core``), measured and, with a model, predicted; one report per
kernel; results on stdout, progress on stderr.  The cases are selected as ``run`` selects them
(``audits.suites.selection``: suites built inside the kernels' declared domain, narrowed by ``--domain``),
and each property places its derived calls inside the kernel's domain (``audits.checks.invariance.core``).
Exit 0 when every required property holds wherever applicable and something was compared, 1 when
a required property differs (or errors), when a required property made no comparison (it says
why), or nothing was compared, 2 for usage errors."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path

from rich.console import Console

from audits.checks.invariance.properties import ALL_PROPERTIES, MOD_PROPERTIES, PROPERTIES
from audits.cli.run_options import IN_PROCESS_NOTE, add_timeout_argument, timeout_setting
from audits.common import EXIT_FAIL, EXIT_OK, UsageError, atomic_write, progress
from audits.common import device as _device
from audits.common import environment as _environment
from audits.kernels import usable_kernels
from audits.report.header import command_line, now


def _required(text: str | None) -> list[str]:
    names = [n.strip() for n in (text or "").split(",") if n.strip()]
    bad = [n for n in names if n not in ALL_PROPERTIES]
    if bad:
        raise UsageError(
            f"--require {text!r}: unknown property {', '.join(bad)}; accepted: {', '.join(ALL_PROPERTIES)}"
        )
    return list(dict.fromkeys(names))


def _properties(args) -> dict:
    """The properties to run: the default five, with ``--mods`` the mod properties too, and any
    ``--require``'d mod property (a gate on a property not run would compare nothing)."""
    want = set(PROPERTIES) | set(_required(args.require))
    if getattr(args, "mods", False):
        want |= set(ALL_PROPERTIES)
    return {p: d for p, d in ALL_PROPERTIES.items() if p in want}


def _out_dir(out: Path, kern: str, several: bool) -> Path:
    return out / re.sub(r"[^A-Za-z0-9_.-]+", "_", kern).strip("_") if several else out


def _targets(kernels: list[str], predict: str | None) -> list[tuple]:
    """(kernel target, model target or None) per kernel: ``--predict none`` turns prediction
    off, a name sets the model of every kernel (none for the model itself), absent: each
    kernel's default (``core.default_model``)."""
    from audits.checks.invariance import core  # lazy: see audits.cli

    out = []
    for kern in kernels:
        try:
            model = core.default_model(kern) if predict is None else (None if predict == "none" else predict)
            if model is not None and model != kern:
                try:
                    usable_kernels([model])
                except UsageError as exc:
                    raise UsageError(f"--predict {model}: {exc}") from exc
            out.append((core.target(kern), None if model in (None, kern) else core.target(model)))
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
    return out


def _within(targets: list[tuple], narrow) -> list[tuple]:
    """The targets with their declared domains narrowed by the ``--domain`` file's domain
    (``narrow``, as the selection read it; None: none given): the properties place their derived
    calls inside it, and a given case outside it is the kernel's ``skipped`` case."""
    if narrow is None:
        return targets
    return [
        tuple(None if t is None else dataclasses.replace(t, domain=t.domain.narrow(narrow)) for t in pair)
        for pair in targets
    ]


def _in_workers(args, targets: list, device) -> tuple[list, list]:
    """(the targets, each run in a worker process under ``--timeout`` when it is given above 0,
    else as they are; the workers to close): a call in this process could not be stopped."""
    from audits.checks.invariance import core  # lazy: see audits.cli

    timeout, explicit = timeout_setting(args)
    if not (explicit and timeout):
        return targets, []
    pairs = [(None, None) if t is None else core.in_worker(t, device, timeout) for t in targets]
    return [t for t, _ in pairs], [w for _, w in pairs if w is not None]


def _run_kernel(args, t, model, cases, label: str, device, meta: dict) -> dict:
    """The report of kernel ``t`` (``audits.checks.invariance.core.audit_kernel``) under a
    progress bar, its calls in worker processes under ``--timeout``."""
    from audits.checks.invariance import core  # lazy: see audits.cli

    limit, workers = _in_workers(args, [t, model], device)
    t, model = limit
    try:
        with progress(Console(stderr=True), quiet=args.quiet) as bar:
            task = bar.add_task(f"invariance {t.name} / {label}", total=len(cases))
            return core.audit_kernel(
                t,
                cases,
                device=device,
                model=model,
                properties=_properties(args),
                required=_required(args.require),
                suite=label,
                meta=meta,
                advance=lambda: bar.advance(task),
            )
    finally:
        for w in workers:
            w.close()


def cmd_invariance(args: argparse.Namespace) -> int:
    from audits.checks.invariance.report import markdown  # lazy: see audits.cli
    from audits.cli.options import selection_from_args

    _required(args.require)
    kernels = usable_kernels(args.kernel)
    targets = _targets(kernels, args.predict)
    sel = selection_from_args(args, kernels=kernels)
    targets = _within(targets, sel.narrowing)
    cases, label = sel.cases, sel.label
    device = _device(args.device)
    meta = {
        "command": command_line(args.argv),
        "created": now(),
        "environment": ", ".join(f"{k} {v}" for k, v in _environment(device).items()),
    }
    if sel.domain_info is not None:
        meta["domain"] = sel.domain_info  # the domain the suite was built in (audits.suites.selection)
    code = EXIT_OK
    for t, model in targets:
        report = _run_kernel(args, t, model, cases, label, device, meta)
        d = _out_dir(Path(args.out), t.name, len(kernels) > 1)
        atomic_write(d / "invariance.json", json.dumps(report, indent=1) + "\n")
        atomic_write(d / "invariance.md", markdown(report))
        _print_summary(report, d)
        if not report["summary"]["passed"]:
            code = EXIT_FAIL
            if not report["summary"]["compared"]:
                print(f"{t.name}: nothing was compared: every property was skipped or not applicable", file=sys.stderr)
    return code


def _print_summary(report: dict, d: Path) -> None:
    from audits.checks.invariance.report import cell  # lazy: see audits.cli

    s = report["summary"]
    kern = report["kernel"]
    pred = s.get("prediction")
    for p, n in s["counts"].items():
        req = " (required)" if p in s["required"] else ""
        print(
            f"{kern} {p}{req}: {n['holds']} hold, {n['differs']} differ, {n['not applicable']} n.a., "
            f"{n['skipped']} skipped, {n['error']} error, {n['timeout']} timeout"
        )
        if pred:
            a = pred["per_property"][p]
            print(
                f"  predicted by {pred['model']}: {a['agree']} agree, {a['disagree']} disagree, "
                f"{a['not compared']} not compared"
            )
        if p in s.get("uncompared", {}):  # required, compared nowhere: fails the run
            print(f"  FAIL {p}: {s['uncompared'][p]}")
        for r in report["cases"]:
            res = r["properties"][p]
            if res["result"] in ("differs", "error", "timeout") and p in s["required"]:
                print(f"  {res['result'].upper()} {r['case']}: {cell(res)}")
    if pred:
        for x in pred["disagreements"]:
            print(f"  DISAGREE {x['case']} {x['property']}: measured {x['measured']}, predicted {x['predicted']}")
    none = s.get("uncompared", {})
    failing = [f"{p}: 0 comparisons" if p in none else p for p in s["failing"]]
    verdict = "pass" if s["passed"] else "FAIL (" + (", ".join(failing) or "nothing compared") + ")"
    print(f"{kern}: {verdict} in {report['seconds']:.1f} s; report: {d / 'invariance.md'}")


def register(sub) -> None:
    """Add ``invariance`` to the ``fa4-audit`` parser."""
    from audits.cli.options import add_case_arguments

    r = sub.add_parser(
        "invariance",
        help="batch, decode, split-KV, paged-KV and pack_gqa invariance of a kernel on out and LSE",
        description="For each case: a sequence alone vs inside the batch (the batch reversed; varlen: beside "
        "shorter sequences); the last rows alone vs inside the prefill; for a kernel with a varlen entry also "
        "num_splits 1 vs N (holds when within the forward bound), paged vs contiguous KV and pack_gqa on vs off; "
        "bitwise on out and LSE otherwise.  Each property holds, differs (count, steps, error against FP64, "
        "bound), is not applicable (why) or skipped; --predict runs the same on a model beside it.  Writes "
        "OUT/invariance.{json,md} (OUT/<kernel>/ with several kernels).  Exit 0 when every --require'd property "
        "holds, each compared on at least one case, 1 otherwise (a required property compared nowhere says why), 2 "
        "for usage errors.  Cases are built inside the kernel's declared domain (narrowed by --domain), as run builds "
        "them.",
    )
    r.add_argument(
        "--kernel",
        required=True,
        action="append",
        help="a kernel name (fa4-model, sdpa-math, ...), module:attr or path/to/file.py:fn; repeatable",
    )
    add_case_arguments(r, default_suite="smoke")
    r.add_argument(
        "--require",
        default=None,
        help=f"comma-separated properties that gate the exit code ({', '.join(ALL_PROPERTIES)}); "
        "the others are reported only (a required mod property is run without --mods)",
    )
    r.add_argument(
        "--mods",
        action="store_true",
        help=f"also run the mod properties ({', '.join(MOD_PROPERTIES)}: block-sparse vs dense, mask_mod / "
        "score_mod vs the causal / window / softcap flags; docs/invariance.md)",
    )
    r.add_argument(
        "--predict",
        default=None,
        metavar="MODEL",
        help="run the same properties on MODEL (a kernel name) with the same inputs and report its "
        "verdicts beside the measured ones; 'none': no prediction; default: for fa4 the model of this "
        "machine's production arch (fa4-model-sm90 on Hopper, fa4-model otherwise), none for "
        "others",
    )
    r.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the kernels run (default cpu)")
    r.add_argument(
        "--out", default="reports/invariance-latest", help="report directory (default reports/invariance-latest)"
    )
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    add_timeout_argument(r, note=IN_PROCESS_NOTE)
    r.set_defaults(func=cmd_invariance)
