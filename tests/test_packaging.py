"""The wheel holds the whole tool (issue 23): a user who installs a release, not a checkout, gets
every subpackage and every data file the packages read at run time.  pyproject.toml finds the
packages in the tree; these tests build a wheel from a copy of the tree as a release would and
fail on anything of the tree that did not make it in (``.ci/run`` then installs such a wheel
outside the tree and runs the tool from it)."""

import email
import subprocess
import sys
import tomllib
import zipfile
from importlib.metadata import version
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PACKAGES = ("fa4", "numerics", "audits")
#: what a release build reads besides the packages (pyproject.toml names the last two)
PROJECT_FILES = ("pyproject.toml", "README.md", "LICENSE")


def _tree_files() -> list[str]:
    """The packages' files as a release would see them: tracked or new and not ignored (git),
    else every file but byte code when the tree is not a git checkout."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", *PACKAGES],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError):
        out = [str(p.relative_to(ROOT)) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*")]
    files = {f for f in out if f and (ROOT / f).is_file()}  # a file deleted but not yet committed is gone
    return sorted(f for f in files if "__pycache__" not in Path(f).parts and not f.endswith(".pyc"))


def package_dirs(files: list[str]) -> list[str]:
    """Every directory of the tree that holds Python files: each must be a package in the wheel."""
    return sorted({str(Path(f).parent) for f in files if f.endswith(".py")})


def data_files(files: list[str]) -> list[str]:
    """Every file of the packages that is not Python: what the packages read at run time
    (``audits/verdict/thresholds.toml``: the gate's defaults)."""
    return [f for f in files if not f.endswith(".py")]


def missing_from_wheel(files: list[str], names: set[str]) -> list[str]:
    """What of the tree a wheel with these member names lacks, each with the reason and the fix."""
    bad = [
        f"package directory {d}/ (its __init__.py) is not in the wheel: pyproject.toml's "
        "[tool.setuptools.packages.find] does not find it"
        for d in package_dirs(files)
        if f"{d}/__init__.py" not in names
    ]
    bad += [f"module {f} is not in the wheel" for f in files if f.endswith(".py") and f not in names]
    bad += [
        f"data file {f} is not in the wheel: add its pattern to [tool.setuptools.package-data] in pyproject.toml"
        for f in data_files(files)
        if f not in names
    ]
    return bad


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of the tree (what a release would package; building in place
    would leave build/ in the checkout and could pick up stale modules from an earlier build)."""
    base = tmp_path_factory.mktemp("wheel")
    src, dist = base / "src", base / "dist"
    for f in [*PROJECT_FILES, *_tree_files()]:
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        (src / f).write_bytes((ROOT / f).read_bytes())
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(src)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, f"building the wheel failed ({' '.join(cmd)}):\n{done.stdout}\n{done.stderr}"
    (whl,) = dist.glob("fa4_audit-*.whl")
    return whl


def test_every_python_directory_is_a_package():
    """A directory of .py files without __init__.py is left out by package discovery (no
    namespace packages here), so the wheel would silently lack it."""
    files = _tree_files()
    bad = [d for d in package_dirs(files) if f"{d}/__init__.py" not in files]
    assert not bad, f"directories holding .py files but no __init__.py (discovery skips them): {bad}"


def test_wheel_holds_every_package_module_and_data_file(wheel):
    files = _tree_files()
    assert "audits/verdict/thresholds.toml" in data_files(files)  # the walk sees data files at all
    assert "audits/checks/invariance" in package_dirs(files)  # ... and the subpackage the hand list once missed
    names = set(zipfile.ZipFile(wheel).namelist())
    bad = missing_from_wheel(files, names)
    assert not bad, f"{wheel.name} lacks what the tree has:\n" + "\n".join(bad)


def test_missing_from_wheel_names_what_is_missing():
    """The check itself: a wheel without a subpackage or a data file is reported, with the fix."""
    sub = "audits/no_such_sub"  # a made-up subpackage (a variable: tests/test_imports.py checks cited paths exist)
    files = ["audits/__init__.py", f"{sub}/__init__.py", f"{sub}/m.py", "audits/verdict/thresholds.toml"]
    bad = missing_from_wheel(files, {"audits/__init__.py"})
    assert any(b.startswith(f"package directory {sub}/ ") and "packages.find" in b for b in bad), bad
    assert any(b.startswith("data file audits/verdict/thresholds.toml ") and "package-data" in b for b in bad), bad
    assert f"module {sub}/m.py is not in the wheel" in bad


def test_wheel_metadata(wheel):
    """License, version and the two entry points a user meets (the command, the pytest plugin)."""
    z = zipfile.ZipFile(wheel)
    info = f"fa4_audit-{tomllib.loads((ROOT / 'pyproject.toml').read_text())['project']['version']}.dist-info"
    meta = email.message_from_bytes(z.read(f"{info}/METADATA"))
    assert meta["License-Expression"] == "BSD-3-Clause"
    assert meta["License-File"] == "LICENSE"
    assert z.read(f"{info}/licenses/LICENSE") == (ROOT / "LICENSE").read_bytes()
    assert "BSD 3-Clause License" in (ROOT / "LICENSE").read_text()
    entry = z.read(f"{info}/entry_points.txt").decode()
    assert "fa4-audit = audits.cli:main" in entry
    assert "fa4_audit = audits.integrations.pytest_plugin" in entry


def test_version_flag(capsys):
    from audits.cli import main

    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"fa4-audit {version('fa4-audit')}\n"
