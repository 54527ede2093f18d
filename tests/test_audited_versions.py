"""Every report records the versions it audited: fa4-audit's own, flash-attn-4,
nvidia-cutlass-dsl and torch (audits.report.header), shown in report.md and ``show``; a package
not installed is recorded as absent (None), not as an error."""

import json
import tomllib
from importlib.metadata import PackageNotFoundError
from pathlib import Path

import torch

from audits import cli
from audits.engine import journal
from audits.report import header

ROOT = Path(__file__).resolve().parents[1]
NORMAL = "bf16-d64-b2h4k2-s200x300-causal-normal-seed0"  # tests/test_contract.py's


def _not_installed(dist):
    raise PackageNotFoundError(dist)


def test_version_of_a_source_tree_never_installed(monkeypatch):
    """Run from a copy on PYTHONPATH (the H200 device's), no distribution metadata: the version is
    pyproject's, not "unknown" (what every device report said before)."""
    monkeypatch.setattr(journal, "version", _not_installed)
    want = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert journal.package_version() == want


def test_absent_packages_are_recorded_as_none(monkeypatch):
    """Without flash-attn-4 and the compiler (a CPU machine) both are None; torch is torch's own."""
    fake = {"flash-attn-4": "4.0.0b40"}
    monkeypatch.setattr(header, "version", lambda d: fake[d] if d in fake else _not_installed(d))
    got = header.audited_versions()
    assert got == {
        "fa4-audit": journal.package_version(),
        "flash-attn-4": "4.0.0b40",
        "nvidia-cutlass-dsl": None,
        "torch": torch.__version__,
    }
    line = header.versions_line({"versions": got})
    assert "flash-attn-4 4.0.0b40" in line and "nvidia-cutlass-dsl not installed" in line
    assert header.versions_line({}) == "versions: not recorded (a report made before fa4-audit recorded them)"


def test_report_md_and_show_state_the_versions(tmp_path, capsys):
    """A run's report.json records them in its environment; report.md and ``show`` print them."""
    assert cli.main(["run", "--quiet", "--kernel", "fa4-model", "--case", NORMAL, "--out", str(tmp_path)]) == 0
    env = json.loads((tmp_path / "report.json").read_text())["environment"]
    assert env["versions"]["fa4-audit"] == journal.package_version() != "unknown"
    assert env["versions"]["torch"] == torch.__version__
    line = header.versions_line(env)
    assert line.startswith("versions: fa4-audit ") and f"torch {torch.__version__}" in line
    assert line in (tmp_path / "report.md").read_text()
    capsys.readouterr()
    assert cli.main(["show", str(tmp_path / "report.json")]) == 0
    assert line in capsys.readouterr().out
