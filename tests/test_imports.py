"""The direction of imports: ``numerics`` <- ``fa4`` <- ``audits``, the layers of ``audits`` (library,
checks each in its own folder, the audit API, its callers) importing downwards only, and no import
circle anywhere (lazy imports inside functions count: a circle through them is still a circle)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PACKAGES = ("numerics", "fa4", "audits")
#: what each top-level package may import from the project
ALLOWED = {"numerics": {"numerics"}, "fa4": {"numerics", "fa4"}, "audits": {"numerics", "fa4", "audits"}}
#: the layers of ``audits``, lowest first: the library every entry point shares; the checks beside
#: the case runner, each in its own folder over the library; the one audit API; and its callers
LIBRARY = (
    "audits.common",
    "audits.kernels",
    "audits.peers",
    "audits.contract",
    "audits.suites",
    "audits.verdict",
    "audits.report",
    "audits.engine",
)
#: what each layer may import from ``audits`` (a check also its own folder)
LAYERS = {
    "library": LIBRARY,
    "checks": LIBRARY,
    "api": LIBRARY + ("audits.checks",),
    "cli": LIBRARY + ("audits.checks", "audits.api", "audits.cli"),
    "integrations": LIBRARY + ("audits.checks", "audits.api", "audits.integrations"),
}


def layer(module: str) -> str:
    """The layer of a module of ``audits`` (``audits.__main__`` is the command line's)."""
    if module.startswith(LIBRARY):
        return "library"
    for name in ("checks", "api", "cli", "integrations"):
        if module == f"audits.{name}" or module.startswith(f"audits.{name}."):
            return name
    return "cli" if module in ("audits", "audits.__main__") else "unknown"


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(p.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = p
    return mods


def _imports(path: Path, mods: dict) -> set[str]:
    """Project modules imported anywhere in the file (``from a.b import c`` counts as ``a.b.c``
    when that is a module, else ``a.b``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module for a in node.names
            ]
        else:
            continue
        found |= {n for n in names if n.split(".")[0] in PACKAGES}
    return found


def graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: {i for i in _imports(p, mods) if i != m} for m, p in mods.items()}


def _violations(g: dict[str, set[str]]) -> list[str]:
    bad = []
    for m, deps in g.items():
        top = m.split(".")[0]
        for d in deps:
            if d.split(".")[0] not in ALLOWED[top]:
                bad.append(f"{m} imports {d}: against numerics <- fa4 <- audits")
            if not (m.startswith("audits.") and d.startswith("audits.")):
                continue
            lay, allowed = layer(m), LAYERS.get(layer(m), ())
            own = ".".join(m.split(".")[:3]) if lay == "checks" else None
            if not (d.startswith(allowed) or (own and (d == own or d.startswith(own + ".")))):
                bad.append(f"{m} imports {d}: the {lay} layer of audits imports only {allowed}")
    return bad


def _cycle(g: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in sorted(g.get(m, ())):
            if state.get(d) == 1:
                return stack[stack.index(d) :] + [d]
            if d not in state and (c := visit(d)):
                return c
        state[m] = 2
        stack.pop()
        return None

    for m in sorted(g):
        if m not in state and (c := visit(m)):
            return c
    return None


def test_imports_run_one_way_and_audits_keep_to_their_folders():
    assert _violations(graph()) == []


def test_no_import_circle():
    assert _cycle(graph()) is None


@pytest.mark.parametrize(
    "edge,expect",
    [
        (("numerics.bounds", "fa4.ex2"), "against numerics <- fa4 <- audits"),
        (("audits.checks.static.facts", "audits.checks.ex2.ptx"), "the checks layer of audits imports only"),
        (("audits.engine.evaluate", "audits.cli.run"), "the library layer of audits imports only"),
        (("audits.integrations.pytest_plugin", "audits.cli"), "the integrations layer of audits imports only"),
    ],
)
def test_the_walker_sees_a_wrong_edge(edge, expect):
    g = graph()
    g[edge[0]] = g[edge[0]] | {edge[1]}
    assert any(expect in v for v in _violations(g))


def test_the_walker_sees_a_circle():
    g = graph()
    g["audits.report.html"] = g["audits.report.html"] | {"audits.report.build"}
    assert _cycle(g) == ["audits.report.build", "audits.report.html", "audits.report.build"]


def test_requires_python_admits_no_version_the_code_cannot_run_on():
    """``tomllib`` (used by the thresholds loader) exists from Python 3.11 on."""
    import tomllib

    uses = [m for m, p in _modules().items() if "tomllib" in p.read_text()]
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert uses and declared == ">=3.11", (uses, declared)


def test_code_cites_only_files_that_exist():
    """Docstrings and comments name files of this repository that exist, and no design document
    outside it."""
    import re

    top = "audits|fa4|numerics|tests|docs|reports|benchmarks|examples"
    cited = re.compile(rf"(?<![\w/.-])((?:{top})/[\w./-]+\.(?:py|md|toml|sh))")  # not inside another repo's path
    own = {Path(__file__).name, "test_readme.py"}  # these two cite missing paths on purpose
    bad = []
    for p in sorted(ROOT.glob("[afnbte]*/**/*.py")):
        if p.name in own:
            continue
        text = p.read_text()
        bad += [f"{p.relative_to(ROOT)} cites {c}" for c in cited.findall(text) if not (ROOT / c).exists()]
        bad += [
            f"{p.relative_to(ROOT)} cites DESIGN.md (outside the repo: docs/design.md)"
            for _ in re.findall(r"\bDESIGN\.md", text)
        ]
    assert bad == []
