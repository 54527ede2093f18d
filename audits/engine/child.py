"""A ``run --jobs`` child: ``python -m audits.engine.child OUT/jobs/I/job.json`` (``audits.engine.jobs``
writes the file).  It runs its compile-key shard of the parent's cases under the options the file
holds, writes its report(s) into its folder and says so on stdout (its ``log.txt``).

Exit codes as ``fa4-audit run``'s: 0 pass, 1 a case failed, 3 stopped before its last case (its
``budget``), 130 interrupted; 2 when it refuses its work (a journal of another run under
``resume``), its reason on the last line of the log."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

from audits.common import EXIT_USAGE, finishing
from audits.engine.audit import run_audit
from audits.engine.journal import JournalMismatch
from audits.engine.options import RunOptions
from audits.engine.run import kernel_dir
from audits.engine.shards import parse_shard, shard_cases
from audits.report.build import summary_line, write_report
from audits.suites.case import cases_from_file
from audits.verdict.coverage import basis_of_coverage

__all__ = ["run_job", "main"]


def run_job(path: str | Path) -> int:
    """Run the job file ``path``; the exit code (module doc)."""
    job = json.loads(Path(path).read_text())
    options = RunOptions.from_dict(job["options"])
    cases = list(dict.fromkeys(cases_from_file(job["cases"])))
    i, n = parse_shard(options.shard)
    whole = {c.name: k for k, c in enumerate(cases)}
    cases = shard_cases(cases, i, n, by="key")
    coverage = {k: basis_of_coverage(b) for k, b in job["coverage"].items()} or None
    try:
        report = run_audit(job["kernels"], cases, options, header=job["header"], coverage=coverage)
    except JournalMismatch as exc:
        print(f"fa4-audit run: error: --resume refused: {exc}", file=sys.stderr)
        return EXIT_USAGE
    several = len(report.reports) > 1
    with finishing("the report"):  # every case run is in the report, even when the parent's Ctrl-C comes now
        for kern, rep in report.reports.items():
            rep["shard_order"] = {r["case"]: whole[r["case"]] for r in rep["cases"]}
            paths = write_report(rep, kernel_dir(options.out, kern, several), maps=options.maps)
            print(f"{kern}: {summary_line(rep)}; report: {paths['md']}")
        return report.exit_code


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 1:
        print("usage: python -m audits.engine.child OUT/jobs/I/job.json", file=sys.stderr)
        return EXIT_USAGE
    return run_job(argv[0])


if __name__ == "__main__":  # pragma: no cover - a --jobs child process
    sys.exit(main())
