"""Evidence beside a bound violation (issue 33, "kernel or analysis"): the FA4 model of the
arithmetic the bound analyses, run on the same inputs against the same bound, says which of the
two is at fault: within it, the kernel departs from that arithmetic; beyond it too, the analysis
misses a step."""

from __future__ import annotations

import json

from audits import cli
from audits.verdict.gate import findings, load_thresholds
from fa4.model import attention as model

TH = load_thresholds()
CASE = "bf16-d64-b2h4k2-s200x300-causal-normal-seed0"  # a smoke case


def lse_off(q, k, v, *, return_lse=False, **kw):
    """The model with its LSE moved by 1e-4: outside the analysed arithmetic, within FA's criterion."""
    out, lse = model(q, k, v, return_lse=True, **kw)
    return (out, lse + 1e-4) if return_lse else out


def test_a_kernel_past_the_bound_is_told_apart_from_the_analysis(tmp_path):
    out = tmp_path / "o"
    argv = ["run", "--quiet", "--no-isolate", "--kernel", f"{__file__}:lse_off", "--suite", "smoke", "--case", CASE]
    assert cli.main([*argv, "--out", str(out)]) == 1
    (rec,) = json.loads((out / "report.json").read_text())["cases"]
    mc = rec["model_check"]
    assert mc["numerics"] == "peer" and mc["lse_violations"] == 0 and mc["violations"] == 0, mc
    (why,) = rec["reasons"]
    assert why.startswith("LSE: 1,600 values exceed the forward-pass bound"), why
    assert "the FA4 model of generic flash-attention arithmetic on the same inputs stays within the bound" in why
    assert why.endswith("so the kernel departs from the arithmetic the bound covers (not the reference)"), why


def _record(model_check: dict) -> dict:
    errors = {"max_abs": 1e-5, "nonfinite_where_ref_finite": 0, "nan_swallowed": 0}
    return {
        "case": "c",
        "config": {"dtype": "bfloat16"},
        "status": "ran",
        "out": dict(errors),
        "lse": {**errors, "mismatched_nonfinite": 0, "ref_max_abs": 3.0},
        "bound": {"kind": "fa4", "violations": 4, "lse_violations": 0, "tightness": 2.5, "lse_tightness": 0.1},
        "fa_criterion": {"max_abs": 0.001, "lowprec_max_abs": 0.01, "rounding": 0.004},
        "mpmath_max_abs": 1e-16,
        "model_check": model_check,
    }


def test_a_model_beyond_the_bound_too_points_at_the_analysis():
    beyond = {"numerics": "fa4", "violations": 3, "tightness": 2.4, "lse_violations": 0, "lse_tightness": 0.1}
    (f,) = findings(_record(beyond), TH)
    assert f.kind == "bound" and f.quantity == "out"
    assert "the FA4 model of this kernel's FA4 arithmetic on the same inputs exceeds it too, worst 2.4x" in f.message
    assert f.message.endswith("so the analysis misses a step of that arithmetic (or the model does)"), f.message
    within = {**beyond, "violations": 0, "tightness": 0.3}
    (g,) = findings(_record(within), TH)
    assert "stays within the bound" in g.message and "departs from the arithmetic the bound covers" in g.message
