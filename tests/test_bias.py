"""Rounding bias (docs/diagnosis.md, "Rounding bias"): the signed-bias statistic
(numerics.metrics.signed_bias), the tied_max family and the bias suite, the gate's rounding-bias
warning under [bias], and the rounding_bias cause (audits.verdict.bias)."""

import functools
import math

import pytest
import torch

from audits.engine.evaluate import evaluate_case
from audits.kernels import get_kernel
from audits.suites.case import case_from_dict
from audits.suites.cases import bias_suite, suite
from audits.suites.inputs import ADVERSARIAL_FAMILIES, FAMILIES, TIED_STRIDE, make_inputs
from audits.verdict.bias import bias_cause
from audits.verdict.gate import ThresholdsError, bias_findings, judge, load_thresholds
from numerics.call import AttentionCall
from numerics.metrics import bias_record, signed_bias
from numerics.reference import attention_reference
from tests.bugged_kernels import exact
from tests.cause_bugs import _round_toward_zero, rounding_pv, truncating_pv

TH = load_thresholds()


def _bias_of(fn, case) -> dict:
    """A record holding only ``bias``: ``fn``'s result on ``case`` against the FP64 reference."""
    x = make_inputs(case)
    ref, rl = attention_reference(x["q"], x["k"], x["v"], call=AttentionCall.from_kwargs(**x["kw"]), return_lse=True)
    out, lse = fn(x["q"], x["k"], x["v"], return_lse=True, **x["kw"])
    return {"bias": bias_record(out=out, ref=ref, lse=lse, ref_lse=rl)}


@functools.cache
def _model():
    return get_kernel("fa4-model")


# ---- the statistic -------------------------------------------------------------------------------


def test_signed_bias_reads_truncation_and_not_rounding_to_nearest():
    g = torch.Generator().manual_seed(0)
    ref = 0.5 + torch.rand((2, 64, 2, 32), generator=g, dtype=torch.float64)  # one sign, several binades
    rn = signed_bias(ref.float().to(torch.bfloat16), ref, row_dim=None)
    rz = signed_bias(_round_toward_zero(ref.float(), torch.bfloat16), ref, row_dim=None)
    assert rn["n"] == rz["n"] == ref.numel() and rn["dtype"] == "bfloat16"
    assert abs(rn["mean_ulp"]) < 0.02 and abs(rn["z_ulp"]) < 4
    # truncation: -0.5 ULP of its own binade on average, every element at or below the reference
    assert -0.55 < rz["mean_ulp"] < -0.45 and rz["z_ulp"] < -50 and rz["mean"] < 0
    assert rz["z"] == pytest.approx(rz["mean"] / rz["stderr"])


def test_signed_bias_clusters_repeated_rounding():
    """Rows that are copies of one row repeat its rounding errors: per element the mean looks
    significant; clustered by column (each column one error repeated) it does not."""
    g = torch.Generator().manual_seed(1)
    row = 1 + torch.rand(64, generator=g, dtype=torch.float64)
    ref = row.expand(1, 256, 1, 64).clone()
    got = ref.float().to(torch.bfloat16)
    b = signed_bias(got, ref, row_dim=-1, col_dim=1)
    assert b["rows"] == 256 and b["cols"] == 64
    assert abs(b["z_ulp"]) > 10 * abs(b["z_cols"])
    assert b["z_cluster"] == min(b["z_rows"], b["z_cols"], key=abs) and abs(b["z_cluster"]) < 4


def test_signed_bias_edge_cases():
    ref = torch.tensor([1.0, 2.0, math.nan, 4.0], dtype=torch.float64)
    got = torch.tensor([1.0, math.inf, 3.0, 4.0], dtype=torch.bfloat16)
    b = signed_bias(got, ref, row_dim=None)
    assert b["n"] == 2 and b["mean"] == 0.0 and b["z"] == 0.0  # only where both are finite
    up = ref[:2] + torch.tensor([2.0**-7, 2.0**-6], dtype=torch.float64)  # every error +1 ULP of its own
    same = signed_bias(up.to(torch.bfloat16), ref[:2], row_dim=None)
    assert same["mean_ulp"] == pytest.approx(1.0) and same["z_ulp"] == math.inf
    with pytest.raises(ValueError, match="shapes differ"):
        signed_bias(got, ref[:3])
    assert bias_record(out=got.view(1, 1, 1, 4), ref=ref.view(1, 1, 1, 4), lse=None, ref_lse=None)["lse"] is None


# ---- the family and the suite ----------------------------------------------------------------------


def test_tied_max_rows_tie_at_the_max_exactly():
    case = bias_suite()[0]
    x = make_inputs(case)
    q, k = x["q"].double(), x["k"].double().repeat_interleave(case.heads_q // case.heads_kv, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q, k)  # exact products of the rounded inputs
    top = s.amax(-1, keepdim=True)
    ties = (s == top).sum(-1)
    assert int(ties.min()) == case.seqlen_k // TIED_STRIDE  # every tied key, in every row
    assert bool((s[..., ::TIED_STRIDE] == top).all())
    assert bool((x["v"].float() > 0).all())  # V of one sign
    again = make_inputs(case)
    assert torch.equal(x["k"].view(torch.int16), again["k"].view(torch.int16))


def test_tied_max_is_an_adversarial_family_of_the_bias_suite_only():
    assert "tied_max" in ADVERSARIAL_FAMILIES and "tied_max" not in FAMILIES
    assert ADVERSARIAL_FAMILIES["tied_max"].hunts
    cases = suite("bias")
    assert cases == bias_suite() and {c.family for c in cases} == {"tied_max"}
    assert len({c.name for c in cases}) == len(cases)
    assert "tied_max" not in {c.family for c in suite("smoke")}
    assert case_from_dict(cases[1].as_dict()) == cases[1]  # reports and reproducers read it back
    for c in cases:
        make_inputs(c)


# ---- the verdict and the cause ---------------------------------------------------------------------


def test_truncating_pv_warns_with_rounding_bias_inside_the_bound():
    case = bias_suite()[0]
    keep = {}
    rec = evaluate_case("truncating_pv", truncating_pv, case, torch.device("cpu"), TH, tensors=keep)
    assert rec["bound"]["violations"] == 0  # inside the bound: only the bias tells
    if "bias" not in rec:  # until the engine records it itself
        t = keep["keep"]
        rec["bias"] = bias_record(out=t.out, ref=t.ref, lse=t.lse, ref_lse=t.ref_lse)
    verdict, reasons = judge(rec, TH)
    assert verdict == "warn"
    assert [r for r in reasons if r.startswith("rounding bias: out biased low by ")], reasons
    b = rec["bias"]["out"]
    assert b["z_cluster"] < -TH["bias"]["z_max"] and b["mean_ulp"] < -TH["bias"]["min_ulps"]
    cause = bias_cause(rec)
    assert cause is not None and cause.cause == "rounding_bias"
    assert cause.detail.startswith("out biased low by ") and "z = -" in cause.detail
    assert "standard errors" in cause.evidence and 0 < cause.score <= 1
    assert cause.as_dict()["cause"] == "rounding_bias"


def test_correct_kernels_get_no_rounding_bias():
    """fa4-model, the exact kernel and the round-to-nearest twin of the seeded bug, on the bias
    suite and the smoke cases where the correct kernels lean most (thresholds.toml [bias])."""
    smoke = {c.family: c for c in suite("smoke") if not c.varlen and not c.mods}
    cases = bias_suite()[:3] + [smoke[f] for f in ("normal", "offset", "tile_step_4", "subnormal", "huge_logits")]
    for case in cases:
        for name, fn in (("fa4-model", _model()), ("exact", exact), ("rounding_pv", rounding_pv)):
            rec = _bias_of(fn, case)
            assert bias_findings(m=rec, th=TH) == [], (name, case.name, rec["bias"])
            assert bias_cause(rec) is None


def test_the_seeded_bug_is_what_the_rule_catches():
    """The same kernel rounding P to nearest is silent where truncating P is a bias."""
    case = bias_suite()[2]  # float16
    assert not bias_findings(m=_bias_of(rounding_pv, case), th=TH)
    found = bias_findings(m=_bias_of(truncating_pv, case), th=TH)
    assert [(f.severity, f.kind, f.quantity) for f in found] == [("warn", "rounding-bias", "out")]


def test_bias_table_is_optional(tmp_path):
    rec = _bias_of(truncating_pv, bias_suite()[0])
    shipped = open(TH["path"]).read()
    start = shipped.index("[bias]")
    end = shipped.index("# ---- The backward pass")
    old = tmp_path / "old.toml"
    old.write_text(shipped[:start] + shipped[end:])
    th = load_thresholds(old)
    assert "bias" not in th and bias_findings(m=rec, th=th) == [] and bias_cause(rec, th=th) is None
    bad = tmp_path / "bad.toml"
    bad.write_text(shipped.replace("lse_min_ulps = 256.0\n", ""))
    with pytest.raises(ThresholdsError, match=r"\[bias\] lacks the key 'lse_min_ulps'"):
        load_thresholds(bad)
    assert bias_findings(m={"case": "c"}, th=TH) == []  # a record from before the bias was kept
