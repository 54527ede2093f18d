"""The header every report records besides its results: when it was made, the command that made
it, and the environment it ran in.  One function, so that ``run``, ``static``, ``ex2``,
``fidelity`` and ``invariance`` reports say these things alike."""

from __future__ import annotations

import datetime as dt
import shlex
from collections.abc import Sequence

import torch

from audits.common import environment
from audits.engine.journal import package_version

__all__ = ["command_line", "now", "report_header", "run_environment"]


def now() -> str:
    """The current UTC time, to the second, in ISO 8601 (a report's ``created``)."""
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def command_line(argv: Sequence[str]) -> str:
    """The ``fa4-audit`` command that made a report, its arguments shell-quoted."""
    return "fa4-audit " + " ".join(shlex.quote(a) for a in argv)


def run_environment(device: torch.device) -> dict:
    """The environment a case-runner report records: ``audits.common.environment`` and this
    package's version (``merge`` refuses shards made by another version)."""
    return {**environment(device), "fa4_audit": package_version()}


def report_header(argv: Sequence[str], *, device: torch.device | None = None) -> dict:
    """``created`` and ``command`` (from ``argv``, the arguments after ``fa4-audit``), and with a
    ``device`` the ``environment`` it ran in (:func:`run_environment`)."""
    head = {"created": now(), "command": command_line(argv)}
    if device is not None:
        head["environment"] = run_environment(device)
    return head
