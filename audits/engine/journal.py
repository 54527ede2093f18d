"""The run journal: ``OUT/journal.jsonl``, one JSON line per finished case, flushed and fsynced,
so that ``--resume`` continues after a crash, a kill or Ctrl-C without redoing finished cases.

Its first line is a header naming what the records belong to (kernel, suite, seed, a digest of
the thresholds and of the case list, the fa4-audit version): resuming into another run's
journal would report one kernel's results as another's, so :func:`check_header` refuses it.
"""

from __future__ import annotations

import hashlib
import json
import os
import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from audits.report.schema import upgrade_case

__all__ = [
    "SCHEMA",
    "run_identity",
    "package_version",
    "thresholds_digest",
    "append",
    "read_records",
    "read_ordered",
    "AT",
    "read_header",
    "check_header",
    "JournalMismatch",
]

SCHEMA = "fa4-audit/journal/1"
#: a record's place in the run's case list, kept on its journal line only (a journal is written
#: in run order, stratified: ``audits.engine.shards.run_order``; a report lists suite order)
AT = "at"


class JournalMismatch(ValueError):
    """``--resume`` into a journal of another run; the message names every field that differs."""


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def package_version() -> str:
    """This fa4-audit's version: the installed distribution's, else (run from a source tree that
    was never installed, e.g. the H200 device's copy on ``PYTHONPATH``) the ``[project] version``
    of the ``pyproject.toml`` beside the package, the one source of the version; "unknown" only
    when neither exists (an unpacked copy of the modules alone)."""
    try:
        return version("fa4-audit")
    except PackageNotFoundError:
        pass
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    try:
        project = tomllib.loads(pyproject.read_text())["project"]
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return "unknown"
    return str(project["version"]) if project.get("name") == "fa4-audit" and "version" in project else "unknown"


def thresholds_digest(thresholds: dict) -> str:
    """A digest of a thresholds policy: its content, not the path it was read from."""
    return _digest({k: v for k, v in thresholds.items() if k != "path"})


def run_identity(*, kernel: str, suite: str, seed: int, thresholds: dict, cases: list, backward=None) -> dict:
    """What a journal's records belong to (the header's fields)."""
    ver = package_version()
    return {
        "journal": SCHEMA,
        "kernel": kernel,
        "suite": suite,
        "seed": seed,
        "thresholds": thresholds_digest(thresholds),
        "cases": _digest([c.as_dict() for c in cases]),
        "n_cases": len(cases),
        "fa4_audit": ver,
        "backward": None if backward is None else {"repeat": backward.repeat, "deterministic": backward.deterministic},
    }


def append(path: Path, rec: dict) -> None:
    """Append one record durably; a torn last line (a kill mid-write) is never glued onto."""
    line = json.dumps(rec, separators=(",", ":")) + "\n"
    if path.exists() and path.stat().st_size:
        with open(path, "rb") as fh:
            fh.seek(-1, os.SEEK_END)
            if fh.read(1) != b"\n":
                line = "\n" + line
    with open(path, "ab") as fh:
        fh.write(line.encode())
        fh.flush()
        os.fsync(fh.fileno())


def _lines(path: Path):
    if not path.exists():
        return
    for line in path.read_text().splitlines():
        try:
            yield json.loads(line)
        except json.JSONDecodeError:  # a torn line from a kill
            continue


def read_records(path: Path) -> dict[str, dict]:
    """Finished case records by case name (the header and torn lines skipped; a case journalled
    twice, redone by ``--resume``, is its last record), each as this version writes it
    (``audits.report.schema.upgrade_case``: a journal may be older), without its :data:`AT`."""
    return {r["case"]: r for r in read_ordered(path, ordered=False)}


def read_ordered(path: Path, *, ordered: bool = True) -> list[dict]:
    """The finished records (as :func:`read_records`) in the run's case order (by :data:`AT`;
    records written without it, by an older fa4-audit, after those with it, in journal order)."""
    recs = {r["case"]: r for r in _lines(path) if isinstance(r, dict) and "case" in r}
    out = list(recs.values())
    if ordered:
        out.sort(key=lambda r: (r.get(AT) is None, r.get(AT) or 0))
    return [upgrade_case({k: v for k, v in r.items() if k != AT}) for r in out]


def read_header(path: Path) -> dict | None:
    """The journal's header, or None (no journal, or one without a header)."""
    for r in _lines(path):
        return r if isinstance(r, dict) and r.get("journal") == SCHEMA else None
    return None


def check_header(path: Path, identity: dict) -> None:
    """Raise :class:`JournalMismatch` unless the journal at ``path`` was written by the run
    ``identity`` describes (a missing journal is fine: nothing to resume)."""
    if not path.exists():
        return
    head = read_header(path)
    if head is None:
        raise JournalMismatch(
            f"{path} has no header (written by an older fa4-audit, or not a journal): "
            "cannot tell what its records belong to"
        )
    differ = [f"{k}: journal {head.get(k)!r}, this run {v!r}" for k, v in identity.items() if head.get(k) != v]
    if differ:
        raise JournalMismatch(f"{path} belongs to another run; " + "; ".join(differ))
