"""The backward's tested causes (audits.verdict.grad_causes, docs/diagnosis.md "Causes of a failing
backward"): the seeded backward bugs of tests/bugged_backward.py whose cause the vocabulary holds
are named FIRST, through the engine as ``fa4-audit run --backward`` runs a case; the FP64
recomputation the mask hypotheses use reproduces the gradient reference; noise names nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from audits.api import RunOptions, open_session
from audits.engine.backward import BackwardOptions
from audits.suites.cases import Case, suite
from audits.suites.inputs import make_grad_output, make_inputs
from audits.verdict.diagnosis import CaseTensors
from audits.verdict.grad_causes import backward_with_mask, grad_causes
from numerics.call import AttentionCall
from numerics.grad_reference import attention_grad_reference
from numerics.reference import call_visibility

BF16 = dict(dtype="bfloat16", d=64, dv=64, seqlen_q=96, seqlen_k=128)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize(
    "extra",
    [
        dict(causal=True),
        dict(window=(16, 8)),
        dict(softcap=5.0),
        dict(heads_q=4, heads_kv=2, causal=True),
        dict(sink=True),
    ],
    ids=["causal", "local", "softcap", "gqa", "sink"],
)
def test_the_recomputed_backward_with_the_forwards_mask_is_the_reference(extra):
    case = Case(**{**BF16, "seqlen_q": 70, "seqlen_k": 100, **extra})
    x = make_inputs(case, device="cpu")
    do, _ = make_grad_output(case, device="cpu")
    call = AttentionCall.from_kwargs(**x["kw"])
    ref = attention_grad_reference(x["q"], x["k"], x["v"], do, call=call)
    vis = call_visibility(batch=1, heads=1, seqlen_q=70, seqlen_k=100, call=call, device="cpu")
    got = backward_with_mask(x["q"], x["k"], x["v"], do, ref["out"], ref["lse"], call=call, visible=vis)
    for n in ("dq", "dk", "dv"):
        assert float((got[n] - ref[n]).abs().max() / ref[n].abs().max()) < 1e-13, n


#: bug -> (case, cause, detail): each named first
CATALOGUE = {
    "dq_no_scale": (Case(**BF16), "grad_scale", "dq times 8 (1/softmax_scale = sqrt(64): the softmax scale missing)"),
    "sink_grad_missing": (Case(**BF16, sink=True), "grad_scale", "dsink is zero: never computed"),
    "sink_grad_wrong_sign": (Case(**BF16, sink=True), "grad_scale", "dsink times -1 (the sign flipped)"),
    "no_causal_in_bwd": (Case(**BF16, causal=True), "mask_edge", "in the backward only: causal mask ignored"),
    "window_left_leak": (
        Case(**{**BF16, "seqlen_k": 160}, window=(24, 8)),
        "mask_edge",
        "in the backward only: window_left ignored",
    ),
    "window_off_by_one_bwd": (
        Case(**{**BF16, "seqlen_k": 160}, window=(24, 8)),
        "mask_edge",
        "in the backward only: window_left admits one key too many",
    ),
    "gqa_one_head": (
        Case(**BF16, heads_q=4, heads_kv=2),
        "head_mapping",
        "in the backward only: dk and dv from the first query head of each group of 2, not summed over it",
    ),
    "softcap_no_chain": (
        Case(**BF16, softcap=5.0),
        "softcap_chain",
        "in the backward only: dS without the softcap's chain factor 1 - tanh^2(r / 5)",
    ),
    "dq_row_tile_dropped": (
        Case(**BF16, causal=True),
        "dropped_tile",
        "dq rows 64..95 (every batch and head) never computed: zero",
    ),
    "dv_unaligned_cols": (
        Case(**{**BF16, "dv": 40}),
        "dropped_tile",
        "dv columns 32..39 (the head dim from 32 on) never computed: zero",
    ),
}


def _fp64(case: Case) -> tuple[dict, torch.Tensor, dict]:
    """The case's inputs, its dO and its FP64 gradients with their scales, on the CPU."""
    x = make_inputs(case, device="cpu")
    do, _ = make_grad_output(case, device="cpu")
    ref = attention_grad_reference(x["q"], x["k"], x["v"], do, call=AttentionCall.from_kwargs(**x["kw"]), scales=True)
    return x, do, ref


def _evaluate(spec: str, case: Case, keep: bool = False):
    with open_session(spec, RunOptions(backward=BackwardOptions(repeat=1), poison=False, isolate=False)) as s:
        return s.evaluate(case)


@pytest.mark.parametrize("bug", list(CATALOGUE))
def test_each_seeded_backward_bug_is_named_first_through_the_engine(bug):
    case, cause, detail = CATALOGUE[bug]
    rec = _evaluate(f"tests.bugged_backward:bug_{bug}", case)
    assert rec["verdict"] == "fail", rec["reasons"]
    found = (rec.get("diagnosis") or {}).get("causes") or []
    assert found and (found[0]["cause"], found[0]["detail"]) == (cause, detail), found
    assert found[0]["score"] >= 0.95, found[0]


def test_a_backward_that_overflows_where_the_hypothesis_does_is_named():
    """The causal mask ignored in the backward on smoke's fp16 drift case: P of the masked pairs
    overflows, and the kernel returns +-inf where the FP64 gradient is finite.  The hypothesis'
    gradients, as fp16 holds them, are the same infinities: 48,294 of 48,695 violating elements
    met, score 0.984 (unrounded the infinities matched nothing: 47,629, 0.957; 2026-12-05)."""
    case = next(c for c in suite("smoke") if c.name == "f16-d64-b1h2k2-s128x384-causal-drift-seed0")
    rec = _evaluate("tests.bugged_backward:bug_no_causal_in_bwd", case)
    assert any("returns +inf" in r for r in rec["reasons"]), rec["reasons"]
    found = rec["diagnosis"].get("causes") or []
    assert found and (found[0]["cause"], found[0]["detail"]) == (
        "mask_edge",
        "in the backward only: causal mask ignored",
    )
    assert found[0]["score"] >= 0.98, found[0]


def test_a_backward_bug_outside_the_vocabulary_gets_no_cause():
    """A bug no hypothesis models (dS from another exp2 than the one the LSE came from) fails with
    no cause: nothing is guessed."""
    rec = _evaluate("tests.bugged_backward:bug_ds_other_exp2", Case(**BF16))
    assert rec["verdict"] == "fail" and not (rec.get("diagnosis") or {}).get("causes"), rec.get("diagnosis")


def test_noise_past_the_bound_names_no_gradient_cause():
    """The clean backward's gradients with 1% of their elements pushed 1.5 bounds off: an
    imprecise kernel, not one wrong in a way; no hypothesis claims it."""
    case = Case(**BF16, causal=True, heads_q=4, heads_kv=2)
    x, do, ref = _fp64(case)
    g = torch.Generator().manual_seed(3)
    grads, bounds = {}, {}
    for n in ("dq", "dk", "dv"):
        bounds[n] = 1e-3 * ref[f"{n}_scale"]
        hit = (torch.rand(ref[n].shape, generator=g) < 0.01).double()
        sign = torch.where(torch.rand(ref[n].shape, generator=g) < 0.5, -1.0, 1.0).double()
        grads[n] = (ref[n] + hit * sign * 1.5 * bounds[n]).float()  # a kernel's dtype (float32 keeps the noise)
    t = CaseTensors(case, inputs=x, grads=grads, grad_refs=ref, grad_bounds=bounds, grad_output=do)
    assert grad_causes(tensors=t, rec={"backward": {"status": "ran"}}) == []
    # the same gradients with dq missing its scale: named
    grads["dq"] = (ref["dq"] * 8.0).float()
    (c,) = grad_causes(tensors=t, rec={"backward": {"status": "ran"}})
    assert (c.cause, c.detail) == ("grad_scale", "dq times 8 (1/softmax_scale = sqrt(64): the softmax scale missing)")


def test_a_broken_analysis_is_recorded_and_the_other_still_runs(monkeypatch):
    """The forward's data hypotheses raising: the verdict stands, the diagnosis says why the
    analysis broke, and the gradients' hypotheses still name the cause."""
    import audits.engine.evaluate as ev

    def broken(**_):
        raise RuntimeError("boom")

    monkeypatch.setattr(ev, "data_causes", broken)
    case, cause, detail = CATALOGUE["dq_no_scale"]
    rec = _evaluate("tests.bugged_backward:bug_dq_no_scale", case)
    assert rec["verdict"] == "fail"
    assert rec["diagnosis"]["causes_error"] == "data hypotheses: RuntimeError: boom"
    assert [(c["cause"], c["detail"]) for c in rec["diagnosis"]["causes"]] == [(cause, detail)]


def test_the_hypotheses_that_read_the_gradients_alone_run_on_mod_cases():
    """A case with a score_mod and a mask_mod (the backward is not recomputed there): a dq missing
    its scale and dv's trailing columns never computed are still named, as on any case."""
    case = Case(**{**BF16, "seqlen_q": 70, "seqlen_k": 100}, score_mod="alibi", mask_mod="document")
    x, do, ref = _fp64(case)
    call = AttentionCall.from_kwargs(**x["kw"])
    assert call.score_mod is not None and call.has_mask_mods
    grads = {n: ref[n].to(torch.bfloat16) for n in ("dq", "dk", "dv")}
    bounds = {n: 1e-2 * ref[f"{n}_scale"] for n in grads}
    t = CaseTensors(case, inputs=x, grads=grads, grad_refs=ref, grad_bounds=bounds, grad_output=do)
    ran = {"backward": {"status": "ran"}}
    assert grad_causes(tensors=t, rec=ran) == []
    grads["dq"] = (ref["dq"] * 8.0).to(torch.bfloat16)
    (c,) = grad_causes(tensors=t, rec=ran)
    assert (c.cause, c.detail) == ("grad_scale", "dq times 8 (1/softmax_scale = sqrt(64): the softmax scale missing)")
    grads["dq"] = ref["dq"].to(torch.bfloat16)
    grads["dv"] = grads["dv"].clone()
    grads["dv"][..., 48:] = 0
    c = max(grad_causes(tensors=t, rec=ran), key=lambda c: c.score)  # "dv is zero" fits at 0.25 too
    assert (c.cause, c.score) == ("dropped_tile", 1.0)
    assert c.detail == "dv columns 48..63 (the head dim from 48 on) never computed: zero"


#: production's gradients at three head dims where its SM90 backward is wrong (tests/data/README.md)
H200_GRADS = Path(__file__).parent / "data" / "h200_headdim_grads.pt"
ACCUM_40 = (
    "dq read back from its accumulator at a stride of 64 rows x 64 columns, written at 64 x 48 (head dim 40): "
    "tile t read t x 16 columns past its own, zero past the last tile written"
)
ACCUM_72_GQA = (
    "dq, dk and dv read back from their accumulators at a stride of 64 rows (keys for dk, dv) x 96 columns, "
    "written at 64 x 80 (head dim 72): tile t read t x 16 columns past its own, zero past the last tile written"
)
ROWS_8 = "dq rows 64..127 (every batch and head) never computed: zero"
ACCUM_8 = (
    "dq: every tile of 64 rows after the first read back from past everything written to its accumulator "
    "(zero): read at a wider stride than written; widths 8/16, 8/32, 8/64, 16/32, 16/64, 32/64 (written/read) "
    "fit alike"
)


@pytest.mark.parametrize(
    "name, detail",
    [
        ("bf16-d8-b1h1k1-s128x128-normal-seed0", ACCUM_8),
        ("bf16-d40-b1h1k1-s128x128-causal-normal-seed0", ACCUM_40),
        ("bf16-d72-b1h2k1-s128x128-normal-seed0", ACCUM_72_GQA),
    ],
    ids=["d8", "d40-causal", "d72-gqa"],
)
def test_productions_head_dim_defect_is_named_as_the_accumulator_stride(name, detail):
    """flash-attn-4 4.0.0b40's own gradients from the H200 (2026-12-05): at the head dims where
    its SM90 backward pads its tile to 16 columns and its accumulators to 32, the stride is named
    first and explains every violating element but a handful (d8: past everything written, zero,
    which several widths predict alike: the detail says so instead of picking one, and the zero
    rows come first)."""
    from audits.verdict.causes import rank_causes

    saved = torch.load(H200_GRADS)[name]
    case = Case(**saved["config"])
    x, do, ref = _fp64(case)
    grads = {n: saved[n] for n in ("dq", "dk", "dv")}
    t = CaseTensors(case, inputs=x, grads=grads, grad_refs=ref, grad_output=do)
    found = rank_causes(grad_causes(tensors=t, rec={"backward": {"status": "ran"}}))
    if case.d == 8:  # all zero: the zero rows, which claim less, come first in the tie
        assert (found[0].cause, found[0].detail, found[0].score) == ("dropped_tile", ROWS_8, 1.0), found
        found = found[1:]
    assert (found[0].cause, found[0].detail) == ("accum_stride", detail), found
    assert found[0].score >= 0.99, found[0]


def test_the_accumulator_read_shifts_each_row_tile_by_its_stride():
    """Written 48 wide in tiles of 64 rows, read 64 wide: tile 1's column c is column c + 16 of the
    gradient, then tile 1's padding (zero), then tile 2's first 8 columns; tile 2 reads 32
    columns on: its columns 0..7 are columns 32..39, the rest padding (40..47) or past everything
    written: zero; tile 0 is untouched."""
    from audits.verdict.grad_causes import accumulator_read

    g = torch.arange(1, 1 + 2 * 192 * 3 * 40, dtype=torch.float64).reshape(2, 192, 3, 40)
    got = accumulator_read(g, tile=64, written=48, read=64)
    assert torch.equal(got[:, :64], g[:, :64])
    assert torch.equal(got[:, 64:128, :, :24], g[:, 64:128, :, 16:40])
    assert not got[:, 64:128, :, 24:32].any()  # tile 1's padding
    assert torch.equal(got[:, 64:128, :, 32:], g[:, 128:, :, :8])  # tile 2's first columns
    assert torch.equal(got[:, 128:, :, :8], g[:, 128:, :, 32:40])
    assert not got[:, 128:, :, 8:].any()


def test_the_accumulator_stride_names_each_head_dims_widths():
    """d 40 and dv 72 under GQA, every gradient read back as production's SM90 does (written at
    the head dim padded to 16, read at it padded to 32): one hypothesis over the three, the widths
    given per head dim."""
    from audits.verdict.grad_causes import accumulator_read

    case = Case(**{**BF16, "d": 40, "dv": 72, "seqlen_q": 128, "seqlen_k": 128}, heads_q=4, heads_kv=2)
    x, do, ref = _fp64(case)
    pad = {40: (48, 64), 72: (80, 96)}
    grads = {}
    for n in ("dq", "dk", "dv"):
        written, read = pad[ref[n].shape[-1]]
        grads[n] = accumulator_read(ref[n], tile=64, written=written, read=read).to(torch.bfloat16)
    t = CaseTensors(case, inputs=x, grads=grads, grad_refs=ref, grad_output=do)
    found = [c for c in grad_causes(tensors=t, rec={"backward": {"status": "ran"}}) if c.cause == "accum_stride"]
    assert [c.detail for c in found] == [
        "dq, dk and dv read back from their accumulators at a stride of 64 rows (keys for dk, dv) x the width "
        "read, written at the width written (head dim 40: 48 written, 64 read; head dim 72: 80 written, 96 read): "
        "tile t read t x 16 columns past its own, zero past the last tile written"
    ]
    assert found[0].score >= 0.99, found[0]
