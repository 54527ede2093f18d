"""The causes tallied over a report's cases (``audits.verdict.separators.cause_groups``,
docs/diagnosis.md "Across cases"): per cause, the cases that name it and those that name it
first, the detail most share; the failing cases no cause fits, and those with no result to test;
one sentence in every view and in the run's console."""

from __future__ import annotations

import html
import json
from pathlib import Path

import pytest

from audits import cli
from audits.report.schema import upgrade
from audits.verdict.separators import cause_groups, cause_text

ROOT = Path(__file__).parents[1]


def _rec(name: str, verdict: str, *causes: tuple[str, str]) -> dict:
    found = [{"cause": c, "detail": d, "evidence": "...", "score": 1.0} for c, d in causes]
    return {"case": name, "verdict": verdict, "diagnosis": {"causes": found} if found else {}}


RECORDS = [
    _rec("a", "fail", ("misplaced_rows", "stride 1"), ("unwritten_output", "batch 1")),
    _rec("b", "fail", ("unwritten_output", "batch 1"), ("misplaced_rows", "stride 1")),
    # the forward's and the backward's poisoned runs both name it: one case
    _rec("c", "fail", ("misplaced_rows", "stride 2"), ("misplaced_rows", "stride 1")),
    _rec("d", "fail"),  # no tested cause fits
    _rec("e", "crash"),  # no result to test
    _rec("f", "warn", ("rounding_bias", "out leans low")),
    _rec("g", "pass", ("misplaced_rows", "never counted: it passes")),
]


def test_causes_are_counted_per_case_first_and_named_with_their_commonest_detail():
    t = cause_groups(RECORDS)
    assert (t["failing"], t["warning"], t["unexplained"], t["untested"]) == (5, 1, 1, 1)
    got = [(g["cause"], g["cases"], g["best"], g["first"], g["detail"], g["detail_cases"]) for g in t["groups"]]
    assert got == [
        ("misplaced_rows", 3, 2, "a", "stride 1", 2),  # c's first detail is stride 2: 2 of 3 share stride 1
        ("unwritten_output", 2, 1, "a", "batch 1", 2),
        ("rounding_bias", 1, 1, "f", "out leans low", 1),
    ]
    assert cause_text(t) == (
        "Likely causes over the 5 failing cases and 1 warning case: misplaced_rows first on 2 and named on 3 "
        "(2 of 3: stride 1); unwritten_output first on 1 and named on 2 (all 2: batch 1); rounding_bias first "
        "on 1 and named on 1 (all 1: out leans low); no tested cause fits 1 failing case; 1 case errored, "
        "crashed or timed out: no result to test"
    )


def test_a_run_with_nothing_failing_says_nothing_and_one_without_a_cause_says_so():
    assert cause_groups([_rec("a", "pass"), _rec("b", "skipped")]) is None
    assert cause_text(None) == ""
    t = cause_groups([_rec("a", "fail"), _rec("b", "pass")])
    assert cause_text(t) == "Likely causes over the 1 failing case: no tested cause fits 1 failing case"
    t = cause_groups([_rec("a", "fail", ("overflow", "P")), _rec("b", "fail", ("overflow", "P"))])
    assert cause_text(t).endswith("overflow first on 2 and named on 2 (all 2: P); every failing case has one")


def test_a_report_written_before_the_tally_gets_it_when_read():
    rep = {"cases": RECORDS, "diagnosis": {"separators": [], "failing": 5, "passing": 2}, "coverage": {}}
    assert upgrade(rep)["diagnosis"]["causes"] == cause_groups(RECORDS)


@pytest.fixture
def _cwd(monkeypatch):
    monkeypatch.chdir(ROOT)  # tests.* resolve as module:attr


#: three cases of d != dv that a kernel scaling by 1/sqrt(dv) fails (two at one c), one of d == dv it passes
CONFIGS = [
    {"dtype": "float16", "d": 72, "dv": 80, "seqlen_q": 96, "seqlen_k": 160, "family": "student_t", "seed": 0},
    {"dtype": "float16", "d": 72, "dv": 80, "seqlen_q": 96, "seqlen_k": 160, "family": "student_t", "seed": 1},
    {"dtype": "float16", "d": 64, "dv": 128, "seqlen_q": 96, "seqlen_k": 160, "family": "student_t", "seed": 0},
    {"dtype": "float16", "d": 64, "dv": 64, "seqlen_q": 96, "seqlen_k": 160, "family": "student_t", "seed": 0},
]


@pytest.mark.usefixtures("_cwd")
def test_a_run_tallies_its_causes_in_the_report_its_views_and_the_console(tmp_path, capsys):
    configs = [a for c in CONFIGS for a in ("--config", json.dumps(c))]
    argv = ["run", "--device", "cpu", "--no-isolate", "--kernel", "tests.cause_bugs:scale_by_dv", *configs]
    assert cli.main([*argv, "--out", str(tmp_path)]) == 1
    console = capsys.readouterr().out
    rep = json.loads((tmp_path / "report.json").read_text())
    t = rep["diagnosis"]["causes"]
    assert (t["failing"], t["unexplained"]) == (3, 0)
    [g] = t["groups"]
    assert (g["cause"], g["cases"], g["best"], g["detail_cases"]) == ("softmax_scale", 3, 3, 2)
    assert g["detail"].startswith("c = 0.94") and "sqrt(72/80)" in g["detail"]
    sentence = cause_text(t)
    assert sentence.startswith(
        "Likely causes over the 3 failing cases: softmax_scale first on 3 and named on 3 (2 of 3: c = 0.94"
    )
    assert sentence.endswith("every failing case has one")
    assert f"  {sentence}\n" in console  # the run's console, after its failing cases
    assert sentence in (tmp_path / "report.md").read_text()
    assert html.escape(sentence) in (tmp_path / "report.html").read_text()
    assert cli.main(["show", str(tmp_path / "report.json")]) == 0
    assert sentence in capsys.readouterr().out.replace("\n", " ")
    # the gate: each failing case with its best cause first, and the tally over the re-judged verdicts
    assert cli.main(["gate", str(tmp_path / "report.json")]) == 1
    gated = capsys.readouterr().out
    fails = [line for line in gated.splitlines() if line.startswith("FAIL ")]
    assert len(fails) == 3 and all(": likely cause: softmax_scale (c = " in line for line in fails), fails
    assert f"\n{sentence}\n" in gated
