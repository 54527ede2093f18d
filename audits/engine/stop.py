"""Why a run ended before its last selected case: one enum for the engine, the reports and the
command line.  The value is what a report's ``summary.stopped`` holds (a ``str`` enum, so that it
serializes as that text and compares equal to it)."""

from __future__ import annotations

import enum

__all__ = ["StopReason"]


class StopReason(enum.StrEnum):
    """A report's ``summary.stopped`` (None when every selected case ran)."""

    INTERRUPTED = "interrupted"  # Ctrl-C
    BUDGET = "budget"  # run --budget ran out: no case starts after it
    EXITFIRST = "exitfirst"  # -x stopped at the first failing case
    UNFINISHED = "unfinished"  # a --jobs child ended without finishing its cases
    JOURNAL = "journal"  # a report read from a journal: the run was stopped, or is still going

    @property
    def words(self) -> str:
        """The reason in a report's words."""
        return _WORDS[self]


_WORDS = {
    StopReason.INTERRUPTED: "interrupted (Ctrl-C)",
    StopReason.BUDGET: "the --budget ran out",
    StopReason.EXITFIRST: "stopped at the first failing case (-x)",
    StopReason.UNFINISHED: "cases did not finish (a job died)",
    StopReason.JOURNAL: "read from its journal: the run was stopped, or is still going",
}
