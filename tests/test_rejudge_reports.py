"""Every committed report of the case runner re-judges identically: read as ``gate`` reads it
(``audits.report.schema.validate_report``, which upgrades what older versions wrote), each case
judged again under the thresholds the report records gets the verdict the report states, and the
report's exit code follows."""

from __future__ import annotations

from pathlib import Path

import pytest

from audits.common import read_json
from audits.report.build import exit_code, report_from_journal
from audits.report.records import VERDICTS
from audits.report.schema import upgrade_thresholds, validate_report
from audits.verdict.gate import rejudge
from audits.verdict.known import SHIPPED, apply_known, load_known

ROOT = Path(__file__).parents[1]
REPORTS = sorted(
    p
    for pattern in ("report.json", "report.json.gz", "report.json.xz", "journal.jsonl")
    for p in (ROOT / "reports").rglob(pattern)
)


def _read(path: Path) -> dict:
    rep = report_from_journal(path) if path.name == "journal.jsonl" else read_json(path, what="report")
    return validate_report(rep, str(path))


def test_the_committed_reports_are_found():
    assert len(REPORTS) > 30


@pytest.mark.parametrize("path", REPORTS, ids=lambda p: str(p.relative_to(ROOT / "reports")))
def test_a_committed_report_rejudges_identically(path):
    rep = _read(path)
    th = upgrade_thresholds(rep["thresholds"])
    again = rejudge(rep, th)
    if rep.get("known"):  # a run with --known: its shipped file applied again (the report names the file it read)
        name = {Path(f).name: n for n, f in SHIPPED.items()}[Path(rep["known"]["file"]).name]
        again = apply_known(report=again, known=load_known(name), strict=rep["known"]["strict"])
    changed = [
        (c["case"], c["verdict"], n["verdict"])
        for c, n in zip(rep["cases"], again["cases"], strict=True)
        if c["verdict"] != n["verdict"]
    ]
    assert changed == []
    counts = {v: sum(c["verdict"] == v for c in again["cases"]) for v in VERDICTS}
    assert counts == rep["summary"]["verdicts"]
    assert exit_code({**again, "summary": {**rep["summary"], "verdicts": counts}}) == exit_code(rep)
