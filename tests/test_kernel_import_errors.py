"""A kernel file or module that does not import (a syntax error, an import error, a missing
function) is a usage error: exit 2 and one line ``file:line: message`` naming where, no
traceback (audits.kernels.get_kernel)."""

import pytest

from audits import cli

SOURCES = {
    "syntax": ("def attention(q, k, v, **kw):\n    return q\n\ndef broken(q k):\n    pass\n", 4, "SyntaxError"),
    "imports": ("import torch\nimport no_such_package_fa4_audit_test\n", 2, "ModuleNotFoundError"),
    "raises": ("X = 1\nY = X / 0\n", 2, "ZeroDivisionError"),
}


@pytest.mark.parametrize("form", ["file", "module"])
@pytest.mark.parametrize("what", sorted(SOURCES))
def test_a_kernel_that_does_not_import_is_one_line_exit_2(tmp_path, monkeypatch, capsys, what, form):
    text, line, kind = SOURCES[what]
    src = tmp_path / f"k_{what}_{form}.py"
    src.write_text(text)
    monkeypatch.chdir(tmp_path)
    spec = f"{src}:attention" if form == "file" else f"k_{what}_{form}:attention"
    assert cli.main(["run", "--quiet", "--kernel", spec, "--suite", "smoke", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err  # one line, no traceback
    assert f"{src}:{line}: {kind}" in err[0], err


@pytest.mark.parametrize("form", ["file", "module"])
def test_a_missing_function_names_the_file_and_what_it_defines(tmp_path, monkeypatch, capsys, form):
    src = tmp_path / f"k_missing_{form}.py"
    src.write_text("def other(q, k, v, **kw):\n    return q\n")
    monkeypatch.chdir(tmp_path)
    spec = f"{src}:attention" if form == "file" else f"k_missing_{form}:attention"
    assert cli.main(["run", "--quiet", "--kernel", spec, "--suite", "smoke", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert f"{src}: kernel {spec!r}: the module defines no 'attention' (its public callables: other)" in err[0]
