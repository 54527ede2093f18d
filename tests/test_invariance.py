"""``fa4-audit invariance``: the seeded invariance bugs are caught, correct kernels hold, the exit
codes, not-applicable reasons and the report (docs/invariance.md)."""

import json
import math

import torch

from audits import cli
from audits.invariance import core

BUGS = "tests/bugged_invariance.py"
#: a batch of 2, GQA, causal with seqlen_q < seqlen_k: batch_chunked_sum differs here
BATCH_CASE = (
    '{"batch": 2, "heads_q": 4, "heads_kv": 2, "seqlen_q": 32, "seqlen_k": 128, "d": 64, "dv": 64, "causal": true}'
)
#: fp16, 4 heads: decode_exp2's rounding reaches the output and the LSE here
DECODE_CASE = '{"dtype": "float16", "heads_q": 4, "heads_kv": 4, "seqlen_q": 32, "seqlen_k": 256, "d": 64, "dv": 64}'


def run(*argv):
    return cli.main(list(argv))


def _report(path):
    rep = json.loads((path / "invariance.json").read_text())
    assert rep["schema"] == "fa4-audit/invariance/1"
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
    assert case["properties"]["batch"]["result"] == "holds" and "batch of 2" in case["properties"]["batch"]["note"]
    rc = run("invariance", "--kernel", "fa4-model", "--suite", "smoke", "--case", "f8_e4m3fn-d64-*-near_max-*",
             "--require", "batch,decode", "--out", str(tmp_path), "--quiet")  # fmt: skip
    assert rc == 0


def test_unknown_property_exits_2_naming_the_accepted(tmp_path, capsys):
    rc = run("invariance", "--kernel", "fa4-model", "--require", "batch,split", "--out", str(tmp_path))
    assert rc == 2
    err = capsys.readouterr().err
    assert "split" in err and "accepted: batch, decode" in err
    assert not (tmp_path / "invariance.json").exists()


def test_unknown_kernel_exits_2(tmp_path, capsys):
    assert run("invariance", "--kernel", "nope", "--out", str(tmp_path)) == 2
    assert "unknown kernel 'nope'" in capsys.readouterr().err


def test_not_applicable_and_skipped_are_reported_with_reasons(tmp_path, capsys):
    one_row = '{"seqlen_q": 1, "seqlen_k": 64, "d": 64, "dv": 64}'
    fp8 = '{"dtype": "float8_e4m3fn", "seqlen_q": 16, "seqlen_k": 64, "d": 64, "dv": 64}'
    rc = run("invariance", "--kernel", "sdpa-math", "--config", one_row, "--config", fp8,
             "--require", "decode", "--out", str(tmp_path), "--quiet")  # fmt: skip
    assert rc == 0  # decode compared nowhere, but batch was: something was compared, nothing required differs
    rep = _report(tmp_path)
    short, low = rep["cases"]
    assert short["properties"]["decode"] == {
        "result": "not applicable",
        "reason": "seqlen_q 1: the last row alone is the full call",
    }
    assert short["properties"]["batch"]["result"] == "holds"
    assert short["properties"]["batch"]["lse_note"].startswith("LSE not returned")
    for p in core.PROPERTIES:
        assert low["properties"][p]["result"] == "skipped"
        assert "outside the kernel's declared domain" in low["properties"][p]["reason"]
    assert rep["summary"]["counts"]["decode"]["not applicable"] == 1
    assert "1 n.a., 1 skipped" in capsys.readouterr().out


def test_nothing_compared_exits_1(tmp_path, capsys):
    rc = run("invariance", "--kernel", f"{BUGS}:refuses", "--config", BATCH_CASE, "--out", str(tmp_path), "--quiet")
    assert rc == 1
    rep = _report(tmp_path)
    assert rep["summary"]["compared"] == 0 and not rep["summary"]["passed"]
    assert "kernel does not support" in rep["cases"][0]["properties"]["batch"]["reason"]
    assert "nothing was compared" in capsys.readouterr().err


def test_comparison_is_bitwise_nan_payloads_included():
    a = torch.tensor([1.0, math.nan, 2.0, -0.0])
    b = a.clone()
    b.view(torch.int32)[1] = 0x7FC00001  # another NaN payload
    b[3] = 0.0  # -0 vs +0: equal as numbers, not as bits
    rec = core._compare(a, b, torch.zeros(4, dtype=torch.float64), None)
    assert rec["differ"] == 2 and rec["max_steps"] == 0 and rec["nan_mismatch"] == 1
    h = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    g = h.clone()
    g.view(torch.int16)[1] += 3
    assert core._compare(h, g, torch.zeros(2, dtype=torch.float64), None)["max_steps"] == 3
