"""Dependencies declared = dependencies used.

Every distribution ``pyproject.toml`` lists is imported by the package (``fa4``, ``numerics``,
``audits``), and every third-party module the package imports is declared — in
``dependencies``, or in an extra for the lazily imported production stack.  A dependency nothing
imports costs every user an install (scipy was one); an undeclared one breaks a clean install.
numba is required, not optional: the package imports it at module level, with no fallback.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).parents[1]
PACKAGES = ("fa4", "numerics", "audits")
#: distribution -> the module it installs, where the two names differ beyond - and _
MODULE_OF = {"flash-attn-4": "flash_attn", "nvidia-cutlass-dsl": "cutlass"}
#: imported but not declared, and why
UNDECLARED = {
    "triton": "ships with torch's CUDA builds; fa4.mufu imports it lazily and falls back without it",
    "pytest": "only the pytest plugin imports it, and only pytest loads that plugin",
}


def _module(requirement: str) -> str:
    dist = re.match(r"[A-Za-z0-9_.-]+", requirement).group(0)
    return MODULE_OF.get(dist, dist.lower().replace("-", "_"))


def _declared() -> dict[str, set[str]]:
    """Modules the ``dependencies`` and each extra install: {"dependencies": {...}, "gpu": {...}}."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    out = {"dependencies": {_module(r) for r in project["dependencies"]}}
    out |= {k: {_module(r) for r in v} for k, v in project.get("optional-dependencies", {}).items()}
    return out


def third_party_imports(source: str) -> set[str]:
    """Top-level modules ``source`` imports (anywhere: lazy imports count) that are neither the
    standard library's nor the project's."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found |= {n.split(".")[0] for n in names}
    return {m for m in found if m not in sys.stdlib_module_names and m not in PACKAGES + ("tests",)}


def _used() -> dict[str, list[str]]:
    used: dict[str, list[str]] = {}
    for pkg in PACKAGES:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            for m in third_party_imports(p.read_text()):
                used.setdefault(m, []).append(str(p.relative_to(ROOT)))
    return used


def test_every_declared_dependency_is_imported():
    used = _used()
    unused = sorted(m for m in _declared()["dependencies"] if m not in used)
    assert unused == [], f"declared in pyproject.toml's dependencies, imported by no module of {PACKAGES}: {unused}"


def test_every_imported_module_is_declared():
    declared = set().union(*_declared().values())
    missing = {m: files for m, files in _used().items() if m not in declared and m not in UNDECLARED}
    assert missing == {}, f"imported but not declared in pyproject.toml (dependencies or an extra): {missing}"


def test_numba_is_imported_without_a_fallback():
    """numba is a hard dependency: no module guards its import (``try: import numba``)."""
    guarded = []
    for pkg in PACKAGES:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(p.read_text())):
                if isinstance(node, ast.Try) and any(
                    "numba" in third_party_imports(ast.unparse(s)) for s in node.body if isinstance(s, ast.stmt)
                ):
                    guarded.append(f"{p.relative_to(ROOT)}:{node.lineno}")
    assert guarded == [], f"numba is required (pyproject.toml): drop the fallback at {guarded}"


def test_the_scanner_sees_lazy_and_from_imports():
    src = "import os\nfrom numpy.linalg import norm\ndef f():\n    import scipy.special\nfrom fa4 import model\n"
    assert third_party_imports(src) == {"numpy", "scipy"}
