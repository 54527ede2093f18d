"""One CLI vocabulary: every argument has help, every subcommand that takes cases takes them the
same way (``audits.suites.selection``), with the same errors for the same mistakes, and ``--device``
defaults to cpu everywhere."""

import argparse
import json

import pytest

from audits import cli
from audits.cli.options import CASE_OPTIONS

#: the subcommands that take cases, and what each needs besides them to get as far as choosing
TAKE_CASES = {
    "run": ["--kernel", "fa4-model"],
    "compare": ["--kernel", "fa4-model", "--kernel", "fa4-model-sm90"],
    "invariance": ["--kernel", "fa4-model"],
    "static": ["--compile-on", "cpu"],
    "fidelity": ["--production", "fa4-model-sm90"],
}


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    p = cli.build_parser()
    (sub,) = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def _options(sp: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {o: a for a in sp._actions for o in a.option_strings}


def test_every_argument_of_every_subcommand_has_help():
    """An argument without help (argparse.SUPPRESS'd internal ones aside) is named here."""
    missing = [
        f"{name} {'/'.join(a.option_strings) or a.dest}"
        for name, sp in _subparsers().items()
        for a in sp._actions
        if not isinstance(a, argparse._HelpAction) and not (a.help and a.help.strip())
    ]
    assert missing == []


def test_help_texts_print_as_written(capsys):
    """argparse %-formats help, not descriptions: no doubled percent sign reaches the user."""
    for name in _subparsers():
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args([name, "--help"])
        out = capsys.readouterr().out
        assert "%%" not in out, name


def test_subcommands_that_take_cases_take_every_selection_option():
    """Any subcommand with one selection option has them all; the four that take cases among
    them; fuzz narrows with --domain and fixes its search with --seed."""
    subs = _subparsers()
    taking = {name for name, sp in subs.items() if set(_options(sp)) & {"--suite", "--config", "--case-file", "--case"}}
    # show's --case picks records of a report by the same GLOB (no cases to build): not a taker
    assert "--case" in _options(subs["show"]) and not set(_options(subs["show"])) & {"--suite", "--config"}
    assert taking - {"show"} == set(TAKE_CASES)
    for name in taking - {"show"}:
        missing = [o for o in CASE_OPTIONS if o not in _options(subs[name])]
        assert missing == [], f"{name} lacks {missing}"
    assert {"--domain", "--seed"} <= set(_options(subs["fuzz"]))


def test_device_defaults_to_cpu_everywhere():
    defaults = {
        name: _options(sp)["--device"].default for name, sp in _subparsers().items() if "--device" in _options(sp)
    }
    assert set(defaults) >= {"run", "invariance", "fuzz", "fidelity", "ex2"}
    assert set(defaults.values()) == {"cpu"}, defaults


MISTAKES = {
    "suite and config": (
        ["--suite", "smoke", "--config", "{}"],
        "--suite cannot be combined with --config or --case-file: they give the cases themselves",
    ),
    "suite and case file": (
        ["--suite", "smoke", "--case-file", "cases.json"],
        "--suite cannot be combined with --config or --case-file: they give the cases themselves",
    ),
    "unknown suite": (
        ["--suite", "smok"],
        "unknown suite 'smok'; accepted: smoke, release, nightly, head-dims, fidelity, mods, bias, or a suite file "
        "FILE.toml",
    ),
    "glob matching nothing": (["--suite", "smoke", "--case", "zzz*"], "--case 'zzz*' matches no case of 'smoke'"),
    "bad config": (["--config", '{"colour": 1}'], "--config #1: unknown key(s) colour; accepted: dtype, d"),
    "missing case file": (["--case-file", "/nonexistent/c.json"], "case file /nonexistent/c.json: cannot be read"),
    "missing domain file": (["--domain", "/nonexistent/d.toml"], "--domain: /nonexistent/d.toml: no such domain file"),
    "missing suite file": (["--suite", "/nonexistent/s.toml"], "/nonexistent/s.toml: no such suite file"),
}


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_the_same_mistake_is_the_same_error_in_every_subcommand(mistake, tmp_path, capsys):
    """Each subcommand that takes cases refuses the mistake with exit 2 and the same message,
    before any case runs."""
    argv, want = MISTAKES[mistake]
    said = {}
    for name, extra in TAKE_CASES.items():
        assert cli.main([name, *extra, *argv, "--out", str(tmp_path / name), "--quiet"]) == 2, name
        err = capsys.readouterr().err
        assert want in err, (name, err)
        said[name] = err.split(f"fa4-audit {name}: error: ", 1)[-1]
        assert not (tmp_path / name).exists(), f"{name} wrote a report"
    assert len(set(said.values())) == 1, said


@pytest.mark.parametrize("name", list(TAKE_CASES))
def test_given_cases_outside_the_domain_file_are_not_run(name, tmp_path, capsys):
    (tmp_path / "d.toml").write_text('dtypes = ["float16"]\n')
    argv = [name, *TAKE_CASES[name], "--config", '{"dtype": "bfloat16"}', "--domain", str(tmp_path / "d.toml")]
    assert cli.main([*argv, "--out", str(tmp_path / "o"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "case bf16-d128-b1h2k2-s128x128-normal-seed0 not run: outside the --domain file: dtype bfloat16" in err
    assert "none of the 1 given cases lies in the --domain file's domain" in err


def _suite_file(tmp_path) -> str:
    f = tmp_path / "mine.toml"
    f.write_text(
        'name = "mine"\n[[case]]\ndtype = "float16"\nd = 64\ndv = 64\nseqlen_q = 24\nseqlen_k = 40\n'
        "[[case]]\nd = 64\ndv = 64\nseqlen_q = 16\nseqlen_k = 16\ncausal = true\n"
    )
    return str(f)


def test_invariance_takes_a_suite_file_and_a_glob(tmp_path):
    out = tmp_path / "o"
    argv = ["invariance", "--kernel", "sdpa-math", "--suite", _suite_file(tmp_path), "--case", "*causal*"]
    assert cli.main([*argv, "--out", str(out), "--quiet"]) == 0
    rep = json.loads((out / "invariance.json").read_text())
    assert rep["suite"] == "mine" and [c["case"] for c in rep["cases"]] == [
        "bf16-d64-b1h2k2-s16x16-causal-normal-seed0"
    ]


def test_invariance_builds_named_suites_within_the_domain_file(tmp_path, capsys):
    (tmp_path / "d.toml").write_text('dtypes = ["float16"]\nhead_dims = [[64, 64]]\n')
    from audits.cli.options import selection_from_args

    ns = argparse.Namespace(suite=None, domain=str(tmp_path / "d.toml"), default_suite="smoke")
    sel = selection_from_args(ns, kernels=["sdpa-math"])
    assert sel.cases and {(c.dtype, c.d) for c in sel.cases} == {("float16", 64)}
    assert sel.label == "smoke" and sel.domain_info["domain"]["dtypes"] == ["float16"]


def test_a_fixed_suite_filtered_to_the_domain_says_what_it_lost(tmp_path, capsys):
    """fidelity's fixed list is filtered, not built, within a domain: the cases left out are counted."""
    from audits.cli.options import selection_from_args

    (tmp_path / "d.toml").write_text("head_dims = [[64, 64]]\n")
    sel = selection_from_args(argparse.Namespace(suite="fidelity", domain=str(tmp_path / "d.toml")))
    assert [c.d for c in sel.cases] == [64] * 6 and sel.domain_info["cases_outside"] == 27
    err = capsys.readouterr().err
    assert "fidelity: 27 of 33 cases lie outside the kernels' domain and are not run (e.g. bf16-d96-" in err


def _fake_static(monkeypatch, seen):
    from audits.checks.static import core
    from audits.cli import static as static_cli

    monkeypatch.setattr(static_cli, "_check_environment", lambda args: {"flash-attn-4": "x", "nvidia-cutlass-dsl": "y"})

    def refused(c, cases, **kw):
        seen.append(cases)
        return {"group": c.name, "cases": len(cases), "verdict": "skipped", "reason": "refused (test)"}

    monkeypatch.setattr(core, "audit_group", refused)


def test_static_takes_a_case_glob(tmp_path, monkeypatch, capsys):
    """static --case GLOB audits the compile groups of the matching cases only."""
    from audits.checks.static.core import static_groups
    from audits.suites.cases import smoke_suite

    seen = []
    _fake_static(monkeypatch, seen)
    argv = ["static", "--compile-on", "cpu", "--suite", "smoke", "--case", "f16-*", "--out", str(tmp_path), "--quiet"]
    assert cli.main(argv) == 1  # every group refused here: nothing audited
    want = static_groups([c for c in smoke_suite() if c.name.startswith("f16-")])
    assert sorted(map(sorted, seen)) == sorted(sorted(names) for _, names in want) and want
    rep = json.loads((tmp_path / "static.json").read_text())
    assert rep["suite"] == "smoke" and len(rep["groups"]) == len(want)


def test_static_says_when_a_selection_yields_no_compile_group(tmp_path, monkeypatch, capsys):
    seen = []
    _fake_static(monkeypatch, seen)
    argv = ["static", "--compile-on", "cpu", "--case", "*-vl*", "--out", str(tmp_path), "--quiet"]
    assert cli.main(argv) == 2
    from audits.suites.cases import smoke_suite

    n = sum(c.varlen for c in smoke_suite())  # --case "*-vl*": smoke's varlen cases
    want = f"the selection 'smoke' yields no compile group: its {n} cases are all varlen cases"
    assert want in capsys.readouterr().err
    assert seen == [] and not (tmp_path / "static.json").exists()


@pytest.mark.parametrize("device", [[], ["--device", "cpu"]])
def test_fidelity_with_production_needs_cuda_and_says_so(device, tmp_path, capsys):
    assert cli.main(["fidelity", *device, "--out", str(tmp_path), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "--device cpu: fidelity compares the model with the production kernel (fa4), which runs on CUDA" in err
    assert "pass --device cuda" in err


class _Chosen(Exception):
    """Raised by a stand-in for fidelity's case loop, carrying the labels it was given."""


def test_fidelity_defaults_to_its_suite_and_takes_any_selection(tmp_path, monkeypatch, capsys):
    """The fidelity suite by its labels (and the deprecated --cases spelling), or any --config,
    which runs under its case name."""
    from audits.cli import fidelity as fidelity_cli

    base = ["fidelity", "--production", "fa4-model-sm90", "--out", str(tmp_path), "--quiet"]
    assert cli.main([*base, "--config", '{"d": 64, "dv": 64, "seqlen_q": 20, "seqlen_k": 36}']) == 0
    rep = json.loads((tmp_path / "fidelity.json").read_text())
    assert rep["suite"] == "config" and [r["case"]["name"] for r in rep["results"]] == [
        "bf16-d64-b1h2k2-s20x36-normal-seed0"
    ]

    def chosen(cases, *a, **kw):
        raise _Chosen([label for label, _ in cases])

    monkeypatch.setattr(fidelity_cli, "_run_cases", chosen)
    with pytest.raises(_Chosen) as all_of_it:
        cli.main(base)
    assert len(all_of_it.value.args[0]) == 33 and all_of_it.value.args[0][:2] == ["d64", "d64_mqa"]
    for glob in (["--case", "d64_mqa"], ["--cases", "d64_mqa"], ["--case", "bf16-d64-b2h4k1-s384x640-normal-*"]):
        with pytest.raises(_Chosen) as got:
            cli.main([*base, *glob])
        assert got.value.args[0] == ["d64_mqa"], glob
    assert "--cases is deprecated; use --case GLOB" in capsys.readouterr().err


def test_fuzz_draws_inside_its_domain_file(tmp_path, monkeypatch):
    from audits.engine.session import Session

    drawn = []
    monkeypatch.setattr(Session, "evaluate", lambda self, c, **kw: drawn.append(c) or {"verdict": "pass"})
    (tmp_path / "d.toml").write_text('dtypes = ["float16"]\nmax_seqlen = 48\n')
    argv = ["fuzz", "--kernel", "sdpa-math", "--budget", "15", "--seed", "3", "--domain", str(tmp_path / "d.toml")]
    assert cli.main([*argv, "--database", str(tmp_path / "db"), "--out", str(tmp_path)]) == 0
    assert len(drawn) >= 10 and {c.dtype for c in drawn} == {"float16"}
    # lengths drawn up to the domain's max_seqlen (nan_inf_masked lengthens the keys past the window)
    assert max(max(c.seqlen_q, c.seqlen_k) for c in drawn if c.family != "nan_inf_masked") <= 48


def test_fuzz_domain_file_errors_as_run_does(tmp_path, capsys):
    (tmp_path / "d.toml").write_text('dtypes = ["float32"]\n')
    said = []
    for argv in (["run", "--kernel", "sdpa-math"], ["fuzz", "--kernel", "sdpa-math"]):
        assert cli.main([*argv, "--domain", str(tmp_path / "d.toml"), "--out", str(tmp_path / "o")]) == 2
        said.append(capsys.readouterr().err.split(": error: ", 1)[-1])
    assert said[0] == said[1] and "domain key 'dtypes'" in said[0]
