"""The docs say what the code is: docs/design.md's layout lists every module (and no module that
is gone), and every suite size written in the docs and the README is the size the code builds."""

import functools
import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
PACKAGES = ("numerics", "fa4", "audits")


def layout_modules(text: str) -> dict[str, str]:
    """The modules docs/design.md's "Layout" block lists, ``{"audits/verdict/gate.py": "verdicts, ..."}``:
    one module a line, indented two spaces per folder under its folder's line (``runner/``)."""
    block = re.search(r"^## Layout\n\n```\n(.*?)^```", text, re.S | re.M)
    assert block, "docs/design.md has no '## Layout' section with a ``` block"
    listed, folders = {}, []
    for line in block.group(1).splitlines():
        m = re.match(r"( *)(\S+)\s*(.*)$", line)
        if not m:
            continue
        depth, name, what = len(m.group(1)) // 2, m.group(2), m.group(3).strip()
        if name.endswith("/"):
            folders = [*folders[:depth], name.rstrip("/")]
        elif name.endswith(".py") and 0 < depth <= len(folders) and folders[0] in PACKAGES:
            path = "/".join([*folders[:depth], name])
            assert path not in listed, f"docs/design.md lists {path} twice"
            listed[path] = what
    return listed


def code_modules() -> set[str]:
    """Every module of the three packages (``__init__.py`` aside: a package is its folder's line)."""
    return {
        p.relative_to(ROOT).as_posix()
        for pkg in PACKAGES
        for p in (ROOT / pkg).rglob("*.py")
        if p.name != "__init__.py" and "__pycache__" not in p.parts
    }


def test_design_layout_lists_every_module_with_what_it_is_for():
    listed = layout_modules((ROOT / "docs" / "design.md").read_text())
    code = code_modules()
    assert sorted(code - set(listed)) == [], "modules missing from docs/design.md's layout"
    assert sorted(set(listed) - code) == [], "docs/design.md's layout lists modules that do not exist"
    assert [m for m, what in listed.items() if not what] == [], "layout lines without what the module is for"


def test_layout_parser_sees_nesting_and_ignores_other_folders():
    """The parser the check above relies on: a module counts under the folder line above it, at its
    indentation, and only inside the three packages."""
    text = "## Layout\n\n```\nfa4/   models\n  a.py   one\naudits/   x\n  runner/   y\n    b.py   two\n  c.py\n"
    text += "examples/   d.py (not a package)\n```\n"
    want = {("fa4", "a.py"): "one", ("audits", "runner", "b.py"): "two", ("audits", "c.py"): ""}
    assert layout_modules(text) == {"/".join(k): v for k, v in want.items()}  # joined: they exist nowhere


@functools.cache
def _release_in_domain(kernel: str) -> int:
    """How many of plain ``release``'s cases lie inside ``kernel``'s declared domain."""
    from audits.kernels import kernel_domain
    from audits.suites.cases import suite

    d = kernel_domain(kernel)
    return sum(d.refusal(c) is None for c in suite("release"))


@functools.cache
def _within(name: str, kernel: str) -> int:
    """The size of suite ``name`` built inside ``kernel``'s declared domain (as ``run`` builds it)."""
    from audits.kernels import kernel_domain
    from audits.suites.cases import suite

    return len(suite(name, kernel_domain(kernel)))


def _size(name: str) -> int:
    from audits.suites.cases import suite

    return len(suite(name))


def _suite_file_size() -> int:
    from audits.suites.domain import Domain
    from audits.suites.suite_file import build, load

    return len(build(load(ROOT / "examples" / "suite.toml"), Domain(), cases_in=Domain())["cases"])


def _smoke_split(varlen: bool) -> int:
    from audits.suites.cases import suite

    return sum(bool(c.varlen) == varlen for c in suite("smoke"))


def _varlen_suite(name: str) -> int:
    import audits.suites.cases

    return len(getattr(audits.suites.cases, name)())


RESTRICTED = "examples.restricted_kernel:attention"
#: every suite size the docs and the README state about the code as it stands: (file, the words
#: around it, ``{}`` where the number is (whitespace is free), what the code builds).  A count
#: in a dated measurement of an earlier suite (docs/h200-results.md, the H200 backward run, the
#: static results) is said to be of that run, and is not here.
SUITE_COUNTS = [
    ("docs/runner.md", "times every input family: {} cases.", lambda: _size("release")),
    ("docs/runner.md", "`release` as it stands has {} of its", lambda: _release_in_domain(RESTRICTED)),
    ("docs/runner.md", "has 0 of its {} cases inside the domain", lambda: _size("release")),
    ("docs/runner.md", "it, `release` has {} cases, and", lambda: _within("release", RESTRICTED)),
    ("docs/runner.md", "and `smoke` {} cases, which that kernel", lambda: _within("smoke", RESTRICTED)),
    ("docs/runner.md", "(`smoke`: {} cases for `sdpa-math`", lambda: _within("smoke", "sdpa-math")),
    ("docs/runner.md", "cases for `sdpa-math`, {} for `fa4-model-sm90`", lambda: _within("smoke", "fa4-model-sm90")),
    ("docs/runner.md", "`fa4-model-sm90` and {} for `sdpa-flash`;", lambda: _within("smoke", "sdpa-flash")),
    ("docs/runner.md", "`release`: {} for `sdpa-flash`", lambda: _within("release", "sdpa-flash")),
    ("docs/runner.md", "`release` has {} cases in its domain", lambda: _release_in_domain("sdpa-flash")),
    ("docs/runner.md", "`examples/suite.toml` ({} cases;", _suite_file_size),
    ("docs/invariance.md", "smoke suite ({} cases:", lambda: _size("smoke")),
    ("docs/invariance.md", "cases: {} fixed-length,", lambda: _smoke_split(False)),
    ("docs/invariance.md", "fixed-length, {} varlen)", lambda: _smoke_split(True)),
    ("docs/varlen.md", "(`smoke_varlen`, {} cases", lambda: _varlen_suite("smoke_varlen")),
    ("docs/varlen.md", "(`release_varlen`, {} cases)", lambda: _varlen_suite("release_varlen")),
    ("docs/model-and-fidelity.md", "on identical inputs: {} cases over head dims", lambda: _size("fidelity")),
    ("docs/performance.md", "--kernel K`, {} cases;", lambda: _within("smoke", "fa4-model-sm90")),
]


def _written(path: str, words: str) -> list[int]:
    text = " ".join((ROOT / path).read_text().split())
    pattern = r"\s+".join(re.escape(w) for w in words.split()).replace(r"\{\}", r"(\d[\d,]*)")
    return [int(n.replace(",", "")) for n in re.findall(pattern, text)]


def test_suite_sizes_written_in_the_docs_are_the_codes():
    wrong = []
    for path, words, count in SUITE_COUNTS:
        written = _written(path, words)
        assert written, f"{path} no longer says {words!r}: update SUITE_COUNTS with the docs"
        if set(written) != {count()}:
            wrong.append(f"{path}: {words.replace('{}', str(written[0]))!r}, but the code builds {count()}")
    assert wrong == [], "\n".join(wrong)


def test_readme_further_reading_links_every_doc_page():
    """Every page of docs/ is reachable from the README's "Further reading", and every link there exists."""
    section = (ROOT / "README.md").read_text().split("## Further reading", 1)[1].split("\n## ", 1)[0]
    linked = set(re.findall(r"\]\((docs/[^)]+\.md)\)", section))
    pages = {p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")}
    assert sorted(pages - linked) == [], "doc pages the README's Further reading does not link"
    assert sorted(linked - pages) == [], "README links to doc pages that do not exist"


def _help_texts() -> dict[str, str]:
    """``fa4-audit --help`` and every subcommand's ``--help``, as printed."""
    import argparse

    from audits.cli import build_parser

    parser = build_parser()
    texts = {"fa4-audit": parser.format_help()}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            texts.update({f"fa4-audit {n}": p.format_help() for n, p in action.choices.items()})
    return texts


def test_help_text_states_no_suite_size():
    """A count of cases or compile groups written into help text goes stale as the suites grow
    (``static --help`` said release had 142 groups when it had 149); ``fa4-audit list`` computes them."""
    texts = _help_texts()
    assert len(texts) > 5
    stale = {
        cmd: re.findall(r"\d[\d,]*\s+(?:compile\s+)?(?:groups|cases)", " ".join(text.split()))
        for cmd, text in texts.items()
    }
    assert {cmd: found for cmd, found in stale.items() if found} == {}, "help text that states a suite size"


def _section(text: str, heading: str) -> str:
    return text.split(heading, 1)[1].split("\n## ", 1)[0]


def test_design_contracts_and_verdicts_are_the_codes():
    """What docs/design.md states about the code, checked against it: every verdict has its rule,
    every exit code its meaning, the report schema, the exp2 degrees, the kernels by name."""
    import audits.common
    from audits.kernels import KERNELS
    from audits.report.build import SCHEMA, VERDICTS
    from fa4.ex2 import DEGREES

    design = (ROOT / "docs" / "design.md").read_text()
    rules = _section(design, "## Verdict rules")
    assert [v for v in VERDICTS if f"`{v}`" not in rules] == [], "verdicts without a rule in docs/design.md"
    contracts = " ".join(_section(design, "## Contracts").split())
    exits = re.search(r"\*\*Exit codes\*\*(.*?) \d\. \*\*", contracts).group(1)
    codes = {n: getattr(audits.common, n) for n in dir(audits.common) if n.startswith("EXIT_")}
    assert {n: c for n, c in codes.items() if not re.search(rf"[:;,] {c} [a-z]", exits)} == {}, exits
    assert f"schema `{SCHEMA}`" in contracts, f"docs/design.md's contracts do not name the report schema {SCHEMA}"
    assert DEGREES == tuple(range(DEGREES[0], DEGREES[-1] + 1))
    assert f"degrees {DEGREES[0]}–{DEGREES[-1]}" in contracts, f"docs/design.md does not give the degrees {DEGREES}"
    by_name = re.search(r"\*\*Kernels by name\*\*(.*?) \d\. \*\*", contracts).group(1)
    assert [k for k in KERNELS if f"`{k}`" not in by_name] == [], "kernels docs/design.md does not name"


def _doc_pages() -> list[Path]:
    return [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]


def test_names_and_paths_in_the_docs_exist():
    """Every dotted name of the packages the docs and the README cite (``audits.suites.cases.Case``,
    ``fa4.model``) is a module or a name of one, and every path they cite in this repository
    (``audits/verdict/gate.py``) exists: a rename that forgets the docs fails here."""
    import importlib

    def is_module(parts: list[str]) -> bool:
        p = ROOT.joinpath(*parts)
        return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()

    missing = []
    for page in _doc_pages():
        text = page.read_text()
        where = page.relative_to(ROOT).as_posix()
        for name in sorted(set(re.findall(r"\b(?:numerics|fa4|audits)(?:\.[A-Za-z_]\w*)+", text))):
            parts = name.split(".")
            k = max(i for i in range(1, len(parts) + 1) if is_module(parts[:i]))
            if k < len(parts) and parts[k] not in ("py", "md", "toml", "json"):
                if not hasattr(importlib.import_module(".".join(parts[:k])), parts[k]):
                    missing.append(f"{where}: {name}")
        top = "|".join(["numerics", "fa4", "audits", "tests", "examples", "benchmarks", "docs", "reports"])
        for path in sorted(set(re.findall(rf"`((?:{top})/[\w./-]*\w)/?`", text))):  # whole spans: no globs
            if not (ROOT / path).exists() and not path.endswith("-latest"):  # a run's default output folder
                missing.append(f"{where}: {path}")
    assert missing == [], "names or paths the docs cite that the code does not have"
