"""The gate's findings: typed records of what each check found, put into words by one renderer,
whose words are a case record's ``reasons``; and the upgrades of what older reports recorded."""

from __future__ import annotations

import dataclasses

import pytest

from audits.report.schema import upgrade_thresholds
from audits.verdict.findings import Finding, render
from audits.verdict.gate import against_baseline, findings, judge, judge_against_baseline, load_thresholds

TH = load_thresholds()
ERRORS = {"max_abs": 0.01, "nonfinite_where_ref_finite": 0, "nan_swallowed": 0}


def record(**over) -> dict:
    """A ran forward case record, every figure within its thresholds unless ``over`` says."""
    rec = {
        "case": "c",
        "config": {"dtype": "bfloat16"},
        "status": "ran",
        "out": dict(ERRORS),
        "lse": {**ERRORS, "mismatched_nonfinite": 0, "max_abs": 1e-5, "ref_max_abs": 3.0},
        "bound": {"kind": "fa4", "violations": 0, "lse_violations": 0, "tightness": 0.5},
        "fa_criterion": {"max_abs": 0.01, "lowprec_max_abs": 0.01, "rounding": 0.004},
        "mpmath_max_abs": 1e-16,
    }
    return {**rec, **over}


def test_a_passing_record_has_no_finding():
    assert findings(record(), TH) == [] and judge(record(), TH) == ("pass", [])


def test_findings_carry_the_figures_and_render_to_the_reasons():
    rec = record(
        bound={"kind": "fa4", "violations": 12, "lse_violations": 3, "tightness": 4.5},
        fa_criterion={"max_abs": 0.5, "lowprec_max_abs": 0.01, "rounding": 0.004},
        out={**ERRORS, "nonfinite_where_ref_finite": 2048},
    )
    found = findings(rec, TH)
    assert [(f.severity, f.kind, f.quantity) for f in found] == [
        ("fail", "nonfinite", "out"),
        ("fail", "bound", "out"),
        ("fail", "fa-criterion", "out"),
    ]
    bound, fa = found[1], found[2]
    assert (bound.count, bound.worst, bound.allowed, bound.ratio) == (12, 4.5, 1.0, 4.5)
    assert fa.worst == 0.5 and fa.allowed == pytest.approx(2 * 0.01 + 2 * 0.004) and fa.ratio > 1
    verdict, reasons = judge(rec, TH)
    assert verdict == "fail" and reasons == [render(f) for f in found] == [f.message for f in found]
    assert reasons == [
        "2,048 outputs: the kernel returns NaN or inf where the FP64 reference is finite",
        "12 outputs and 3 LSE values exceed the forward-pass bound (worst error/bound 4.5) — a bug in the "
        "kernel or in the analysis",
        "FA criterion: max|out - ref| 0.5 > allowed 0.028",
    ]


def test_a_finding_is_a_frozen_value():
    f = Finding("warn", "lse-missing", "LSE")
    with pytest.raises(dataclasses.FrozenInstanceError):
        f.severity = "fail"  # type: ignore[misc]
    assert render(f) == "LSE not returned: not audited" and f.ratio is None


def test_a_status_finding_keeps_the_records_reason():
    rec = {"case": "c", "config": {}, "status": "timeout", "reason": "no answer after 60 s"}
    assert judge(rec, TH) == ("timeout", ["no answer after 60 s"])


def test_baseline_findings_render_as_before():
    th = {**TH, "baseline": {"max_ratio": 2.0}}
    worse = record(out={**ERRORS, "max_abs": 0.1})
    (f,) = against_baseline(worse, record(), th)
    assert (f.kind, f.quantity, f.worst, f.allowed, f.detail["baseline"]) == (
        "baseline",
        "max |out - ref|",
        0.1,
        2.0,
        0.01,
    )
    assert judge_against_baseline(worse, record(), th) == ["max |out - ref| 0.1 > 2 x baseline 0.01"]


def test_thresholds_recorded_before_lse_rel_and_lse_missing_judge_as_then():
    old = {k: v for k, v in TH.items()}
    old["lse"] = {"max_abs": TH["lse"]["max_abs"]}
    old["policy"] = {k: v for k, v in TH["policy"].items() if k != "lse_missing"}
    up = upgrade_thresholds(old)
    assert up["lse"] == {"rel": 0.0, "max_abs": TH["lse"]["max_abs"]} and up["policy"]["lse_missing"] == "warn"
    assert "rel" not in old["lse"]  # the report's own record is left as recorded
    assert upgrade_thresholds(TH)["lse"] == TH["lse"]
