"""The header every report records besides its results: when it was made, the command that made
it, and the environment it ran in.  One function, so that ``run``, ``static``, ``ex2``,
``fidelity`` and ``invariance`` reports say these things alike."""

from __future__ import annotations

import datetime as dt
import shlex
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version

import torch

from audits.common import environment
from audits.engine.journal import package_version

__all__ = [
    "AUDITED_PACKAGES",
    "audited_versions",
    "command_line",
    "now",
    "report_header",
    "run_environment",
    "versions_line",
]


def now() -> str:
    """The current UTC time, to the second, in ISO 8601 (a report's ``created``)."""
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def command_line(argv: Sequence[str]) -> str:
    """The ``fa4-audit`` command that made a report, its arguments shell-quoted."""
    return "fa4-audit " + " ".join(shlex.quote(a) for a in argv)


#: the packages whose versions every case-runner report records besides fa4-audit's own: the
#: production kernel, its compiler, and torch (which every kernel and the references run on)
AUDITED_PACKAGES = ("flash-attn-4", "nvidia-cutlass-dsl", "torch")


def _installed(dist: str) -> str | None:
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def audited_versions() -> dict[str, str | None]:
    """The versions a report was audited with: ``fa4-audit`` (:func:`package_version`) and each
    of :data:`AUDITED_PACKAGES` (its distribution metadata; torch's own ``__version__``, which
    builds without metadata also have); None for a package not installed (a CPU machine has no
    flash-attn-4: absent, not an error)."""
    found = {d: _installed(d) for d in AUDITED_PACKAGES}
    found["torch"] = torch.__version__
    return {"fa4-audit": package_version(), **found}


def run_environment(device: torch.device) -> dict:
    """The environment a case-runner report records: ``audits.common.environment``, this
    package's version (``fa4_audit``: ``merge`` refuses shards made by another version) and the
    audited ``versions`` (:func:`audited_versions`)."""
    return {**environment(device), "fa4_audit": package_version(), "versions": audited_versions()}


def versions_line(environment: dict | None) -> str:
    """The audited versions of a report's ``environment`` in one line (report.md, ``show``):
    "versions: fa4-audit 0.1.0, flash-attn-4 not installed, ..."; a report made before they were
    recorded says so."""
    got = (environment or {}).get("versions")
    if not isinstance(got, dict):
        return "versions: not recorded (a report made before fa4-audit recorded them)"
    return "versions: " + ", ".join(f"{k} {v if v is not None else 'not installed'}" for k, v in got.items())


def report_header(argv: Sequence[str], *, device: torch.device | None = None) -> dict:
    """``created`` and ``command`` (from ``argv``, the arguments after ``fa4-audit``), and with a
    ``device`` the ``environment`` it ran in (:func:`run_environment`)."""
    head = {"created": now(), "command": command_line(argv)}
    if device is not None:
        head["environment"] = run_environment(device)
    return head
