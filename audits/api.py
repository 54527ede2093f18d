"""The audit API: one call under every entry point (``fa4-audit run``, the pytest fixture, a script).

    from audits.api import RunOptions, audit
    from audits.suites.cases import suite

    report = audit(["fa4-model"], suite("smoke"), RunOptions(out="reports/mine", label="smoke"))
    report.reports["fa4-model"]["summary"]["verdicts"], report.stopped, report.exit_code

A search that drives one case at a time (``fa4-audit fuzz``, ``audits.checks.fuzz``) opens a kernel
once and evaluates each case as ``audit`` does:

    with open_session("fa4-model", RunOptions()) as s:
        record = s.evaluate(case)

Nothing is printed and no report file is written (``audits.report.build.write_report`` writes
one); the journal of the run is kept under ``options.out`` so that ``RunOptions(resume=True)``
continues it."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from audits.engine.audit import Report, run_audit
from audits.engine.options import RunOptions
from audits.engine.session import Session, open_session
from audits.engine.stop import StopReason
from audits.suites.cases import Case

__all__ = ["audit", "RunOptions", "Report", "StopReason", "Session", "open_session"]


def audit(
    kernels: str | Sequence[str],
    cases: Sequence[Case],
    options: RunOptions | None = None,
    *,
    header: dict | None = None,
    coverage: dict[str, dict] | None = None,
    progress: Callable[[str, dict], None] | None = None,
    started: float | None = None,
) -> Report:
    """Audit ``kernels`` (a name, ``module:attr`` or ``file.py:fn``, or several) on ``cases`` under
    ``options`` (default ``RunOptions()``): in this process, or with ``options.jobs`` > 1 through
    the process pool; the :class:`Report` (per kernel its records and report, why it stopped
    early).  ``header`` (created, command, environment of the reports), ``coverage`` (each
    kernel's coverage basis), ``progress`` and ``started``: ``audits.engine.audit.run_audit``."""
    kernels = [kernels] if isinstance(kernels, str) else list(kernels)
    options = RunOptions() if options is None else options
    return run_audit(
        kernels, list(cases), options, header=header, coverage=coverage, progress=progress, started=started
    )
