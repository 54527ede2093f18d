"""The linter and the formatter (ruff, configured in pyproject.toml) are clean on the whole tree."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PATHS = ["audits", "fa4", "numerics", "tests", "benchmarks", "examples"]


def _ruff() -> list[str]:
    exe = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    if not Path(exe).exists():
        pytest.fail("ruff is not installed: pip install -e '.[test]' installs it")
    return [exe]


def test_ruff_check_is_clean():
    p = subprocess.run([*_ruff(), "check", *PATHS], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stdout[-4000:]


def test_ruff_format_is_clean():
    p = subprocess.run([*_ruff(), "format", "--check", *PATHS], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stdout[-4000:]
