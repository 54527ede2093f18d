"""FA's criterion keeps a floor, the rounding at the quantity's own scale (thresholds.toml, [policy]
fa_criterion): no false alarm where PyTorch's low-precision error is exactly 0 (one key per row:
dq = dk = 0, field case of issue 33), while seeded bugs still fail it; records without the scale
keep FA's allowance alone."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from audits.engine.backward import BackwardOptions
from audits.engine.options import RunOptions
from audits.engine.run import run_suites
from audits.suites.case import case_from_dict
from audits.verdict.gate import (
    DSINK_ROUNDED_OUT,
    DSINK_TAIL,
    FA_FLOOR,
    fa_allowed,
    findings,
    grad_fa_allowed,
    judge,
    load_thresholds,
)

TH = load_thresholds()
ONE_KEY = [
    {"dtype": "bfloat16", "d": 64, "dv": 64, "heads_q": 2, "heads_kv": 2, "seqlen_q": q, "seqlen_k": 1} for q in (1, 3)
]
SCALE_KEYS = ("scale", "head_scales")


def _attention(q, k, v, bug):
    """Plain float32 attention (no mask, no sink, heads_q == heads_kv), with an FA-style
    float32 backward (D from the output rounded to the input dtype) and one seeded ``bug``:
    None, "forgets_d" (dS = P dP), "dv_scaled" (dV x 1.05), "wrong_scale" (softmax scale x 1.05)."""

    class Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            scale = q.shape[-1] ** -0.5 * (1.05 if bug == "wrong_scale" else 1.0)
            s = torch.einsum("bihd,bjhd->bhij", q.float() * scale, k.float())
            p = torch.softmax(s, -1)
            out = torch.einsum("bhij,bjhc->bihc", p, v.float()).to(q.dtype)
            ctx.save_for_backward(q, k, v, p, out)
            ctx.scale = scale
            return out, torch.logsumexp(s, -1)

        @staticmethod
        def backward(ctx, do, dlse):
            q, k, v, p, out = ctx.saved_tensors
            do = do.float()
            dp = torch.einsum("bihc,bjhc->bhij", do, v.float())
            d = (do * out.float()).sum(-1).transpose(1, 2)[..., None]
            ds = p * dp if bug == "forgets_d" else p * (dp - d)
            dq = torch.einsum("bhij,bjhd->bihd", ds, k.float()) * ctx.scale
            dk = torch.einsum("bhij,bihd->bjhd", ds, q.float()) * ctx.scale
            dv = torch.einsum("bhij,bihc->bjhc", p, do) * (1.05 if bug == "dv_scaled" else 1.0)
            return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

    return Fn.apply(q, k, v)


def clean(q, k, v, *, return_lse=False, **kw):
    out, lse = _attention(q, k, v, None)
    return (out, lse) if return_lse else out


def forgets_d(q, k, v, *, return_lse=False, **kw):
    out, lse = _attention(q, k, v, "forgets_d")
    return (out, lse) if return_lse else out


def dv_scaled(q, k, v, *, return_lse=False, **kw):
    out, lse = _attention(q, k, v, "dv_scaled")
    return (out, lse) if return_lse else out


def wrong_scale(q, k, v, *, return_lse=False, **kw):
    out, lse = _attention(q, k, v, "wrong_scale")
    return (out, lse) if return_lse else out


def _run(tmp_path, kernels: list[str], configs: list[dict]) -> dict[str, list[dict]]:
    spec = {k: k if "-" in k else f"{Path(__file__).resolve()}:{k}" for k in kernels}
    cases = [case_from_dict(c) for c in configs]
    options = RunOptions(out=tmp_path, label="fa-floor", isolate=False, backward=BackwardOptions(repeat=1))
    recs = run_suites(list(spec.values()), cases, options)
    return {k: recs[s] for k, s in spec.items()}


def _without_scale(rec: dict) -> dict:
    """The record as a report written before the scale was measured holds it."""
    old = copy.deepcopy(rec)
    old["fa_criterion"] = {k: v for k, v in old["fa_criterion"].items() if k not in SCALE_KEYS}
    for g in old["backward"]["grads"].values():
        g["fa_criterion"] = {k: v for k, v in g["fa_criterion"].items() if k not in SCALE_KEYS}
    return old


def _fa_reasons(rec: dict) -> list[str]:
    return [r for r in judge(rec, TH)[1] if r.startswith("FA criterion")]


@pytest.mark.slow  # ~10 s CPU
def test_one_key_per_row_no_false_alarm_and_seeded_bugs_still_fail(tmp_path):
    recs = _run(tmp_path, ["fa4-model", "clean", "forgets_d", "dv_scaled"], ONE_KEY)
    for kernel in ("fa4-model", "clean"):  # correct: dq, dk = 0 exactly, the kernel's float32 noise
        for rec in recs[kernel]:
            dq = rec["backward"]["grads"]["dq"]["fa_criterion"]
            assert dq["lowprec_max_abs"] == 0 and dq["rounding"] == 0 and 0 < dq["max_abs"] < 1e-6, dq
            assert FA_FLOOR * dq["scale"] > 100 * dq["max_abs"]  # loose: far above the float32 noise
            assert judge(rec, TH) == ("pass", []), (kernel, rec["case"])
            # without the scale (an old report's record) FA's allowance alone is 0: the false alarm
            assert _fa_reasons(_without_scale(rec))[0].startswith("FA criterion: max|dq - ref|")
            assert _fa_reasons(_without_scale(rec))[0].endswith("> allowed 0")
    for rec in recs["forgets_d"]:  # dS = P dP: dq = scale dP K against S = scale (|dP| + |D|) |K|, |D| = |dP|
        dq = rec["backward"]["grads"]["dq"]["fa_criterion"]
        allowed = grad_fa_allowed(m=rec, grad="dq", th=TH)
        assert allowed == FA_FLOOR * dq["scale"] and dq["max_abs"] > 1e4 * allowed  # ~2**15 x
        why = _fa_reasons(rec)
        assert why[0].startswith("FA criterion: max|dq - ref|") and "(the floor at its scale " in why[0]
    for rec in recs["dv_scaled"]:  # dV = dO exactly: its scale is |dV| itself, the floor is FA's own
        dv = rec["backward"]["grads"]["dv"]["fa_criterion"]
        assert grad_fa_allowed(m=rec, grad="dv", th=TH) == grad_fa_allowed(m=_without_scale(rec), grad="dv", th=TH)
        assert [r.split(" ref|")[0] for r in _fa_reasons(rec)] == ["FA criterion: max|dv -"], dv


@pytest.mark.slow  # ~5 s CPU
def test_a_wrong_softmax_scale_still_fails_the_output_where_it_did(tmp_path):
    cfg = {"dtype": "bfloat16", "d": 64, "dv": 64, "heads_q": 2, "heads_kv": 2, "seqlen_q": 64, "seqlen_k": 128}
    recs = _run(tmp_path, ["wrong_scale", "clean"], [cfg])
    (bad,), (good,) = recs["wrong_scale"], recs["clean"]
    assert judge(good, TH) == ("pass", [])
    old, new = fa_allowed(m=_without_scale(bad), th=TH), fa_allowed(m=bad, th=TH)
    assert bad["fa_criterion"]["max_abs"] > 2 * max(old, new)
    assert any(r.startswith("FA criterion: max|out - ref|") for r in _fa_reasons(bad))


def test_the_floor_is_the_larger_of_the_two_and_absent_from_old_records():
    rec = {
        "config": {"dtype": "bfloat16"},
        "fa_criterion": {
            "max_abs": 0.01,
            "lowprec_max_abs": 0.0,
            "rounding": 0.0,
            "scale": 256.0,
        },
    }
    assert FA_FLOOR == 2.0**-16 and fa_allowed(m=rec, th=TH) == 2.0**-8
    assert judge_fa(rec) == ["FA criterion: max|out - ref| 0.01 > allowed 0.00391 (the floor at its scale 256)"]
    big = {**rec, "fa_criterion": {**rec["fa_criterion"], "lowprec_max_abs": 0.1}}  # FA's own allowance is larger
    assert fa_allowed(m=big, th=TH) == pytest.approx(0.2) and judge_fa(big) == []
    old = {**rec, "fa_criterion": {k: v for k, v in rec["fa_criterion"].items() if k not in SCALE_KEYS}}
    assert fa_allowed(m=old, th=TH) == 0 and judge_fa(old) == ["FA criterion: max|out - ref| 0.01 > allowed 0"]


def judge_fa(rec: dict) -> list[str]:
    return [f.message for f in findings({"status": "ran", "out": _OK, **rec}, TH) if f.kind == "fa-criterion"]


_OK = {"max_abs": 0.0, "nonfinite_where_ref_finite": 0, "nan_swallowed": 0}


# The documented dsink false alarms (docs/backward.md, "FA4's dsink can miss FA's own dsink
# criterion"): four of the 17 H200 release-backward cases that fail FA's criterion on dsink alone,
# small enough for CPU.  tests/bugged_backward.py's clean kernel takes D from the returned 16-bit O
# as FA4 does; its seeded dsink bugs must still fail.
DSINK_CASES = [
    {"dtype": "float16", "d": 64, "dv": 64, "batch": 2, "heads_q": 4, "heads_kv": 4, "seqlen_q": 1, "seqlen_k": 239,
     "window": [64, 0], "softcap": 15.0, "sink": True, "family": "nan_inf_masked"},
    {"dtype": "bfloat16", "d": 64, "dv": 64, "batch": 2, "heads_q": 8, "heads_kv": 2, "seqlen_q": 3, "seqlen_k": 799,
     "window": [64, 0], "sink": True, "family": "nan_inf_masked"},
    {"dtype": "float16", "d": 64, "dv": 64, "batch": 2, "heads_q": 4, "heads_kv": 4, "seqlen_q": 1, "seqlen_k": 239,
     "causal": True, "softcap": 15.0, "sink": True, "family": "near_max"},
]  # fmt: skip


def _without_out_rss(rec: dict) -> dict:
    old = copy.deepcopy(rec)
    old["backward"]["grads"]["dsink"]["fa_criterion"].pop("head_out_rss")
    return old


def test_dsink_from_the_rounded_output_passes_and_seeded_dsink_bugs_still_fail(tmp_path):
    import tests.bugged_backward as bb

    torch.manual_seed(0)
    kernels = ["clean", "bug_sink_grad_missing", "bug_sink_grad_wrong_sign"]
    recs = bb.audit(kernels, [case_from_dict(c) for c in DSINK_CASES], BackwardOptions(repeat=1), tmp_path)
    for rec in recs["clean"]:
        assert judge(rec, TH) == ("pass", []), rec["case"]
        # without the rounded output's term (an old record) FA's criterion fails dsink alone
        v, why = judge(_without_out_rss(rec), TH)
        assert v == "fail" and len(why) == 1 and why[0].startswith("FA criterion: dsink of"), why
    for bug, least in (("bug_sink_grad_missing", 10.0), ("bug_sink_grad_wrong_sign", 20.0)):
        for rec in recs[bug]:
            fa = rec["backward"]["grads"]["dsink"]["fa_criterion"]
            allowed = grad_fa_allowed(m=rec, grad="dsink", th=TH)
            assert max(e / a for e, a in zip(fa["errors"], allowed)) > least, (bug, rec["case"])
            assert [r.split(" head(s)")[0] for r in _fa_reasons(rec)] == [f"FA criterion: dsink of {len(allowed)}"]


def test_the_rounded_output_term_is_8u_rss_per_head_and_absent_from_old_records():
    fa = {"max_abs": 1.0, "lowprec_max_abs": 0.0, "rounding": 0.0, "errors": [1.0, 0.5], "ulps_at_ref": [0.0, 0.0]}
    rec = {"config": {"dtype": "bfloat16"}, "backward": {"grads": {"dsink": {"fa_criterion": fa}}}}
    assert grad_fa_allowed(m=rec, grad="dsink", th=TH) == [0.0, 0.0]  # an old record: FA's allowance alone
    fa["head_out_rss"] = [64.0, 16.0]
    assert DSINK_ROUNDED_OUT * DSINK_TAIL == 8.0
    assert grad_fa_allowed(m=rec, grad="dsink", th=TH) == [8 * 2.0**-8 * 64, 8 * 2.0**-8 * 16]  # 2.0, 0.5
    rec["config"]["dtype"] = "float16"
    assert grad_fa_allowed(m=rec, grad="dsink", th=TH) == [8 * 2.0**-11 * 64, 8 * 2.0**-11 * 16]
