"""The invariance audit's comparison on non-finite values (``audits.checks.invariance.compare``,
issue 33 item 7): NaN equals NaN in the same place whatever its payload and sign, an infinity
equals only the infinity of its sign, a NaN against a number differs and says so; the FA4 model
holds ``batch`` and ``decode`` on every smoke case, and a kernel whose NaNs change sign with the
number of query rows (x86's default NaN in one code path, a propagated one in the other) holds
them too."""

import json
import math

import pytest
import torch

from audits import cli
from audits.checks.invariance.compare import compare, merge, same_bits
from audits.checks.invariance.report import cell
from fa4.model import attention

REF = torch.zeros(4, dtype=torch.float64)


def _nan(bits: int) -> torch.Tensor:
    return torch.tensor([bits], dtype=torch.int32).view(torch.float32)


def test_nan_equals_nan_whatever_its_payload_and_sign():
    a = torch.tensor([1.0, math.nan, math.inf, -math.inf])
    b = a.clone()
    b[1] = _nan(0xFFC00000 - (1 << 32))[0]  # x86's default NaN (sign set) against torch's +NaN
    rec = compare(a, b, REF, None)
    assert rec["differ"] == 0 and rec["nan_payloads"] == 1
    assert same_bits((a, None), (b, None))
    assert merge([rec, rec])["nan_payloads"] == 2  # counted, never among the differing


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_nan_against_a_number_differs_with_that_reason(dtype):
    a = torch.tensor([1.0, math.nan, 3.0, 4.0], dtype=dtype)
    b = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=dtype)
    ref = torch.tensor([1.0, math.nan, 3.0, 4.0], dtype=torch.float64)
    rec = compare(a, b, ref, None)
    assert rec["differ"] == 1 and rec["nan_mismatch"] == 1 and rec["max_steps"] == -1
    # honest errors: the variant with a number where FP64 has NaN is infinitely wrong, not 0
    assert rec["max_err_fp64"] == [0.0, math.inf]
    text = cell({"result": "differs", "comparisons": 1, "out": merge([rec]), "lse": None})
    assert "1/4 differ (1 NaN against a number)" in text and "inf" in text
    assert not same_bits((a, None), (b, None))


def test_an_infinity_against_the_other_differs():
    a = torch.tensor([math.inf, 1.0, -math.inf, 2.0])
    b = torch.tensor([-math.inf, 1.0, -math.inf, 2.0])
    rec = compare(a, b, REF, None)
    assert rec["differ"] == 1 and rec["inf_sign_mismatch"] == 1 and rec["nan_mismatch"] == 0
    assert "1 +inf against -inf" in cell({"result": "differs", "comparisons": 1, "out": merge([rec]), "lse": None})
    # the same infinity is equal; the sign of zero still counts (1/x observes it)
    assert compare(a, a.clone(), REF, None)["differ"] == 0
    assert compare(torch.tensor([-0.0]), torch.tensor([0.0]), REF[:1], None)["differ"] == 1


def nan_sign_by_rows(q, k, v, **kw):
    """The FA4 model, its NaNs of the sign x86's default NaN has when the call has fewer than 8
    query rows (a scalar tail's NaN against the vector path's), of torch's sign otherwise."""
    out, lse = attention(q, k, v, **{**kw, "return_lse": True})
    if q.shape[1] < 8:
        for t in (out, lse):
            bits = t.view(torch.int32 if t.element_size() == 4 else torch.int16)
            bits[torch.isnan(t)] |= -(1 << (8 * t.element_size() - 1))  # the sign bit
    return (out, lse) if kw.get("return_lse") else out


NAN_CASE = (
    '{"dtype": "float16", "d": 64, "dv": 64, "heads_q": 2, "heads_kv": 2, "seqlen_q": 128, "seqlen_k": 128, '
    '"causal": true, "family": "nan_inf_visible"}'
)


def test_nan_sign_of_a_decode_call_does_not_break_decode(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path.parent)
    spec = f"{__file__}:nan_sign_by_rows"
    args = ["invariance", "--kernel", spec, "--config", NAN_CASE, "--require", "batch,decode"]
    rc = cli.main([*args, "--predict", "none", "--out", str(tmp_path), "--quiet"])
    rep = json.loads((tmp_path / "invariance.json").read_text())
    dec = rep["cases"][0]["properties"]["decode"]
    assert rc == 0, dec
    assert dec["result"] == "holds" and dec["out"]["nan_payloads"] > 0  # NaNs of both signs met, and equal


@pytest.mark.slow
def test_fa4_model_holds_batch_and_decode_on_smoke(tmp_path):
    rc = cli.main(
        ["invariance", "--kernel", "fa4-model", "--suite", "smoke", "--require", "batch,decode"]
        + ["--out", str(tmp_path), "--quiet"]
    )
    rep = json.loads((tmp_path / "invariance.json").read_text())
    bad = {c["case"]: p for c in rep["cases"] for p in ("batch", "decode") if c["properties"][p]["result"] == "differs"}
    assert rc == 0 and not bad, bad
    assert rep["summary"]["counts"]["decode"]["holds"] >= 40
