"""Stable case identity (issue 33, item 8): a case is its configuration, not its name or its place
in a suite (``audits.suites.case.canonical_identity``); ``diff`` and ``gate --baseline`` match by
it, say how many cases matched on each side, and exit 2 when fewer than half of the smaller
report's cases match (``audits.cli.reports.MIN_MATCHED_SHARE``).  And ``show --failing``."""

from __future__ import annotations

import copy
import json

import pytest

from audits import cli
from audits.cli.reports import MIN_MATCHED_SHARE
from audits.report.schema import validate_report
from audits.suites.case import Case, identity_of

#: three tiny cases (milliseconds each on fa4-model)
CONFIGS = [
    {"dtype": "bfloat16", "d": 8, "dv": 8, "batch": 1, "heads_q": 2, "heads_kv": 1, "seqlen_q": 8, "seqlen_k": 16},
    {"dtype": "float16", "d": 8, "dv": 8, "batch": 1, "heads_q": 2, "heads_kv": 2, "seqlen_q": 8, "seqlen_k": 8,
     "causal": True},
    {"dtype": "bfloat16", "d": 8, "dv": 16, "batch": 1, "heads_q": 2, "heads_kv": 2, "seqlen_q": 12, "seqlen_k": 8,
     "softcap": 15.0, "family": "uniform"},
]  # fmt: skip


def test_identities_are_pinned():
    """These identities are what reports of every version are compared by: a change of
    ``canonical_identity`` or of a Case default that moves them fails here (they must not move)."""
    assert Case().identity == "cfg-44136fa355b3678a"
    assert Case(softcap=15.0, window=(8, 0), seed=3).identity == "cfg-65ac83cab39fe656"
    assert identity_of(CONFIGS[0]) == "cfg-7e82d42da0ea2b90"


def test_identity_is_the_configuration():
    c = Case(softcap=15.0, family="uniform", seed=2)
    # the JSON form as reports of any version carry it: absent fields default, 15 == 15.0
    assert identity_of(c.as_dict()) == c.identity == identity_of({"softcap": 15, "family": "uniform", "seed": 2})
    assert identity_of({**c.as_dict(), "seqlens": [], "page_size": 0}) == c.identity  # defaults spelled out
    assert Case(seed=3).identity != Case(seed=2).identity  # the seed draws other inputs
    assert identity_of({"seed": 3}, ignore_seed=True) == identity_of({"seed": 2}, ignore_seed=True)
    assert len({Case(d=d).identity for d in (64, 96, 128)} | {Case(causal=True).identity}) == 4
    with pytest.raises(ValueError, match="case config: dtype = 'float64' is not accepted"):
        identity_of({"dtype": "float64"})


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A fa4-model report of :data:`CONFIGS` (its path)."""
    out = tmp_path_factory.mktemp("identity") / "base"
    argv = ["run", "--quiet", "--kernel", "fa4-model", "--out", str(out)]
    for c in CONFIGS:
        argv += ["--config", json.dumps(c)]
    assert cli.main(argv) == 0
    return out / "report.json"


def _variant(base, path, *, rename=(), reseed=()) -> str:
    """The base report with the cases at ``rename`` given other names and those at ``reseed``
    another seed (another configuration: another identity), written to ``path``."""
    rep = json.loads(base.read_text())
    for i in rename:
        rep["cases"][i]["case"] = f"renamed-{i}"
    for i in reseed:
        rep["cases"][i]["config"]["seed"] = 77
        rep["cases"][i].pop("case_id", None)
    path.write_text(json.dumps(rep))
    return str(path)


def test_reports_whose_names_differ_match_by_configuration(base, tmp_path, capsys):
    renamed = _variant(base, tmp_path / "renamed.json", rename=(0, 1, 2))
    capsys.readouterr()
    assert cli.main(["diff", str(base), renamed]) == 0
    said = capsys.readouterr().out
    assert "0 of 3 cases differ; 3 of 3 baseline cases and 3 of 3 candidate cases matched by configuration" in said
    assert "only in" not in said
    assert cli.main(["gate", renamed, "--baseline", str(base)]) == 0
    assert "3 of 3 baseline cases and 3 of 3 candidate cases matched by configuration" in capsys.readouterr().out


def test_too_little_matched_exits_2_and_says_why(base, tmp_path, capsys):
    disjoint = _variant(base, tmp_path / "disjoint.json", reseed=(0, 1, 2))
    capsys.readouterr()
    for argv in (["diff", str(base), disjoint], ["gate", disjoint, "--baseline", str(base)]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert "0 of 3 baseline cases and 0 of 3 candidate cases matched by configuration" in err
        assert "no case matched, too few to judge" in err and "MIN_MATCHED_SHARE" in err
        # the same names, another seed: said, and --ignore-seed offered and matching them all
        assert "3 unmatched cases share a name across the reports but differ in seed (3)" in err
        assert "(--ignore-seed), 3 more would match" in err
    assert cli.main(["diff", str(base), disjoint, "--ignore-seed"]) == 0
    assert "3 of 3 baseline cases and 3 of 3 candidate cases matched by configuration, seeds ignored" in (
        capsys.readouterr().out
    )
    assert cli.main(["gate", disjoint, "--baseline", str(base), "--ignore-seed"]) == 0
    # the rule: at least half of the smaller side; 1 of 3 is too little, 2 of 3 is enough
    assert MIN_MATCHED_SHARE == 0.5
    one = _variant(base, tmp_path / "one.json", reseed=(1, 2))
    assert cli.main(["diff", str(base), one]) == 2
    assert "fewer than half of the smaller report's 3 cases have a match (33%)" in capsys.readouterr().err
    assert cli.main(["diff", str(base), _variant(base, tmp_path / "two.json", reseed=(2,))]) == 0
    # a smaller report wholly inside a larger one (a shard, a partial run) is judged
    rep = json.loads(base.read_text())
    rep["cases"] = rep["cases"][:1]
    rep["summary"].update(cases=1, selected=1, run=1, not_run=0)
    (tmp_path / "shard.json").write_text(json.dumps(rep))
    assert cli.main(["gate", str(tmp_path / "shard.json"), "--baseline", str(base)]) == 0
    assert "1 of 3 baseline cases and 1 of 1 candidate cases matched" in capsys.readouterr().out


def test_a_report_without_identities_gets_them_from_its_configs(base):
    rep = json.loads(base.read_text())
    want = [c["case_id"] for c in rep["cases"]]
    assert want == [identity_of(c) for c in CONFIGS]
    old = copy.deepcopy(rep)
    for c in old["cases"]:
        del c["case_id"]
    assert [c["case_id"] for c in validate_report(old, "old.json")["cases"]] == want


def test_show_failing_prints_only_failing_cases_with_reasons(base, tmp_path, capsys):
    rep = json.loads(base.read_text())
    rep["cases"][1]["verdict"] = "fail"
    rep["cases"][1]["reasons"] = ["FA criterion: max|out - ref| 0.5 > allowed 0.01"]
    rep["cases"][2]["verdict"] = "error"
    rep["cases"][2]["reasons"] = ["RuntimeError: boom"]
    (tmp_path / "r.json").write_text(json.dumps(rep))
    capsys.readouterr()
    assert cli.main(["show", str(tmp_path / "r.json"), "--failing"]) == 0
    said = capsys.readouterr().out
    names = [c["case"] for c in rep["cases"]]
    assert names[0] not in said and names[1] in said and names[2] in said
    assert "failing cases (fail, error, crash, timeout): 2 of 3" in said
    assert "FA criterion: max|out - ref| 0.5 > allowed 0.01" in said and "RuntimeError: boom" in said
    assert cli.main(["show", str(base), "--failing"]) == 0
    said = capsys.readouterr().out
    assert "failing cases (fail, error, crash, timeout): 0 of 3" in said
    assert not any(n in said for n in names)
