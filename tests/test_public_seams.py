"""Public seams: no module of the project uses another module's underscore name.

What one module takes from another is that module's API, and a leading underscore tells a
maintainer the opposite ("safe to change"): so every name crossing a module boundary is public.
The walker reads each module's AST (as ``tests/test_imports.py`` does for the direction of
imports) and flags

* ``from M import _x`` (also relative: ``from . import _x``), and ``from M import x as _y`` is
  fine: the name taken is public, the alias only keeps it out of this module's own API;
* an underscore module anywhere in a path: ``import M._m``, ``from M._m import x``;
* ``m._x`` (or ``m.sub._x``) where ``m`` names a project module this file imported.

Dunder names (``__version__``, ``__file__``) are not private.  In scope: the code users run and
read — ``fa4``, ``numerics``, ``audits``, ``benchmarks``, ``examples``.  ``tests/`` is out: its
white-box tests reach into about sixty private names on purpose (a model's internal steps
checked one by one), which pins those tests, not the modules' API.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
#: the folders whose modules are checked
SCOPE = ("fa4", "numerics", "audits", "benchmarks", "examples")
#: top-level names that are the project's (imports of anything else are not judged)
PROJECT = SCOPE + ("tests",)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _project_modules() -> set[str]:
    return {_module_name(p) for top in PROJECT for p in (ROOT / top).rglob("*.py")}


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The module a ``from ... import`` names, relative forms resolved against ``module``."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def seam_violations(source: str, module: str, *, is_package: bool = False, modules: set[str]) -> list[str]:
    """Each use in ``source`` (the text of ``module``) of another project module's underscore
    name, as ``"line N: what"``; ``modules`` are the project's module names, to tell a
    ``from pkg import mod`` of a module from one of a function."""
    tree = ast.parse(source)
    bad = []
    bound: dict[str, str] = {}  # local name -> the project module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] not in PROJECT:
                    continue
                if any(_private(p) for p in a.name.split(".")):
                    bad.append(f"line {node.lineno}: import {a.name} (an underscore module)")
                bound[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            src = _absolute(node, module, is_package)
            if src.split(".")[0] not in PROJECT:
                continue
            if any(_private(p) for p in src.split(".")):
                bad.append(f"line {node.lineno}: from {src} import ... (an underscore module)")
            for a in node.names:
                if _private(a.name):
                    bad.append(f"line {a.lineno}: from {src} import {a.name}")
                if f"{src}.{a.name}" in modules:
                    bound[a.asname or a.name] = f"{src}.{a.name}"
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _private(node.attr)):
            continue
        chain, base = [node.attr], node.value
        while isinstance(base, ast.Attribute):
            chain.append(base.attr)
            base = base.value
        if isinstance(base, ast.Name) and base.id in bound:
            path = ".".join([base.id, *reversed(chain)])
            bad.append(f"line {node.lineno}: {path} ({bound[base.id]}'s underscore name)")
    return bad


def test_no_module_uses_another_modules_underscore_name():
    modules = _project_modules()
    bad = []
    for top in SCOPE:
        for p in sorted((ROOT / top).rglob("*.py")):
            found = seam_violations(p.read_text(), _module_name(p), is_package=p.name == "__init__.py", modules=modules)
            bad += [f"{p.relative_to(ROOT)} {v}" for v in found]
    assert bad == [], "make these names public (drop the underscore) or move them where they belong:\n" + "\n".join(bad)


def test_no_underscore_module_file():
    """Modules other modules import are public: no ``_name.py`` in scope (``__init__``,
    ``__main__`` are dunders)."""
    found = [str(p.relative_to(ROOT)) for top in SCOPE for p in (ROOT / top).rglob("*.py") if _private(p.stem)]
    assert found == []


@pytest.mark.parametrize(
    "source,module,expect",
    [
        ("from fa4.model import _finalize", "fa4.varlen", "from fa4.model import _finalize"),
        ("from fa4.model import (\n    FA4Numerics,\n    _validate,\n)", "fa4.varlen", "line 3: from fa4.model import"),
        ("from . import _stats", "audits.checks.ex2.sweep", "from audits.checks.ex2 import _stats"),
        ("from ..static import _facts", "audits.checks.ex2.sweep", "from audits.checks.static import _facts"),
        ("import fa4._primitives", "audits.x", "import fa4._primitives (an underscore module)"),
        ("from fa4._primitives import fma", "fa4.model", "from fa4._primitives import ... (an underscore module)"),
        ("from fa4 import model_bwd as mb\nmb._row_dot = None", "benchmarks.x", "mb._row_dot (fa4.model_bwd's"),
        ("import fa4.model as fm\nfm._finalize()", "benchmarks.x", "fm._finalize (fa4.model's"),
        ("import fa4.model\nfa4.model._finalize()", "benchmarks.x", "fa4.model._finalize (fa4's"),
    ],
)
def test_the_walker_sees_each_form(source, module, expect):
    found = seam_violations(source, module, modules={"fa4.model", "fa4.model_bwd", "fa4.varlen"})
    assert any(expect in v for v in found), found


@pytest.mark.parametrize(
    "source",
    [
        "from fa4.model import finalize as _finalize",  # the name taken is public
        "from fa4 import model\nmodel.__file__",  # a dunder
        "import torch\ntorch._C",  # not the project's
        "import fa4.model as fm\nclass A:\n    def f(self):\n        return self._x",  # own attribute
        "def _helper():\n    pass\n_helper()",  # own private name
    ],
)
def test_the_walker_lets_public_uses_pass(source):
    assert seam_violations(source, "benchmarks.x", modules={"fa4.model"}) == []
