"""``fa4-audit invariance``: the seeded invariance bugs are caught, correct kernels hold, the exit
codes, not-applicable reasons, the prediction beside the measurement and the report
(docs/invariance.md)."""

import json
import math

import pytest
import torch

from audits import cli
from audits.checks.invariance import core, varlen
from audits.checks.invariance.compare import compare

BUGS = "tests/bugged_invariance.py"
#: a batch of 2, GQA, causal with seqlen_q < seqlen_k: batch_chunked_sum differs here
BATCH_CASE = (
    '{"batch": 2, "heads_q": 4, "heads_kv": 2, "seqlen_q": 32, "seqlen_k": 128, "d": 64, "dv": 64, "causal": true}'
)
#: fp16, 4 heads: decode_exp2's rounding reaches the output and the LSE here
DECODE_CASE = '{"dtype": "float16", "heads_q": 4, "heads_kv": 4, "seqlen_q": 32, "seqlen_k": 256, "d": 64, "dv": 64}'
#: three sequences of other lengths (some keys past one 128-key tile, some past two), GQA, causal
VARLEN_CASE = (
    '{"seqlens": [[40, 200], [17, 130], [64, 260]], "heads_q": 4, "heads_kv": 2, "d": 64, "dv": 64, "causal": true}'
)
#: two short sequences, MQA: the prediction and report tests (cheaper, same code paths)
SMALL_CASE = '{"seqlens": [[20, 150], [9, 70]], "heads_q": 2, "heads_kv": 1, "d": 64, "dv": 64, "causal": true}'
ALL = ",".join(core.PROPERTIES)


def run(*argv):
    return cli.main(list(argv))


def _report(path):
    rep = json.loads((path / "invariance.json").read_text())
    assert rep["schema"] == "fa4-audit/invariance/2"
    return rep


def test_batch_dependent_reduction_is_caught(tmp_path, capsys):
    rc = run("invariance", "--kernel", f"{BUGS}:batch_chunked_sum", "--config", BATCH_CASE,
             "--require", "batch,decode", "--out", str(tmp_path), "--quiet")  # fmt: skip
    assert rc == 1
    rep = _report(tmp_path)
    assert rep["summary"]["failing"] == ["batch"]
    (case,) = rep["cases"]
    res = case["properties"]["batch"]
    assert res["result"] == "differs" and res["lse"]["differ"] > 0 and res["lse"]["max_steps"] >= 1
    assert all(e < 1e-5 for e in res["lse"]["max_err_fp64"])  # both variants accurate: only the bits move
    assert case["properties"]["decode"]["result"] == "holds"
    out = capsys.readouterr().out
    assert "batch (required): 0 hold, 1 differ" in out and "DIFFERS" in out


def test_decode_path_with_another_exp_is_caught(tmp_path, capsys):
    rc = run("invariance", "--kernel", f"{BUGS}:decode_exp2", "--config", DECODE_CASE,
             "--require", "batch,decode", "--out", str(tmp_path), "--quiet")  # fmt: skip
    assert rc == 1
    rep = _report(tmp_path)
    assert rep["summary"]["failing"] == ["decode"]
    res = rep["cases"][0]["properties"]["decode"]
    assert res["result"] == "differs" and res["comparisons"] == 2  # r = 1 and r = 4
    assert res["out"]["differ"] + res["lse"]["differ"] > 0
    assert rep["cases"][0]["properties"]["batch"]["result"] == "holds"
    assert "decode (required): 0 hold, 1 differ" in capsys.readouterr().out


def test_a_property_not_required_never_fails(tmp_path, capsys):
    rc = run("invariance", "--kernel", f"{BUGS}:batch_chunked_sum", "--config", BATCH_CASE,
             "--require", "decode", "--out", str(tmp_path), "--quiet")  # fmt: skip
    assert rc == 0
    rep = _report(tmp_path)
    assert rep["summary"]["counts"]["batch"]["differs"] == 1 and rep["summary"]["passed"]


def test_correct_kernels_hold_under_require(tmp_path, capsys):
    kernels = ["fa4-model", "tests.bugged_kernels:exact", f"{BUGS}:plain"]
    argv = [a for k in kernels for a in ("--kernel", k)]
    rc = run("invariance", *argv, "--config", BATCH_CASE, "--config", DECODE_CASE,
             "--require", "batch,decode", "--out", str(tmp_path), "--quiet")  # fmt: skip
    assert rc == 0, capsys.readouterr()
    dirs = sorted(p for p in tmp_path.iterdir() if p.is_dir())
    assert len(dirs) == 3
    for d in dirs:
        rep = _report(d)
        assert rep["summary"]["counts"]["batch"]["holds"] == 2
        assert rep["summary"]["counts"]["decode"]["holds"] == 2
        assert (d / "invariance.md").read_text().startswith("# Invariance: ")


def test_sdpa_math_is_batch_invariant(tmp_path, capsys):
    """SDPA's math backend holds batch invariance; its decode rows may differ by a step where
    CPU BLAS blocks the matmul by the row count (docs/invariance.md), so decode is not required."""
    rc = run("invariance", "--kernel", "sdpa-math", "--config", BATCH_CASE, "--config", DECODE_CASE,
             "--require", "batch", "--out", str(tmp_path), "--quiet")  # fmt: skip
    assert rc == 0
    assert _report(tmp_path)["summary"]["counts"]["batch"]["holds"] == 2


def test_fa4_model_holds_on_smoke_cases(tmp_path, capsys):
    """Smoke cases through fa4-model: fp8 in, a batch-1 case widened to a batch of 2."""
    rc = run("invariance", "--kernel", "fa4-model", "--suite", "smoke", "--case", "*-subnormal-*",
             "--require", "batch,decode", "--out", str(tmp_path), "--quiet")  # fmt: skip
    assert rc == 0
    (case,) = _report(tmp_path)["cases"]
    res = case["properties"]
    # a fixed-length case through the varlen entry: one sequence, so compared beside a shorter one
    assert res["batch"]["result"] == "holds" and "beside a shorter one" in res["batch"]["note"]
    assert res["split"]["result"] == "holds" and res["paged"]["result"] == "holds"
    assert res["pack_gqa"] == {"result": "not applicable", "reason": "not a GQA case (heads_q 2 == heads_kv 2)"}
    rc = run("invariance", "--kernel", "fa4-model", "--suite", "smoke", "--case", "f8_e4m3fn-d64-*-near_max-*",
             "--require", "batch,decode", "--out", str(tmp_path), "--quiet")  # fmt: skip
    assert rc == 0


def test_unknown_property_exits_2_naming_the_accepted(tmp_path, capsys):
    rc = run("invariance", "--kernel", "fa4-model", "--require", "batch,splits", "--out", str(tmp_path))
    assert rc == 2
    err = capsys.readouterr().err
    assert "splits" in err and "accepted: batch, decode, split, paged, pack_gqa" in err
    assert not (tmp_path / "invariance.json").exists()


def test_unknown_kernel_exits_2(tmp_path, capsys):
    assert run("invariance", "--kernel", "nope", "--out", str(tmp_path)) == 2
    assert "unknown kernel 'nope'" in capsys.readouterr().err


def test_not_applicable_and_skipped_are_reported_with_reasons(tmp_path, capsys):
    one_row = '{"seqlen_q": 1, "seqlen_k": 64, "d": 64, "dv": 64}'
    fp8 = '{"dtype": "float8_e4m3fn", "seqlen_q": 16, "seqlen_k": 64, "d": 64, "dv": 64}'
    rc = run("invariance", "--kernel", "sdpa-math", "--config", one_row, "--config", fp8,
             "--require", "decode", "--out", str(tmp_path), "--quiet")  # fmt: skip
    assert rc == 1  # decode, required, compared nowhere (n.a. on one case, skipped on the other): fails
    rep = _report(tmp_path)
    assert rep["summary"]["failing"] == ["decode"]
    assert rep["summary"]["uncompared"]["decode"] == (
        "0 comparisons: not applicable on 1 of 2 case(s): seqlen_q 1: the last row alone is the full call; "
        "skipped on 1 of 2 case(s): outside the kernel's declared domain: dtype float8_e4m3fn not in "
        "('bfloat16', 'float16')"
    )
    short, low = rep["cases"]
    assert short["properties"]["decode"] == {
        "result": "not applicable",
        "reason": "seqlen_q 1: the last row alone is the full call",
    }
    assert short["properties"]["batch"]["result"] == "holds"
    assert short["properties"]["batch"]["lse_note"].startswith("LSE not returned")
    for p in ("batch", "decode"):
        assert low["properties"][p]["result"] == "skipped"
        assert "outside the kernel's declared domain" in low["properties"][p]["reason"]
    for p in core.VARLEN_ONLY:  # a fixed-length kernel: the varlen features do not apply
        for case in (short, low):
            assert case["properties"][p]["result"] == "not applicable"
            assert case["properties"][p]["reason"].startswith("the kernel has no varlen entry")
    assert rep["summary"]["counts"]["decode"]["not applicable"] == 1
    out = capsys.readouterr().out
    assert "1 n.a., 1 skipped" in out
    assert "FAIL decode: 0 comparisons: not applicable on 1 of 2 case(s)" in out
    assert "FAIL (decode: 0 comparisons)" in out
    assert "**decode** (required) fails: 0 comparisons" in (tmp_path / "invariance.md").read_text()


def test_nothing_compared_exits_1(tmp_path, capsys):
    rc = run("invariance", "--kernel", f"{BUGS}:refuses", "--config", BATCH_CASE, "--out", str(tmp_path), "--quiet")
    assert rc == 1
    rep = _report(tmp_path)
    assert rep["summary"]["compared"] == 0 and not rep["summary"]["passed"]
    assert "kernel does not support" in rep["cases"][0]["properties"]["batch"]["reason"]
    assert "nothing was compared" in capsys.readouterr().err


def test_comparison_is_bitwise_but_for_nan_payloads():
    a = torch.tensor([1.0, math.nan, 2.0, -0.0])
    b = a.clone()
    b.view(torch.int32)[1] = 0x7FC00001  # another NaN payload: equal (compare.same_elements)
    b[3] = 0.0  # -0 vs +0: equal as numbers, not as bits
    rec = compare(a, b, torch.zeros(4, dtype=torch.float64), None)
    assert rec["differ"] == 1 and rec["max_steps"] == 0 and rec["nan_mismatch"] == 0 and rec["nan_payloads"] == 1
    # an infinite error is never within a bound, even an infinite one (non-finite inputs)
    inf = torch.full((4,), math.inf, dtype=torch.float64)
    assert compare(a, b, torch.zeros(4, dtype=torch.float64), inf)["within_bound"] is False
    assert compare(a, a + 1, torch.zeros(4, dtype=torch.float64), inf)["within_bound"] is False  # NaN vs ref 0
    assert compare(a[2:3], a[2:3] + 1, torch.zeros(1, dtype=torch.float64), inf[:1])["within_bound"] is True
    h = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    g = h.clone()
    g.view(torch.int16)[1] += 3
    assert compare(h, g, torch.zeros(2, dtype=torch.float64), None)["max_steps"] == 3


# ---- the varlen entry: split, paged, pack_gqa, and batch / decode through it ------------------


def test_fa4_model_varlen_properties(tmp_path, capsys):
    """The model's prediction for production: batch, decode, paged and pack_gqa bitwise; split
    not bitwise but within the forward bound (its split-KV terms where it has them)."""
    rc = run("invariance", "--kernel", "fa4-model", "--config", VARLEN_CASE, "--require", ALL,
             "--out", str(tmp_path), "--quiet")  # fmt: skip
    assert rc == 0, capsys.readouterr()
    rep = _report(tmp_path)
    assert rep["predict"] is None and "prediction" not in rep["summary"]  # fa4-model needs no model
    res = rep["cases"][0]["properties"]
    # 3 sequences x (inside the batch, reversed, beside shorter ones); x (r = 1, 4); x (5 page sizes
    # against contiguous + 4 consecutive pairs); x (num_splits 2, 3); x (on vs off)
    want = {"batch": 9, "decode": 6, "paged": 27, "split": 6, "pack_gqa": 3}
    assert {p: r["comparisons"] for p, r in res.items()} == want
    for p in ("batch", "decode", "paged", "pack_gqa"):
        assert res[p]["result"] == "holds" and res[p]["out"]["differ"] == 0 and res[p]["lse"]["differ"] == 0
    sp = res["split"]
    assert sp["result"] == "holds" and sp["bitwise"] is False
    for t in ("out", "lse"):
        assert sp[t]["differ"] > 0 and sp[t]["max_steps"] >= 1 and sp[t]["within_bound"] is True
        assert max(sp[t]["max_err_fp64"]) < (0.02 if t == "out" else 1e-4)
    assert sp["note"].startswith("bound: numerics.forward_bound")
    md = (tmp_path / "invariance.md").read_text()
    assert "holds within bound (6 comparisons; out: " in md


VARLEN_BUGS = {
    "split_drops_lse": "split",
    "batch_tile": "batch",
    "paged_tiles": "paged",
    "decode_exp2_varlen": "decode",
    "pack_gqa_tiles": "pack_gqa",
}


@pytest.mark.parametrize("bug", list(VARLEN_BUGS))
def test_seeded_varlen_bug_is_caught_by_its_property(bug, tmp_path, capsys):
    prop = VARLEN_BUGS[bug]
    rc = run("invariance", "--kernel", f"{BUGS}:{bug}", "--config", VARLEN_CASE, "--require", ALL,
             "--out", str(tmp_path), "--quiet")  # fmt: skip
    assert rc == 1
    rep = _report(tmp_path)
    assert rep["summary"]["failing"] == [prop]
    res = rep["cases"][0]["properties"]
    assert res[prop]["result"] == "differs"
    assert all(r["result"] == "holds" for p, r in res.items() if p != prop)
    assert f"{prop} (required): 0 hold, 1 differ" in capsys.readouterr().out
    if prop == "split":  # the LSE leaves the bound, the (correctly combined) output does not
        assert res[prop]["lse"]["within_bound"] is False and res[prop]["out"]["within_bound"] is True
        # where the last split has work: 2 splits of each sequence's 2-3 KV blocks at least
        beyond = res[prop]["beyond_bound"]
        assert [c for c in beyond if c.endswith("vs 2")] == [f"sequence {i}: num_splits 1 vs 2" for i in range(3)]
        assert all(c.endswith(("vs 2", "vs 3")) for c in beyond)
    else:  # an invariance bug, not an accuracy one: both variants within the bound
        assert res[prop]["out"]["within_bound"] and res[prop]["lse"]["within_bound"]
    # not required, never failing: the summary the exit code follows (the CLI path: test_a_property_not_required_...)
    others = [p for p in core.PROPERTIES if p != prop]
    assert core.summarize(rep["cases"], others)["passed"]
    assert not core.summarize(rep["cases"], [prop])["passed"]


def test_the_varlen_plain_kernel_holds_everything(tmp_path, capsys):
    """The seeded bugs' base (the model with fixed numerics, declared SM100): every property holds."""
    rc = run("invariance", "--kernel", f"{BUGS}:varlen_plain", "--config", VARLEN_CASE, "--require", ALL,
             "--out", str(tmp_path), "--quiet")  # fmt: skip
    assert rc == 0
    assert all(n["holds"] == 1 for n in _report(tmp_path)["summary"]["counts"].values())


def test_prediction_beside_measurement(tmp_path, capsys):
    """A kernel that differs from its model: the batch-dependent tile against fa4-model's
    prediction (batch holds there); the other properties agree."""
    rc = run("invariance", "--kernel", f"{BUGS}:batch_tile", "--predict", "fa4-model", "--config", SMALL_CASE,
             "--out", str(tmp_path), "--quiet")  # fmt: skip
    assert rc == 0  # nothing required; prediction never gates
    rep = _report(tmp_path)
    assert rep["predict"] == "fa4-model"
    case = rep["cases"][0]
    assert case["properties"]["batch"]["result"] == "differs"
    assert case["predicted"]["batch"]["result"] == "holds"
    assert case["predicted"]["batch"]["agreement"] == "disagree"
    for p in ("decode", "split", "paged", "pack_gqa"):
        assert case["predicted"][p]["agreement"] == "agree"
    assert case["predicted"]["split"]["bitwise"] is False  # the model's own split comparisons
    pred = rep["summary"]["prediction"]
    assert (pred["model"], pred["agree"], pred["disagree"]) == ("fa4-model", 4, 1)
    assert pred["per_property"]["batch"] == {"agree": 0, "disagree": 1, "not compared": 0}
    assert pred["disagreements"] == [
        {"case": case["case"], "property": "batch", "measured": "differs", "predicted": "holds"}
    ]
    md = (tmp_path / "invariance.md").read_text()
    assert "## Prediction: fa4-model" in md and "4 agree, 1 disagree" in md
    assert "| differs / holds **DISAGREE** | holds / holds |" in md
    out = capsys.readouterr().out
    assert "predicted by fa4-model: 0 agree, 1 disagree" in out and "DISAGREE" in out


def test_prediction_agreement_is_counted_only_where_both_judged():
    h, d = {"result": "holds"}, {"result": "differs"}
    assert core.agreement(h, h) == "agree" and core.agreement(h, d) == "disagree"
    assert core.agreement({"result": "skipped"}, h) is None
    assert core.agreement(h, {"result": "not applicable"}) is None


def test_default_model_is_production_arch_s(monkeypatch):
    import audits.kernels

    monkeypatch.setattr(audits.kernels, "production_arch", lambda: "sm90")
    assert core.default_model("fa4") == "fa4-model-sm90"
    monkeypatch.setattr(audits.kernels, "production_arch", lambda: "sm100")
    assert core.default_model("fa4") == "fa4-model"
    assert core.default_model("fa4-model") is None and core.default_model("sdpa-math") is None


def test_predict_usage(tmp_path, capsys):
    assert run("invariance", "--kernel", "fa4-model", "--predict", "nope", "--out", str(tmp_path)) == 2
    assert "--predict nope: unknown kernel 'nope'" in capsys.readouterr().err
    # a model predicting itself, or 'none': no prediction
    for model in ("fa4-model", "none"):
        rc = run("invariance", "--kernel", "fa4-model", "--predict", model, "--config", DECODE_CASE,
                 "--out", str(tmp_path), "--quiet")  # fmt: skip
        assert rc == 0 and _report(tmp_path)["predict"] is None


def test_report_schema(tmp_path, capsys):
    one_head = '{"heads_q": 1, "heads_kv": 1, "seqlen_q": 16, "seqlen_k": 100, "d": 64, "dv": 64}'
    rc = run("invariance", "--kernel", f"{BUGS}:paged_tiles", "--predict", "fa4-model", "--config", SMALL_CASE,
             "--config", one_head, "--require", "paged", "--out", str(tmp_path), "--quiet")  # fmt: skip
    assert rc == 1
    rep = _report(tmp_path)
    assert set(rep) == {"schema", "kernel", "predict", "suite", "command", "created", "environment", "device",
                        "seconds", "properties", "summary", "cases"}  # fmt: skip
    assert list(rep["properties"]) == ["batch", "decode", "split", "paged", "pack_gqa"]
    s = rep["summary"]
    assert set(s) == {"counts", "required", "compared", "failing", "uncompared", "passed", "prediction"}
    assert s["uncompared"] == {}  # paged was compared (and differs)
    assert set(s["prediction"]) == {"model", "agree", "disagree", "per_property", "disagreements"}
    assert s["required"] == ["paged"] and s["failing"] == ["paged"] and s["passed"] is False
    for case in rep["cases"]:
        assert set(case) == {"case", "config", "properties", "predicted", "seconds"}
        for p in core.PROPERTIES:
            m, q = case["properties"][p], case["predicted"][p]
            assert m["result"] in core.RESULTS and q["result"] in core.RESULTS
            assert set(q) - set(m) == {"agreement"}  # the prediction's record is a measurement's, plus agreement
            if m["result"] in ("holds", "differs"):
                assert {"comparisons", "out", "lse"} <= set(m)
                assert {"compared", "differ"} <= set(m["out"])
    paged = rep["cases"][0]["properties"]["paged"]
    assert paged["result"] == "differs" and "contiguous KV vs pages of 16" in paged["differing"][0]
    assert {"max_steps", "max_ulp", "nan_mismatch", "max_err_fp64", "within_bound"} <= set(paged["out"])
    assert rep["cases"][1]["properties"]["pack_gqa"]["result"] == "not applicable"  # one head


def test_a_varlen_case_needs_a_varlen_entry(tmp_path, capsys):
    rc = run("invariance", "--kernel", f"{BUGS}:plain", "--config", VARLEN_CASE, "--out", str(tmp_path), "--quiet")
    assert rc == 1  # nothing compared
    res = _report(tmp_path)["cases"][0]["properties"]
    assert res["batch"] == {"result": "not applicable", "reason": "a varlen case: the kernel has no varlen entry"}


def test_declined_variants_are_noted_or_skipped(tmp_path, capsys):
    """A kernel declining split-KV (production's SM90 path) and one page size: split skipped
    with the reason, paged compared on the other page sizes with the declined one noted."""
    rc = run("invariance", "--kernel", f"{BUGS}:refuses_splits", "--config", VARLEN_CASE, "--require", ALL,
             "--out", str(tmp_path), "--quiet")  # fmt: skip
    assert rc == 1  # split, required, skipped on every case: compared nowhere, it fails and says why
    rep = _report(tmp_path)
    assert rep["summary"]["failing"] == ["split"]  # paged, compared on the page sizes accepted, does not
    assert rep["summary"]["uncompared"]["split"].startswith(
        "0 comparisons: skipped on 1 of 1 case(s): num_splits 2: kernel does not support this configuration: SplitKV"
    )
    res = rep["cases"][0]["properties"]
    assert res["split"]["result"] == "skipped"
    assert res["split"]["reason"].startswith("num_splits 2: kernel does not support this configuration: SplitKV")
    assert res["paged"]["result"] == "holds" and res["paged"]["comparisons"] == 3 * (4 + 3)
    assert res["paged"]["note"].startswith("page size 48: kernel does not support")


def test_split_bound_takes_each_sequences_split_count():
    """SM100 gives each sequence of a varlen call its own split count (fa4.varlen.split_counts):
    the split-KV bound of a sequence takes that count, not the requested num_splits."""
    from audits.suites.cases import case_from_json
    from fa4.varlen import split_counts

    x = varlen.VarlenInputs(case_from_json(VARLEN_CASE, where="test"), "cpu")
    call = x.full(num_splits=3)
    got = [call.splits("sm100", j) for j in range(3)]
    assert got == split_counts(call.q, call.k, arch="sm100", **call.kw) and got != [3, 3, 3]
    assert [call.splits("sm90", j) for j in range(3)] == [3, 3, 3]
    assert x.full(num_splits=1).splits("sm100", 0) == 1
