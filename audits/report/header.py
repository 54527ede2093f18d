"""The header every report records besides its results: when it was made, the command that made
it, and the environment it ran in.  One function, so that ``run``, ``static``, ``ex2``,
``fidelity`` and ``invariance`` reports say these things alike."""

from __future__ import annotations

import copy
import datetime as dt
import shlex
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version

import torch

from audits.common import environment
from audits.engine.journal import package_version
from audits.kernels import base_kernel, kernel_versions, release_dir
from fa4.releases import release_note

__all__ = [
    "AUDITED_PACKAGES",
    "audited_versions",
    "command_line",
    "kernel_environment",
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


def kernel_environment(*, environment: dict, kernel: str) -> dict:
    """``environment`` (:func:`run_environment`, the audit process's) as kernel ``kernel``'s
    report records it: an ``fa4@DIR`` kernel ran DIR's flash-attn-4 (and the compiler DIR holds,
    if any: ``audits.kernels.kernel_versions``), not this process's, and its DIR is recorded
    (``flash_attn_dir``); a production kernel on a release no bit-faithful claim was verified
    against gets ``release_note`` (``fa4.releases.release_note``).  A copy; idempotent, so that
    a report rebuilt from its journal or merged says the same, and a report rebuilt where DIR is
    gone keeps the versions it recorded."""
    env = copy.deepcopy(environment)
    if not isinstance(env, dict) or base_kernel(kernel) != "fa4" or not isinstance(env.get("versions"), dict):
        return env
    if release_dir(kernel) is not None:
        try:
            env["versions"].update(kernel_versions(kernel))
            env["flash_attn_dir"] = str(release_dir(kernel))
        except ValueError:
            pass  # DIR no longer holds the release: what the report recorded stands
    note = release_note(env["versions"].get("flash-attn-4"))
    if note:
        env["release_note"] = note
    else:
        env.pop("release_note", None)
    return env


def versions_line(environment: dict | None) -> str:
    """The audited versions of a report's ``environment`` in one line (report.md, ``show``):
    "versions: fa4-audit 0.1.0, flash-attn-4 not installed, ..."; a report made before they were
    recorded says so; a production release outside the verified ones carries its note
    (:func:`kernel_environment`)."""
    got = (environment or {}).get("versions")
    if not isinstance(got, dict):
        return "versions: not recorded (a report made before fa4-audit recorded them)"
    line = "versions: " + ", ".join(f"{k} {v if v is not None else 'not installed'}" for k, v in got.items())
    note = (environment or {}).get("release_note")
    return f"{line} (note: {note})" if note else line


def report_header(argv: Sequence[str], *, device: torch.device | None = None) -> dict:
    """``created`` and ``command`` (from ``argv``, the arguments after ``fa4-audit``), and with a
    ``device`` the ``environment`` it ran in (:func:`run_environment`)."""
    head = {"created": now(), "command": command_line(argv)}
    if device is not None:
        head["environment"] = run_environment(device)
    return head
