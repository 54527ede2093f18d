"""The README stays true: short, its set-up commands the real ones, the reference kernel it links the
file that passes the smoke suite, and every file or module that it and docs/*.md cite present."""

import ast
import fnmatch
import importlib
import json
import re
import shlex
from pathlib import Path

import pytest

from audits import cli

ROOT = Path(__file__).parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
KERNEL_FILE = ROOT / "examples" / "reference_kernel.py"
#: details go to docs/; the reference kernel is linked, not copied
MAX_README_BYTES = 10_000
#: first components of repo-relative paths (anything else in backticks is not a repo path:
#: options, OUT/..., a production file such as flash_attn/cute/utils.py)
TOP = {"audits", "fa4", "numerics", "tests", "reports", "benchmarks", "docs", "examples", ".ci"}
ROOT_FILES = {"README.md", "pyproject.toml"}
PACKAGES = ("audits", "fa4", "numerics")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)


def _prose(text: str) -> str:
    """The Markdown without its fenced code blocks."""
    return FENCE.sub("", text)


def _code_spans(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", _prose(text))


def _links(text: str) -> list[str]:
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", _prose(text)) if "://" not in t and not t.startswith("#")]


def _blocks(text: str) -> list[tuple[str, str]]:
    """(info string, body) of every fenced code block."""
    return [(m.group(0).split("\n", 1)[0][3:].strip(), m.group(1)) for m in FENCE.finditer(text)]


def _section(text: str, title: str) -> str:
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, f"README has no section '## {title}'"
    return m.group(1)


def _ignored_prefixes() -> list[str]:
    """Output directories the repository ignores (``/reports/run-latest/`` in .gitignore): a
    citation of where a command writes, not of a file the repository holds."""
    lines = (ROOT / ".gitignore").read_text().splitlines() if (ROOT / ".gitignore").exists() else []
    return [ln.strip().strip("/") + "/" for ln in lines if ln.strip().startswith("/") and ln.strip().endswith("/")]


def _expand(token: str) -> list[str]:
    """Glob patterns for a cited path: ``{a,b}`` alternatives, ``<name>`` and ``…`` placeholders."""
    m = re.search(r"\{([^{}]*)\}", token)
    if m:
        return [p for alt in m.group(1).split(",") for p in _expand(token[: m.start()] + alt + token[m.end() :])]
    return [re.sub(r"<[^>]*>|…", "*", token)]


def cited_paths(text: str) -> list[str]:
    """Repo-relative paths cited in backticks or linked (``audits/verdict/gate.py``,
    ``reports/ex2/ex2.md``, ``examples/reference_kernel.py:attention``)."""
    found = []
    for tok in _code_spans(text) + _links(text):
        tok = tok.strip().rstrip(".,;")
        if " " in tok:
            continue  # a command or a signature, not a path
        first = tok.split("/", 1)[0]
        if (first not in TOP or "/" not in tok) and tok not in ROOT_FILES:
            continue
        tok = re.sub(r"(\.py):\w+$", r"\1", tok.split("::", 1)[0])  # file.py:fn, file.py::test
        if any(tok.startswith(p) or tok + "/" == p for p in _ignored_prefixes()):
            continue
        found.append(tok)
    return found


def missing_paths(text: str) -> list[str]:
    missing = []
    for tok in cited_paths(text):
        pats = _expand(tok)
        if not all(any(True for _ in ROOT.glob(p.rstrip("/"))) for p in pats):
            missing.append(tok)
    return missing


def cited_modules(text: str) -> list[str]:
    """Dotted references into the project (``numerics.reference.attention_reference``,
    ``audits.kernels.production_arch()``)."""
    out = []
    for tok in _code_spans(text):
        m = re.match(rf"^((?:{'|'.join(PACKAGES)})(?:\.[A-Za-z_]\w*)+)(?:\(|$)", tok.strip())
        if m:
            out.append(m.group(1))
    return out


def unresolved_modules(text: str) -> list[str]:
    bad = []
    for ref in cited_modules(text):
        parts = ref.split(".")
        for i in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:i]))
            except ImportError:
                continue
            try:
                for attr in parts[i:]:
                    obj = getattr(obj, attr)
            except AttributeError:
                bad.append(ref)
            break
        else:
            bad.append(ref)
    return bad


def kernel_block(text: str) -> str | None:
    """A code block of the README that defines a kernel (``def attention(``): a copy of the example."""
    for info, body in _blocks(text):
        if info == "python" and re.search(r"^def attention\(", body, re.M):
            return body
    return None


def kernel_functions() -> dict[str, ast.FunctionDef]:
    """The top-level functions of examples/reference_kernel.py, by name."""
    return {f.name: f for f in ast.parse(KERNEL_FILE.read_text()).body if isinstance(f, ast.FunctionDef)}


# --------------------------------------------------------------------------------------------


def test_readme_is_short():
    size = len(README.read_bytes())
    assert size <= MAX_README_BYTES, f"README.md is {size} bytes; keep it <= {MAX_README_BYTES} (details go to docs/)"


def test_set_up_has_exactly_the_two_contractual_commands():
    blocks = _blocks(_section(README.read_text(), "Set up") + "\n")
    assert len(blocks) == 2, f"'## Set up' must hold exactly two commands, found {len(blocks)}"
    (_, install), (_, tests) = blocks
    # the test command is what CI runs, verbatim
    ci = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines() if ln.strip().startswith("pip install")]
    assert ci and tests.strip() == ci[-1], f"README test command {tests.strip()!r} != .ci/run's {ci[-1:]!r}"
    # the install-and-audit command: from nothing, the pinned CPU torch, a real audit whose flags exist
    install = install.strip()
    assert "\n" not in install and install.startswith("python3 -m venv ")
    assert "pip install torch==2.13.0 -e ." in install
    audit = install.split("&& fa4-audit ", 1)
    assert len(audit) == 2, "the first command must end by running an audit with fa4-audit"
    argv = shlex.split(audit[1])
    assert argv[0] == "run" and "--kernel" in argv
    try:
        cli.build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse: an option that does not exist
        raise AssertionError(f"fa4-audit rejects the README's set-up audit {argv}: exit {exc.code}") from None


def test_readme_commands_parse():
    """Every complete ``fa4-audit`` command the README shows (no ``[...]`` or ``|`` placeholders)
    names a command and options that exist."""
    lines = [ln.strip() for _, body in _blocks(README.read_text()) for ln in body.splitlines()]
    cmds = [ln for ln in lines if ln.startswith("fa4-audit ") and not re.search(r"[\[\]|]", ln)]
    assert cmds
    for cmd in cmds:
        argv = shlex.split(cmd, comments=True)[1:]
        try:
            cli.build_parser().parse_args(argv)
        except SystemExit as exc:
            raise AssertionError(f"README command {cmd!r} does not parse: exit {exc.code}") from None


def test_readme_and_docs_cite_only_files_that_exist():
    bad = {p.relative_to(ROOT).as_posix(): missing_paths(p.read_text()) for p in [README, *DOCS]}
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, f"cited paths that are not in the repository: {bad}"


def test_readme_and_docs_cite_only_modules_and_names_that_exist():
    bad = {p.relative_to(ROOT).as_posix(): unresolved_modules(p.read_text()) for p in [README, *DOCS]}
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, f"cited modules or attributes that do not resolve: {bad}"


def test_every_docs_page_is_linked_from_the_readme():
    links = set(_links(README.read_text()))
    unlinked = [p.relative_to(ROOT).as_posix() for p in DOCS if p.relative_to(ROOT).as_posix() not in links]
    assert DOCS and not unlinked, f"docs pages not in the README's further reading: {unlinked}"


def test_readme_links_the_reference_kernel_file():
    """The README links the example (the slow test below runs it on the smoke suite) and copies none
    of it: a copy would go stale."""
    text = README.read_text()
    assert "examples/reference_kernel.py" in _links(text), "README does not link examples/reference_kernel.py"
    section = _section(text, "Audit your kernel")
    assert "examples.reference_kernel:attention" in section and "examples/reference_kernel.py:attention" in section
    fn = kernel_functions().get("attention")
    assert fn is not None, "examples/reference_kernel.py defines no attention()"
    params = [a.arg for a in fn.args.args + fn.args.kwonlyargs]
    contract = ["q", "k", "v", "softmax_scale", "causal", "window_size", "softcap", "learnable_sink", "return_lse"]
    assert params[: len(contract)] == contract, f"the example's signature is not the contract's: {params}"
    assert kernel_block(text) is None, "README inlines a kernel: link examples/reference_kernel.py instead"


def test_the_checks_above_see_what_they_guard():
    """The helpers flag a bogus path, a bogus module name and an edited kernel block."""
    assert missing_paths("see `audits/runner/nope.py` and [x](docs/nope.md)") == [
        "audits/runner/nope.py",
        "docs/nope.md",
    ]
    assert missing_paths("`audits/verdict/gate.py`, `reports/h200/release/<kernel>/report.{md,json.xz}`") == []
    assert missing_paths("`reports/h200/release/<kernel>/report.{md,nope}`") != []
    assert unresolved_modules("`numerics.reference.attention_reference`, `fa4.model.attention(q)`") == []
    assert unresolved_modules("`numerics.reference.nope`") == ["numerics.reference.nope"]
    assert kernel_block("```python\nimport torch\n\n\ndef attention(q):\n    pass\n```\n").startswith("import torch")
    assert kernel_block("```python\nx = attention(q)\n```\n") is None


def _verdicts(report: Path) -> dict[str, str]:
    rep = json.loads(report.read_text())
    return {c["case"]: c["verdict"] for c in rep["cases"]}


@pytest.mark.slow  # the whole smoke suite: 27 s CPU
def test_reference_kernel_passes_the_smoke_suite(tmp_path, monkeypatch, capsys):
    """The README's example, as `fa4-audit run` runs it: exit 0, every case pass or warn but the
    varlen ones, which a fixed-length kernel skips without --per-sequence (docs/varlen.md)."""
    from audits.suites.cases import suite

    monkeypatch.chdir(ROOT)
    out = tmp_path / "run"
    argv = ["run", "--quiet", "--kernel", "examples.reference_kernel:attention", "--suite", "smoke", "--out", str(out)]
    rc = cli.main(argv)
    v = _verdicts(out / "report.json")
    varlen = {c.name for c in suite("smoke") if c.varlen}
    bad = {c: x for c, x in v.items() if x not in ("pass", "warn") and not (c in varlen and x == "skipped")}
    assert rc == 0 and not bad, f"exit {rc}; cases not pass/warn: {bad}\n{capsys.readouterr().out[-3000:]}"
    # the example declares the three mod kinds (docs/mods.md): every smoke case is built for it, and its
    # fixed-length mod cases pass (score_mod, mask_mod and block sparsity each in one at least)
    assert len(v) == len(suite("smoke")) and varlen
    mods = [c for c in suite("smoke") if c.mods and c.name not in varlen]
    assert {"score_mod", "mask_mod", "block_sparse"} <= {m for c in mods for m in c.mods}
    assert all(v[c.name] == "pass" for c in mods), {c.name: v[c.name] for c in mods}


def test_reference_kernel_by_file_path_from_another_directory(tmp_path, monkeypatch):
    """`--kernel path/to/file.py:fn` loads from any working directory."""
    monkeypatch.chdir(ROOT / "docs")
    out = tmp_path / "run"
    spec = "../examples/reference_kernel.py:attention"
    argv = ["run", "--quiet", "--kernel", spec, "--case", "*nan_inf_masked*", "--out", str(out)]
    assert cli.main(argv) == 0
    assert set(_verdicts(out / "report.json").values()) == {"pass"}


def test_reference_kernel_with_the_fixture(fa4_audit, monkeypatch):
    """The README's pytest form, on the smoke suite's learnable-sink cases."""
    monkeypatch.chdir(ROOT)
    rep = fa4_audit("examples.reference_kernel:attention", suite="smoke", case="*sink*")
    assert rep["summary"]["cases"] >= 1
    assert all(fnmatch.fnmatch(c["case"], "*sink*") for c in rep["cases"])


def test_readme_states_the_whole_kernel_contract():
    """The contract a newcomer implements, each piece present in "Audit your kernel"."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Audit your kernel") : text.index("## Gating in CI")]
    for piece in (
        "fn(q, k, v, *, softmax_scale=None, causal=False, window_size=(None, None), softcap=0.0, "
        "learnable_sink=None, return_lse=False)",  # the signature
        "q `(batch, seqlen_q, heads_q, d)`",  # layouts
        "non-contiguous",
        "`(batch, heads_q, seqlen_q)`, float32, natural log",  # LSE shape and units
        "bfloat16 for fp8 inputs",  # fp8 output dtype
        "Rows with no visible key: out = 0, lse = -inf",
        "Masked keys never leak",
        "`NotImplementedError` (`skipped`)",
        "by file path (from any directory) or as `module:attr`",  # how the module is found
    ):
        assert piece in section, piece
