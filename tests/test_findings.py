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
        bound={"kind": "fa4", "violations": 12, "lse_violations": 3, "tightness": 4.5, "lse_tightness": 8.1},
        fa_criterion={"max_abs": 0.5, "lowprec_max_abs": 0.01, "rounding": 0.004},
        out={**ERRORS, "nonfinite_where_ref_finite": 2048},
    )
    found = findings(rec, TH)
    assert [(f.severity, f.kind, f.quantity) for f in found] == [
        ("fail", "nonfinite", "out"),
        ("fail", "bound", "out"),
        ("fail", "bound", "LSE"),
        ("fail", "fa-criterion", "out"),
    ]
    bound, lse, fa = found[1], found[2], found[3]
    assert (bound.count, bound.worst, bound.allowed, bound.ratio) == (12, 4.5, 1.0, 4.5)
    assert (lse.count, lse.worst, lse.ratio) == (3, 8.1, 8.1)  # the LSE's own ratio, not the output's
    assert fa.worst == 0.5 and fa.allowed == pytest.approx(2 * 0.01 + 2 * 0.004) and fa.ratio > 1
    verdict, reasons = judge(rec, TH)
    assert verdict == "fail" and reasons == [render(f) for f in found] == [f.message for f in found]
    assert reasons == [
        "2,048 outputs: the kernel returns NaN or inf where the FP64 reference is finite",
        "out: 12 outputs exceed the forward-pass bound, worst 4.5x; FA's criterion fails the output; the exact "
        "reference agrees, so the kernel errs beyond rounding, not the reference",
        "LSE: 3 values exceed the forward-pass bound, worst 8.1x; FA's criterion fails the output; the LSE is "
        "within its ceiling; the exact reference agrees, so the kernel errs beyond rounding, not the reference",
        "FA criterion: max|out - ref| 0.5 > allowed 0.028",
    ]


def test_a_case_failing_on_its_lse_alone_names_the_lse_and_its_own_ratio():
    """The field case (issue 33): 0 outputs and 186 LSE values past the bound, the output's ratio
    0.307 and the LSE's 8.1; FA's criterion passes the output and the exact reference agrees."""
    rec = record(
        bound={"kind": "fa4", "violations": 0, "lse_violations": 186, "tightness": 0.307, "lse_tightness": 8.1}
    )
    assert judge(rec, TH) == (
        "fail",
        [
            "LSE: 186 values exceed the forward-pass bound, worst 8.1x; FA's criterion passes the output; the LSE "
            "is within its ceiling; the exact reference agrees, so the kernel's arithmetic is outside the analysed "
            "one, not the reference"
        ],
    )
    uncertified = record(bound=rec["bound"], mpmath_max_abs=None)
    (why,) = judge(uncertified, TH)[1]
    assert why.endswith("the exact reference was not evaluated on this case, so the FP64 one is unconfirmed")
    wrong_ref = record(bound=rec["bound"], mpmath_max_abs=1e-3)
    assert "the exact reference disagrees with the FP64 one, so the reference is suspect" in judge(wrong_ref, TH)[1][0]
    old = record(bound={"kind": "fa4", "violations": 0, "lse_violations": 186, "tightness": 0.307})  # no lse_tightness
    assert judge(old, TH)[1][0].startswith("LSE: 186 values exceed the forward-pass bound, worst unknown;")


def test_non_finite_results_are_said_once_and_not_as_a_bound_ratio():
    """An all-NaN kernel (issue 33, "figures that are not true"): its NaN outputs and LSE are the
    non-finite finding's, never "exceed the bound, worst 0x"; the LSE is not "within its ceiling";
    a mix counts only the finite violations beside their own ratio."""
    nan = {**ERRORS, "nonfinite_where_ref_finite": 640, "max_abs": 0.0, "checked": 640}
    rec = record(
        out=nan,
        lse={**nan, "mismatched_nonfinite": 0, "ref_max_abs": 3.0, "checked": 40, "nonfinite_where_ref_finite": 40},
        bound={"kind": "fa4", "violations": 640, "nonfinite": 640, "lse_violations": 40, "lse_nonfinite": 40,
               "tightness": 0.0, "lse_tightness": 0.0},
    )  # fmt: skip
    kinds = [(f.kind, f.quantity) for f in findings(rec, TH)]
    assert ("bound", "out") not in kinds and ("bound", "LSE") not in kinds, kinds
    assert ("nonfinite", "out") in kinds and ("nonfinite", "LSE") in kinds, kinds
    mixed = record(
        out={**ERRORS, "nonfinite_where_ref_finite": 1},
        bound={"kind": "fa4", "violations": 3, "nonfinite": 1, "lse_violations": 2, "lse_nonfinite": 0,
               "tightness": 4.0, "lse_tightness": 2.0},
        lse={**ERRORS, "mismatched_nonfinite": 0, "max_abs": 1e-6, "ref_max_abs": 3.0,
             "nonfinite_where_ref_finite": 1},
    )  # fmt: skip
    out_bound, lse_bound = (f for f in findings(mixed, TH) if f.kind == "bound")
    assert (out_bound.count, out_bound.worst) == (2, 4.0)
    assert "the LSE is beyond its ceiling" in lse_bound.message, lse_bound.message


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


def test_a_gradient_beyond_its_bound_names_it_with_its_ratio_and_evidence():
    grad = {**ERRORS, "bound": {"violations": 12, "tightness": 3.1}}
    fa = {"max_abs": 0.01, "lowprec_max_abs": 0.01, "rounding": 0.004}
    rec = record(
        config={"dtype": "bfloat16"},
        backward={
            "status": "ran",
            "bound_kind": "fa4",
            "missing": [],
            "grads": {"dq": {**grad, "fa_criterion": fa}},
            "zeros": {"dk_unseen_nonzero": 0, "dv_unseen_nonzero": 0, "dq_empty_nonzero": 0},
            "certified": {"dq": 1e-16},
        },
    )
    assert judge(rec, TH) == (
        "fail",
        [
            "dq: 12 elements exceed the backward bound, worst 3.1x; FA's criterion passes dq; the exact dq agrees, "
            "so the kernel's arithmetic is outside the analysed one, not the reference"
        ],
    )
    rec["backward"]["certified"] = {}  # dq's exact elements not evaluated
    assert judge(rec, TH)[1][0].endswith("the exact dq was not evaluated on this case, so the FP64 one is unconfirmed")


def test_the_reference_is_certified_at_its_rows_scale():
    """bf16 near_max, |V| ~ 3e38: the FP64 reference differs from the exact row by ~6e22, 1e-16 of
    the row's scale.  The exact kernel (FP64 rounded once, no float32 overflow) passes; under the
    absolute threshold alone (a record without its scale) it would fail "not certified"."""
    import torch

    from audits.engine.evaluate import evaluate_case
    from audits.suites.cases import Case
    from tests.bugged_kernels import exact

    case = Case(
        dtype="bfloat16", d=64, dv=64, batch=1, heads_q=2, heads_kv=2, seqlen_q=64, seqlen_k=200, family="near_max"
    )
    rec = evaluate_case("exact", exact, case, torch.device("cpu"), TH)
    assert rec["verdict"] == "pass", rec["reasons"]
    assert rec["mpmath_max_abs"] > 1e20 and rec["mpmath_scale"] > 1e38
    assert rec["mpmath_max_abs"] <= TH["reference"]["mpmath_max_abs"] * rec["mpmath_scale"]
    unscaled = {k: v for k, v in rec.items() if k != "mpmath_scale"}
    verdict, reasons = judge(unscaled, TH)
    assert verdict == "fail" and reasons[0].startswith("FP64 reference not certified: differs from the exact row by")
