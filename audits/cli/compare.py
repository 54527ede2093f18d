"""``fa4-audit compare``: a baseline kernel and one or more candidates on one case list, the same
inputs handed to each (docs/compare.md).  Each kernel gets its report as ``run`` writes it
(OUT/<kernel>/); OUT/compare.{json,md,html} say what changed: bit-identical cases, ULP distances
and where, verdict, tightness and non-finite changes.  Exit 1 on a regression
(``audits.report.compare``), or when nothing was compared; 3 when the run stopped before its
last case with no regression; 0 otherwise; 2 for usage errors."""

from __future__ import annotations

import argparse
import sys

from audits.cli.run import add_run_arguments, audit_run, prepare_run, report_runs
from audits.common import EXIT_FAIL, EXIT_INCOMPLETE, EXIT_INTERRUPTED, EXIT_OK, UsageError, finishing
from audits.engine.stop import StopReason
from audits.report.compare import compare_reports, summary_lines, write_comparison
from audits.verdict.gate import require_compare

__all__ = ["register", "cmd_compare"]


def cmd_compare(args: argparse.Namespace) -> int:
    kernels = list(dict.fromkeys(args.kernel))
    if len(kernels) < 2:
        raise UsageError(
            f"compare needs a baseline and at least one candidate, got {', '.join(kernels)}: "
            "--kernel BASELINE --kernel CANDIDATE [--kernel CANDIDATE ...] (the first is the baseline)"
        )
    args.kernel = kernels
    kernels, cases, options, header = prepare_run(args)
    try:
        require_compare(options.thresholds)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    options = options.replace(baseline=kernels[0])
    report = audit_run(kernels, cases, options, header)
    with finishing("the reports"):
        report_runs(args, report)  # each kernel's own report, as run writes it (its exit code is run's, not ours)
        versions = {k: (rep.get("environment") or {}).get("versions") or {} for k, rep in report.reports.items()}
        comparisons = compare_reports(
            report.reports, baseline=kernels[0], thresholds=options.thresholds, versions=versions
        )
        head = {k: header["report"].get(k) for k in ("created", "command")}
        paths = write_comparison(args.out, comparisons, header=head)
    for c in comparisons:
        for line in summary_lines(c):
            print(line)
    print(f"comparison: {paths['md']}")
    if any(c.regressions for c in comparisons):
        return EXIT_FAIL
    if not any(c.compared for c in comparisons):
        print("compare: nothing was compared: no case ran on both the baseline and a candidate", file=sys.stderr)
        return EXIT_FAIL
    if report.stopped == StopReason.INTERRUPTED:
        return EXIT_INTERRUPTED
    return EXIT_INCOMPLETE if report.stopped is not None else EXIT_OK


def register(sub) -> None:
    """Add ``compare`` to the ``fa4-audit`` parser."""
    r = sub.add_parser(
        "compare",
        help="a baseline kernel against candidates on the same inputs: bit-identical or how and where they differ",
        description="Run every case for a baseline kernel (the first --kernel) and each candidate on the same "
        "inputs; write each kernel's report (OUT/<kernel>/report.*) and OUT/compare.{json,md,html}: per case "
        "bit-identical or how outputs, LSE and gradients differ (ULP histogram, largest distance, where), each "
        "side's verdict, bound tightness and FA-criterion margin.  Exit 1 on a regression (a verdict worse, a "
        "tightness worse by more than [compare] tightness_ratio, a NaN/inf where the baseline is finite, a case "
        "the candidate refuses that the baseline ran) or when nothing was compared, 3 when the run stopped early, "
        "0 otherwise, 2 for usage errors.",
    )
    r.add_argument(
        "--kernel",
        required=True,
        action="append",
        help="the baseline first, then each candidate: fa4, fa4@DIR (another flash-attn-4 installed with "
        "pip install --target DIR), fa4-model, fa4-model:knob=value[,knob=value] (a model variant), sdpa-*, flex, "
        "module:attr or path/to/file.py:fn",
    )
    add_run_arguments(r)
    r.set_defaults(func=cmd_compare)
