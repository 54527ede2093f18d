"""One audit run, whoever asks for it (``audits.api.audit``, ``fa4-audit run``, a ``--jobs`` child, the
pytest fixture): kernels, cases and :class:`~audits.engine.options.RunOptions` in, a :class:`Report`
out.  It evaluates in this process (``audits.engine.run.run_suites``) or, with ``jobs`` > 1,
through the process pool (``audits.engine.jobs``); writing the reports and printing are the
caller's."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass

from audits.common import EXIT_INTERRUPTED
from audits.engine.jobs import run_jobs
from audits.engine.options import RunOptions
from audits.engine.run import run_suites
from audits.engine.stop import StopReason
from audits.report.build import build_report, exit_code
from audits.report.header import now, run_environment
from audits.suites.cases import Case
from audits.verdict.known import apply_known

__all__ = ["Report", "run_audit", "kept_coverage"]


@dataclass
class Report:
    """What a run gives back: per kernel its case records in case order (``records``) and its
    report (``reports``: the ``report.json`` schema, not yet written), how many cases were
    selected, and why the run ended before its last case (None: every selected case ran)."""

    records: dict[str, list[dict]]
    reports: dict[str, dict]
    selected: int
    stopped: StopReason | None = None

    @property
    def exit_code(self) -> int:
        """The run's exit code (``audits.report.build.exit_code``, the worst kernel's; 130 for an
        interrupted run in which nothing failed)."""
        code = max((exit_code(r) for r in self.reports.values()), default=0)
        return EXIT_INTERRUPTED if self.stopped == StopReason.INTERRUPTED and code != 1 else code


def kept_coverage(bases: dict[str, dict]) -> dict[str, dict]:
    """Coverage bases (``{"domain": Domain, "arch": ...}`` per kernel) as JSON keeps them (a
    journal's header, a job file; ``audits.verdict.coverage.basis_of_coverage`` reads them back)."""
    return {k: {"domain": b["domain"].as_dict(), "arch": b["arch"]} for k, b in bases.items()}


def _head(options: RunOptions, header: dict | None) -> dict:
    """The report header: ``header``'s fields (created, command, environment, ...) over the defaults
    of a run made through the API, the options' device, thresholds and shard; as JSON holds it."""
    head = {"created": None, "command": "audits.api.audit", "environment": None, **(header or {})}
    if head["created"] is None:
        head["created"] = now()
    if head["environment"] is None:  # merge refuses shards of other versions
        head["environment"] = run_environment(options.torch_device)
    head |= {"device": options.device, "thresholds": options.thresholds, "shard": options.shard}
    return json.loads(json.dumps(head, default=str))  # as a journal line holds it (a TOML date as text)


def run_audit(
    kernels: list[str],
    cases: list[Case],
    options: RunOptions,
    *,
    header: dict | None = None,
    coverage: dict[str, dict] | None = None,
    progress: Callable[[str, dict], None] | None = None,
    started: float | None = None,
) -> Report:
    """Audit ``kernels`` on ``cases`` under ``options``.  ``header``: the reports' created, command and
    environment (``audits.report.header.report_header``; defaults: now, "audits.api.audit", this
    process's); ``coverage``: each kernel's coverage basis, its domain and arch (None: the kernel's
    own, read when the run starts and when its report is built); its domain is the one cases are
    judged in (outside it: ``skipped``); ``progress(kernel, record)`` after each case; ``started``
    (``time.monotonic()``, default now): where ``options.budget`` counts from.  Ctrl-C ends the
    run with the cases so far (``stopped``: interrupted); a journal of another run under
    ``options.resume`` raises ``audits.engine.journal.JournalMismatch``."""
    started = time.monotonic() if started is None else started
    head = _head(options, header)
    kept = None if coverage is None else kept_coverage(coverage)
    if options.jobs > 1:
        runs = run_jobs(kernels, cases, options, header=head, coverage=kept or {}, progress=progress)
    else:
        deadline = None if options.budget is None else started + 60.0 * options.budget
        extra = {"report": head} | ({} if kept is None else {"coverage": kept})
        # the domain each kernel's cases are judged in: the one its coverage basis holds (resolved by the
        # case selection, narrowed by --domain; a --jobs child reads it from its job file), else its own
        domains = None if coverage is None else {k: b["domain"] for k, b in coverage.items()}
        runs = run_suites(
            kernels,
            cases,
            options,
            progress=progress,
            deadline=deadline,
            journal_extra=extra,
            catch_interrupt=True,
            domains=domains,
        )
    reports = {}
    for kern, records in runs.items():
        missing = len(cases) - len(records)
        reports[kern] = build_report(
            kernel=kern,
            suite=options.label,
            seed=options.seed,
            records=records,
            selected=len(cases),
            stopped=(runs.stopped or StopReason.UNFINISHED) if missing else None,
            coverage_basis=None if coverage is None else coverage[kern],
            backward=options.backward is not None,
            **head,
        )
        if options.known is not None:  # known defects: their cases get the verdict known (audits.verdict.known)
            reports[kern] = apply_known(report=reports[kern], known=options.known, strict=options.strict_known)
    return Report(records=dict(runs), reports=reports, selected=len(cases), stopped=runs.stopped)
