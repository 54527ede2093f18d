"""Known defects (``--known FILE.toml``, ``audits.verdict.known``, docs/known.md): the grammar of
an entry, the errors on bad input, the shipped file of production FA4's defects against the
committed H200 reports, and the verdict ``known`` through gate, diff, show, run and the report."""

from __future__ import annotations

import copy
import json
import os
from functools import cache
from pathlib import Path

import pytest

from audits import cli
from audits.common import read_json
from audits.engine.options import RunOptions
from audits.report.build import exit_code, write_report
from audits.report.records import FAILING
from audits.report.schema import ReportError, validate_report
from audits.verdict import findings as findings_module
from audits.verdict.gate import load_thresholds, rejudge
from audits.verdict.known import (
    FAILURE_KINDS,
    KNOWN,
    SHIPPED,
    KnownError,
    apply_known,
    failure_labels,
    known_lines,
    load_known,
    parse_rule,
)

pytest_plugins = ["pytester"]  # the fixture's known= (torch is imported above, before any pytester run)

ROOT = Path(__file__).parents[1]
H200 = ROOT / "reports" / "h200"
#: the committed reports of production (4.0.0b36) whose failures the shipped file describes, and
#: the failing cases each entry must match there (docs/known.md's table)
EXPECTED = {
    "release/fa4/report.json.xz": {"masked-key-nonfinite-leak": 82, "sink-lse-overflow": 4},
    "release-backward/fa4/report.json.xz": {"masked-key-nonfinite-leak": 91, "sink-lse-overflow": 30},
    "release-backward/fa4-deterministic/report.json.xz": {},
    "fa4-smoke/report.json": {},
    "varlen/fa4/report.json": {"masked-key-nonfinite-leak": 2},
    "mods/forward/fa4/report.json.xz": {"mask-mod-drops-causal": 1},
    "mods/backward/fa4/report.json.xz": {"sm90-gqa-score-mod-backward": 54, "mask-mod-drops-causal": 1},
    "head-dims-2026-12-01/sweep/fa4/report.json.xz": {
        "sm90-backward-accum-padding": 28,
        "sm90-backward-d104-d112-compile": 4,
    },
    "head-dims-2026-12-01/classes/fa4/report.json.xz": {"sm90-backward-accum-padding": 1},
}


@cache
def _rejudged(rel: str) -> dict:
    """A committed report, re-judged under the shipped thresholds (as ``gate`` does)."""
    p = H200 / rel
    return rejudge(validate_report(read_json(p, what="report"), str(p)), load_thresholds())


def _report(rel: str = "release/fa4/report.json.xz") -> dict:
    return copy.deepcopy(_rejudged(rel))


def _known_file(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "team.toml"
    p.write_text(body)
    return p


# ---- the grammar ---------------------------------------------------------------------------------

_REC = {
    "case": "c",
    "verdict": "fail",
    "config": {"d": 72, "dv": 64, "heads_q": 4, "heads_kv": 2, "causal": False, "window": [64, 0], "softcap": 15.0,
               "sink": True, "family": "nan_inf_masked", "seqlen_q": 1, "seqlen_k": 239, "score_mod": "alibi"},
    "backward": {"status": "error"},
}  # fmt: skip


@pytest.mark.parametrize(
    ("rule", "holds"),
    [
        ("family in {nan_inf_masked, nan_inf_visible}", True),
        ("family not in {nan_inf_masked}", False),
        ("d != dv and heads_q != heads_kv", True),
        ("d % 32 != 0 and d % 8 == 0 and d <= 128", True),
        ("d % 16 == 0", False),
        ("softcap > 0 and sink and local", True),
        ("not sink", False),
        ("causal", False),
        ("no seqused_k and not varlen", True),
        ("window == (64, 0) and seqlen_q < seqlen_k", True),
        ("window == (None, None)", False),
        ("score_mod in {alibi, relbias} and mask_mod", False),
        ("backward", True),  # called: it raised
        ("fails nonfinite", True),
        ("fails nonfinite:lse", False),
        ("not fails grad-bound", True),
    ],
)
def test_rule_predicates(rule, holds):
    """Each form of the separators' words, and the known file's own (class, fails), on one record."""
    labels = frozenset({("nonfinite", "out"), ("fa-criterion", "out")})
    got = parse_rule(text=rule, where="t").holds(rec=_REC, labels=labels, classes=frozenset(), configuration_only=False)
    assert got is holds


def test_configuration_only_leaves_out_the_failure_predicates():
    """Whether a case exercises an entry: its rule without ``fails`` (negated or not)."""
    r = parse_rule(text="family == nan_inf_masked and fails grad-bound and not fails nonfinite", where="t")
    labels = frozenset({("nonfinite", "out")})
    assert r.holds(rec=_REC, labels=labels, classes=frozenset(), configuration_only=False) is False
    assert r.holds(rec=_REC, labels=labels, classes=frozenset(), configuration_only=True) is True


def test_every_failing_finding_kind_has_a_name():
    """A finding kind the gate can fail on, missing from FAILURE_KINDS, could never be named in a
    known file: 'status' and 'backward' are named by their verdict, out-of-domain and rounding-bias
    (a warning) never fail."""
    kinds = set(findings_module._RENDER) - {"status", "backward", "out-of-domain", "rounding-bias"}
    assert kinds - set(FAILURE_KINDS) == set()


def test_failure_labels_of_a_committed_case():
    rep = _report()
    rec = next(c for c in rep["cases"] if c["case"] == "f16-d64-b2h4k1-s640x128-causal-sink-outliers-seed0")
    assert ("nonfinite", "lse") in failure_labels(rec=rec, thresholds=rep["thresholds"])


# ---- bad input -----------------------------------------------------------------------------------

_GOOD = 'id = "x"\nreason = "r"\nrule = "causal"\nfailures = ["bound"]\n'


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ("[[known]]\n" + _GOOD + "owner = 'me'\n", ["entry 1 ('x')", "unknown key(s) owner", "accepted: id, reason"]),
        ("[[known]]\n" + _GOOD.replace('id = "x"\n', ""), ["entry 1", "missing id", "required: id, reason"]),
        ("[[known]]\n" + _GOOD + "[[known]]\n" + _GOOD, ["entry 2 ('x')", "duplicate id 'x' (also entry 1)"]),
        ("[[known]]\n" + _GOOD.replace("causal", "casual"), ["entry 1 ('x')", "unknown field 'casual'", "causal"]),
        ("[[known]]\n" + _GOOD.replace("causal", "causal or sink"), ["'causal or sink'", "joined by 'and'"]),
        ("[[known]]\n" + _GOOD.replace('"bound"', '"nan"'), ["unknown failure kind 'nan'", "accepted: nonfinite"]),
        ("[[known]]\n" + _GOOD.replace('"bound"', '"bound:dx"'), ["tensor 'dx'", "accepted: out, lse"]),
        ("[[known]]\n" + _GOOD + 'versions = "~4.0"\n', ["versions '~4.0'", "accepted: comma-separated"]),
        ("[[known]]\n" + _GOOD.replace("causal", "d > normal"), ["> compares numbers"]),
        ("[known]\nid = 'x'\n", ["expected [[known]] entries"]),
    ],
)
def test_bad_known_files_exit_2_naming_file_entry_and_what_is_accepted(tmp_path, capsys, body, says):
    path = _known_file(tmp_path, body)
    with pytest.raises(KnownError) as err:
        load_known(str(path))
    for words in [str(path), *says]:
        assert words in str(err.value)
    report = H200 / "fa4-smoke" / "report.json"
    assert cli.main(["gate", str(report), "--known", str(path)]) == 2
    assert says[-1] in capsys.readouterr().err


def test_strict_known_needs_known_and_a_missing_file_is_named(tmp_path, capsys):
    report = str(H200 / "fa4-smoke" / "report.json")
    assert cli.main(["gate", report, "--strict-known"]) == 2
    assert "add --known" in capsys.readouterr().err
    assert cli.main(["gate", report, "--known", str(tmp_path / "none.toml")]) == 2
    assert "none.toml: no such known file" in capsys.readouterr().err


# ---- the shipped file against the committed reports ---------------------------------------------


def test_shipped_file_loads_and_every_entry_has_evidence():
    known = load_known("fa4")
    assert known.path == str(SHIPPED["fa4"])
    assert all(e.evidence and e.kernels == ("fa4",) for e in known.entries)
    assert "copy" in SHIPPED["fa4"].read_text().split("[[known]]")[0]  # its header says it is to copy and edit


@pytest.mark.parametrize("rel", sorted(EXPECTED))
def test_shipped_entries_match_exactly_their_defects_in_the_committed_reports(rel):
    """Each entry matches its defect's failing cases and no other: the counts of docs/known.md; a
    case no second entry would match (the rules are disjoint); what stays failing fails FA's
    criterion alone (item 1's degenerate allowance on dsink and NaN-reference dV, docs/known.md)."""
    known = load_known("fa4")
    rep = apply_known(report=_report(rel), known=known)
    got = {e["id"]: e["matched"] for e in rep["known"]["entries"] if e["matched"]}
    assert got == EXPECTED[rel]
    for e in known.entries:  # each entry alone: a known case is matched by its own entry only
        alone = apply_known(report=_report(rel), known=type(known)(path=known.path, entries=(e,)))
        mine = {c["case"] for c in alone["cases"] if c["verdict"] == KNOWN}
        assert mine == {c["case"] for c in rep["cases"] if c.get("known_id") == e.id}, e.id
    left = [c for c in rep["cases"] if c["verdict"] in FAILING]
    kinds = {k for c in left for k, _ in failure_labels(rec=c, thresholds=rep["thresholds"])}
    assert kinds <= {"fa-criterion"}, (rel, kinds)
    assert exit_code(rep) == (1 if left else 0)


# ---- the verdict known in a report ---------------------------------------------------------------


def test_a_new_defect_not_in_the_file_still_fails():
    """Two seeded defects: a known case that also fails another way (the FP64 reference
    uncertified), and a passing case made to fail its bound; both keep fail, the run exits 1."""
    known = load_known("fa4")
    rep = _report()
    assert exit_code(apply_known(report=rep, known=known)) == 0
    leak = next(c for c in rep["cases"] if c["config"]["family"] == "nan_inf_masked" and c["verdict"] == "fail")
    normal = next(c for c in rep["cases"] if c["config"]["family"] == "normal" and c["verdict"] == "pass")
    leak["mpmath_max_abs"] = 1.0
    normal["bound"] = {**normal["bound"], "violations": 7, "tightness": 3.0}
    seeded = apply_known(report=rejudge(rep, rep["thresholds"]), known=known)
    verdicts = {c["case"]: c["verdict"] for c in seeded["cases"]}
    assert verdicts[leak["case"]] == "fail" and verdicts[normal["case"]] == "fail"
    assert seeded["summary"]["verdicts"]["fail"] == 2
    assert exit_code(seeded) == 1


def test_an_entry_no_longer_reproducing_is_reported_and_fails_only_when_strict():
    """The sink overflow "fixed": its four cases' LSE finite and within the bound."""
    known = load_known("fa4")
    rep = _report()
    for c in rep["cases"]:
        if c["config"]["family"] == "outliers" and c["config"]["sink"] and c["verdict"] == "fail":
            c["lse"] = {**c["lse"], "nonfinite_where_ref_finite": 0, "nonfinite_mismatches": {}}
            c["bound"] = {**c["bound"], "violations": 0, "lse_violations": 0}
    rep = rejudge(rep, rep["thresholds"])
    loose, strict = apply_known(report=rep, known=known), apply_known(report=rep, known=known, strict=True)
    entry = next(e for e in loose["known"]["entries"] if e["id"] == "sink-lse-overflow")
    assert entry["status"] == "no longer reproducing" and entry["exercised"] > 0
    assert loose["known"]["not_reproducing"] == ["sink-lse-overflow"]
    assert any(line.startswith("  NO LONGER REPRODUCING sink-lse-overflow") for line in known_lines(loose))
    assert exit_code(loose) == 0
    assert exit_code(strict) == 1


def test_entries_apply_only_to_their_kernels_and_versions(tmp_path):
    rep = _report()
    for version, applies in (("4.0.0b35", False), ("4.0.0b36", True), ("4.0.0b40", True), ("4.0.0", False)):
        rep["environment"]["flash-attn-4"] = version
        body = "[[known]]\n" + _GOOD.replace("causal", "sink") + 'versions = ">=4.0.0b36, <4.0.0rc1"\n'
        path = _known_file(tmp_path, body)
        got = apply_known(report=rep, known=load_known(str(path)))["known"]["entries"][0]
        assert (got["status"] != "not applicable") is applies, version
    rep["kernel"] = "fa4-model-sm90"
    got = apply_known(report=rep, known=load_known("fa4"))["known"]["entries"][0]
    assert got["status"] == "not applicable" and "kernel fa4-model-sm90" in got["not_applicable"]


def test_a_known_report_is_written_and_read_back(tmp_path):
    rep = apply_known(report=_report(), known=load_known("fa4"), strict=True)
    paths = write_report(rep, tmp_path, maps=0)
    back = validate_report(json.loads(paths["json"].read_text()), "back")
    assert back["summary"]["verdicts"][KNOWN] == 86 and back["known"]["strict"] is True
    md = paths["md"].read_text()
    assert "## Known defects" in md and "KNOWN masked-key-nonfinite-leak: 82 case(s)" in md
    assert "known (sink-lse-overflow)" in md
    assert 'message="known defect masked-key-nonfinite-leak' in paths["junit"].read_text()
    bad = json.loads(paths["json"].read_text())
    case = next(c for c in bad["cases"] if c["verdict"] == KNOWN)
    del case["known_id"]
    with pytest.raises(ReportError, match=r"known_id: missing"):
        validate_report(bad, "bad")


def test_run_options_carry_the_known_file_to_a_child():
    opts = RunOptions(known=load_known("fa4"), strict_known=True)
    back = RunOptions.from_json(opts.to_json())
    assert back.known == opts.known and back.strict_known is True


# ---- the commands --------------------------------------------------------------------------------


def test_gate_diff_and_show_with_the_shipped_file(tmp_path, capsys):
    report = str(H200 / "release" / "fa4" / "report.json.xz")
    assert cli.main(["gate", report]) == 1
    capsys.readouterr()
    out = tmp_path / "gated"
    assert cli.main(["gate", report, "--known", "fa4", "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "KNOWN masked-key-nonfinite-leak: 82 case(s)" in said and "known 86" in said
    assert "FAIL " not in said
    assert cli.main(["show", str(out / "report.json"), "--case", "*causal-sink-outliers-seed0"]) == 0
    assert "known defect sink-lse-overflow (was fail)" in capsys.readouterr().out
    assert cli.main(["diff", report, str(out / "report.json"), "--known", "fa4"]) == 0
    assert "got worse" in capsys.readouterr().out
    assert cli.main(["diff", report, str(out / "report.json")]) == 0  # fail -> known: not worse
    said = capsys.readouterr().out
    assert "fail -> known (known: sink-lse-overflow)" in said and "(worse)" not in said


@pytest.mark.slow
def test_run_with_a_known_file_fails_only_on_what_it_does_not_describe(tmp_path, capsys):
    """A kernel that ignores causal masking, and a team file that knows it on square causal cases
    only: the square case is known (exit 0), a rectangular causal case still fails (exit 1)."""
    path = _known_file(
        tmp_path,
        '[[known]]\nid = "no-causal"\nreason = "ignores causal"\nrule = "causal and seqlen_q == seqlen_k"\n'
        'failures = ["bound", "fa-criterion", "lse-ceiling", "nonfinite"]\n',
    )
    square = json.dumps({"d": 64, "dv": 64, "seqlen_q": 64, "seqlen_k": 64, "causal": True})
    rect = json.dumps({"d": 64, "dv": 64, "seqlen_q": 32, "seqlen_k": 64, "causal": True})
    base = ["run", "--kernel", "tests.bugged_kernels:no_causal_mask", "--known", str(path), "--quiet"]
    assert cli.main([*base, "--config", square, "--out", str(tmp_path / "a")]) == 0
    assert "KNOWN no-causal: 1 case(s): ignores causal" in capsys.readouterr().out
    assert cli.main([*base, "--config", square, "--config", rect, "--out", str(tmp_path / "b")]) == 1
    said = capsys.readouterr().out
    assert "FAIL " in said and "s32x64" in said


def test_diff_does_not_count_a_move_into_known_as_worse(tmp_path, capsys):
    """A case passing in the base and failing the known way in the candidate is listed with its
    entry, not counted worse (exit 0); the same move into fail is worse (exit 1)."""
    base = _report()
    leak = next(c for c in base["cases"] if c["config"]["family"] == "nan_inf_masked" and c["verdict"] == "fail")
    leak["verdict"] = "pass"
    (tmp_path / "base.json").write_text(json.dumps(base))
    cand = str(H200 / "release" / "fa4" / "report.json.xz")
    assert cli.main(["diff", str(tmp_path / "base.json"), cand, "--known", "fa4"]) == 0
    said = capsys.readouterr().out
    assert f"{leak['case']}: pass -> known (known: masked-key-nonfinite-leak)" in said and "(worse)" not in said
    assert cli.main(["diff", str(tmp_path / "base.json"), cand]) == 1
    assert f"{leak['case']}: pass -> fail (worse)" in capsys.readouterr().out


@pytest.mark.slow
def test_the_pytest_fixture_takes_a_known_file(pytester, monkeypatch, tmp_path):
    """``fa4_audit(..., known=FILE)``: the kernel that ignores causal masking passes its test when the
    file knows the defect, and fails it with ``strict_known`` on a case the entry no longer fails."""
    path = _known_file(
        tmp_path,
        '[[known]]\nid = "no-causal"\nreason = "ignores causal"\nrule = "causal"\n'
        'failures = ["bound", "fa-criterion", "lse-ceiling", "nonfinite"]\n',
    )
    one = "bf16-d64-b2h4k2-s200x300-causal-normal-seed0"  # a causal smoke case
    pytester.makepyfile(
        f"""
        def test_known(fa4_audit):
            rep = fa4_audit("tests.bugged_kernels:no_causal_mask", case={one!r}, known={str(path)!r})
            assert rep["summary"]["verdicts"]["known"] >= 1

        def test_strict(fa4_audit):
            fa4_audit("tests.bugged_kernels:exact", case={one!r}, known={str(path)!r}, strict_known=True)
        """
    )
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    result = pytester.runpytest_subprocess("-p", "no:hypothesispytest", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        ["*has a known defect no longer reproducing (strict_known)*", "*NO LONGER REPRODUCING no-causal*"]
    )


def test_the_gradients_summary_counts_a_known_case_as_known():
    """H200, 4.0.0b40 smoke --backward with --known fa4 (reports/h200/gate-2026-12-04): the six
    known cases' gradients fail on their own but are the known defects' failures; the summary
    line counts them as known, not as fail, beside an exit code of 0."""
    from audits.report.build import exit_code, summary_line

    rep = read_json(ROOT / "reports/h200/gate-2026-12-04/b40/smoke-backward/report.json.xz", what="report")
    line = summary_line(rep)
    assert "gradients: 110 of 123 cases audited (pass 99, warn 5, known 6," in line, line
    assert "fail" not in line and exit_code(rep) == 0
