"""The data-tested causes (audits.verdict.causes.data_causes, docs/diagnosis.md "Causes"): each
seeded bug of tests/cause_bugs.py (and a few of tests/bugged_kernels.py) is named FIRST by its
cause on a small case where it shows, with the detail a reviewer would write; the correct kernels
(fa4-model, tests/bugged_kernels.py:exact) get no cause on smoke cases, and neither does an
exact result with marginal noise just past its bound.

Each case runs through ``evaluate_case`` on the CPU (the kernel's result, the FP64 reference,
the per-element bounds and the inputs it keeps in ``CaseTensors``), then ``data_causes`` on them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from audits.engine.evaluate import evaluate_case
from audits.kernels import get_kernel
from audits.suites.cases import Case, suite
from audits.verdict import causes as C
from audits.verdict import nonfinite as NF
from audits.verdict.causes import CAUSES, MIN_SCORE, Cause, data_causes
from audits.verdict.gate import load_thresholds

TH = load_thresholds()


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One intra-op thread: these small FP64 recomputations gain nothing from more, and on a loaded
    machine oversubscribed threads make them tens of times slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


SMOKE = {c.name: c for c in suite("smoke")}


def _run(spec: str, case: Case) -> tuple[dict, object, list[Cause]]:
    """(record, kept tensors, causes) of kernel ``spec`` on ``case``."""
    kept = {}
    rec = evaluate_case(spec, get_kernel(spec), case, torch.device("cpu"), TH, tensors=kept)
    keep = kept.get("keep")
    return rec, keep, data_causes(case=case, tensors=keep, rec=rec, th=TH)


D64 = dict(d=64, dv=64)
#: bug -> (case, its cause, a regex its detail must match)
CATALOGUE = {
    "tests.cause_bugs:scale_by_dv": (
        Case(dtype="float16", d=72, dv=80, seqlen_q=96, seqlen_k=160, family="student_t"),
        "softmax_scale",
        r"^c = 0\.94\d+ \(sqrt\(d/dv\) = sqrt\(72/80\)\)$",
    ),
    "tests.cause_bugs:window_left_plus_one": (
        SMOKE["bf16-d128-b1h2k2-s200x200-win64_16-flat-seed0"],
        "mask_edge",
        r"^window_left admits one key too many$",
    ),
    "tests.cause_bugs:causal_diagonal_plus_one": (
        Case(**D64, causal=True, seqlen_q=128, seqlen_k=256),
        "mask_edge",
        r"^causal_diagonal admits one key too many$",
    ),
    "tests.bugged_kernels:bug_window_off_by_one": (
        SMOKE["bf16-d128-b1h2k2-s200x200-win64_16-flat-seed0"],
        "mask_edge",
        r"^window_right admits one key too many$",
    ),
    "tests.bugged_kernels:bug_no_causal": (
        Case(**D64, causal=True, seqlen_q=128, seqlen_k=256),
        "mask_edge",
        r"^causal mask ignored$",
    ),
    "tests.cause_bugs:gqa_modulo": (
        SMOKE["bf16-d128-b1h16k4-s160x256-normal-seed0"],
        "head_mapping",
        r"^query head h reads kv head h % 4 instead of h // 4$",
    ),
    "tests.cause_bugs:batch_shifted": (
        Case(**D64, batch=2, seqlen_q=128, seqlen_k=128),
        "misplaced_rows",
        r"^batch 1 written with batch 0's output \(batch b-1\)$",
    ),
    "tests.cause_bugs:fp16_p_overflow": (
        SMOKE["f16-d64-b1h2k2-s128x384-causal-drift-seed0"],
        "overflow",
        r"^P = exp\(lag\) exceeds float16's 65504 at lag 1\d\.\d nats \(ln 65504 = 11\.09\)$",
    ),
    "tests.cause_bugs:drop_tile_one": (
        Case(**D64, seqlen_q=128, seqlen_k=384),
        "dropped_tile",
        r"^keys 128\.\.255 \(tile 1 of 128 keys\) dropped$",
    ),
    "tests.cause_bugs:nan_from_masked_keys": (
        SMOKE["bf16-d64-b1h2k2-s64x400-win32_0-nan_inf_masked-seed0"],
        "nan_leak",
        r"^NaN from masked keys [\d.]+ reaches rows 0\.\.63$",
    ),
}


@pytest.mark.parametrize("spec", list(CATALOGUE))
def test_each_seeded_bug_is_named_first_by_its_cause(spec):
    case, cause, detail = CATALOGUE[spec]
    rec, _, found = _run(spec, case)
    assert rec["verdict"] == "fail", rec["reasons"]
    assert found, f"{spec}: no cause fits"
    top = found[0]
    assert top.cause == cause, [c.as_dict() for c in found]
    assert re.search(detail, top.detail), top.detail
    assert top.score >= 0.9, top.as_dict()  # it explains (nearly) the whole failure
    assert re.search(r"\d", top.evidence) and top.evidence.count(".") <= 6  # one sentence, with numbers
    assert all(round(a.score, 2) >= round(b.score, 2) for a, b in zip(found, found[1:]))  # best first


def test_the_batch_offset_that_leaves_rows_unwritten_is_half_misplaced():
    """tests/cause_bugs.py's ``batch_offset_unwritten``: batch 1 is written one row down into batch
    0 (its own rows never written): misplaced_rows explains the half that moved, and says how."""
    _, _, found = _run("tests.cause_bugs:batch_offset_unwritten", Case(**D64, batch=2, seqlen_q=128, seqlen_k=128))
    mis = [c for c in found if c.cause == "misplaced_rows"]
    assert mis and mis[0].detail == "batch 1 written into batch 0's rows, 1 row down", [c.as_dict() for c in found]
    assert MIN_SCORE <= mis[0].score < 0.75  # the unwritten half is not its to explain


@pytest.mark.parametrize(
    "name",
    ["f16-d64-b1h2k2-s128x128-causal-nan_inf_visible-seed0", "bf16-d64-b1h2k2-s64x200-causal-nan_inf_visible-seed0"],
)
def test_a_mask_ignored_where_keys_hold_nan_is_named_by_the_nan_it_lets_through(name):
    """A kernel ignoring the causal mask on inputs whose keys hold NaN/inf: its violations are
    NaN where the reference is finite, and the reference recomputed without the mask is NaN at
    the same elements.  Met NaN for NaN, the prediction explains every violation (before, NaN !=
    NaN left it unexplained, and `compare` against the model found no cause on these 2 of 9)."""
    _, _, found = _run("tests.bugged_kernels:bug_no_causal", SMOKE[name])
    assert [(c.cause, c.detail) for c in found[:1]] == [("mask_edge", "causal mask ignored")], found
    assert found[0].score == 1.0


def test_ties_go_to_the_cause_listed_first():
    """On the drift family (rows alike) a diagonal one key late is also row i holding row i + 1's
    output: both explain the failure, and mask_edge, first in CAUSES, comes first."""
    _, _, found = _run("tests.cause_bugs:causal_diagonal_plus_one", SMOKE["f16-d64-b1h2k2-s128x384-causal-drift-seed0"])
    assert [c.cause for c in found[:2]] == ["mask_edge", "misplaced_rows"], [c.as_dict() for c in found]
    assert abs(found[0].score - found[1].score) < 0.01
    assert CAUSES.index("mask_edge") < CAUSES.index("misplaced_rows")


CLEAN_CASES = [
    "bf16-d64-b2h4k2-s200x300-causal-normal-seed0",
    "bf16-d128-b1h2k2-s200x200-win64_16-flat-seed0",
    "bf16-d128-b1h16k4-s160x256-normal-seed0",
    "f16-d64-b1h2k2-s128x384-causal-drift-seed0",
    "f16-d64-b1h3k1-s96x64-causal-sink-normal-seed0",
    "bf16-d64-b1h2k2-s64x400-win32_0-nan_inf_masked-seed0",
    "f16-d72v80-b1h2k2-s96x160-student_t-seed0",
]


@pytest.mark.parametrize("spec", ["fa4-model", "tests.bugged_kernels:exact"])
def test_correct_kernels_get_no_cause(spec):
    for name in CLEAN_CASES:
        rec, keep, found = _run(spec, SMOKE[name])
        assert rec["verdict"] == "pass", (name, rec["reasons"])
        assert found == [], (name, [c.as_dict() for c in found])


def test_marginal_noise_past_the_bound_names_no_cause():
    """An exact result with 1% of its elements pushed just past their bound (a kernel imprecise at
    random places, not wrong in one way) fails, and no hypothesis claims it."""
    case = SMOKE["bf16-d64-b2h4k2-s200x300-causal-normal-seed0"]
    _, keep, _ = _run("tests.bugged_kernels:exact", case)
    g = torch.Generator().manual_seed(5)
    hit = torch.rand(keep.out.shape, generator=g) < 0.01
    sign = torch.where(torch.rand(keep.out.shape, generator=g) < 0.5, -1.0, 1.0).double()
    keep.out = (keep.ref.double() + torch.where(hit, 1.5 * keep.out_bound.double() * sign, 0.0)).to(keep.out.dtype)
    assert int(C._tolerances(keep)[1].sum()) > 1000  # it does fail, at many elements
    assert data_causes(case=case, tensors=keep, rec={"status": "ran"}, th=TH) == []


def test_nothing_to_test_is_no_cause():
    """A case without its inputs (or one that did not run) has no hypothesis to test."""
    case = Case(**D64, batch=2, seqlen_q=128, seqlen_k=128)
    _, keep, found = _run("tests.cause_bugs:batch_shifted", case)
    assert found and found[0].cause == "misplaced_rows"
    assert data_causes(case=case, tensors=keep, rec={"status": "crashed"}, th=TH) == []
    keep.inputs = None
    assert data_causes(case=case, tensors=keep, rec={"status": "ran"}, th=TH) == []


def test_rank_causes_breaks_ties_in_vocabulary_order():
    """Best first; scores equal to two decimals are a tie, the earlier cause of CAUSES first."""
    a, b, c = (Cause(n, "", "", s) for n, s in (("dropped_tile", 0.999), ("overflow", 0.996), ("mask_edge", 0.3)))
    assert C.rank_causes([c, a, b]) == [b, a, c]
    assert C.rank_causes([Cause("dropped_tile", "", "", 0.9), b]) == [b, Cause("dropped_tile", "", "", 0.9)]
    # NaN from masked keys: the leak, which claims less, before a mask ignored that predicts the same NaN
    leak, ignored = Cause("nan_leak", "", "", 1.0), Cause("mask_edge", "window ignored", "", 1.0)
    assert C.rank_causes([ignored, leak]) == [leak, ignored]


def test_cause_as_dict_rounds_its_score():
    c = Cause("mask_edge", "window_left admits one key too many", "e", 0.123456)
    assert c.as_dict() == {"cause": "mask_edge", "detail": "window_left admits one key too many", "evidence": "e",
                           "score": 0.1235}  # fmt: skip


#: a release case whose learnable sink overflowed production's LSE on the H200 (4.0.0b36 and
#: 4.0.0b40; benchmarks/device/sink_overflow_cases.json): the SM90 model overflows the same way
SINK_CASE = "f16-d64-b2h4k1-s640x128-causal-sink-outliers-seed0"


@pytest.mark.parametrize("inspected", [None, 64])
def test_a_sink_overflow_is_named_against_the_float32_row_sum(inspected, monkeypatch):
    """The sink joins the float32 row sum: its term is held to float32's range, whatever the
    input dtype (fp16 here); past MAX_OVERFLOW_ROWS non-finite rows, evenly spaced rows are
    inspected and their share scaled up, so a large case is still named (the H200's 4096 x 4096
    case had 32,762 such rows and was left unnamed when only the first 4,096 were read)."""
    import json

    from audits.suites.cases import case_from_dict

    path = Path(__file__).parents[1] / "benchmarks" / "device" / "sink_overflow_cases.json"
    case = next(c for c in map(case_from_dict, json.loads(path.read_text())) if c.name == SINK_CASE)
    if inspected is not None:
        monkeypatch.setattr(NF, "MAX_OVERFLOW_ROWS", inspected)
    _, _, found = _run("fa4-model-sm90", case)
    assert [c.cause for c in found] == ["overflow"], [c.as_dict() for c in found]
    assert found[0].detail.startswith("the sink term exp(sink - m) reaches exp(") and found[0].detail.endswith(
        "past 3.40282e+38"
    )
    assert found[0].score >= 0.95
    assert ("64 evenly spaced rows inspected" in found[0].evidence) == (inspected is not None)


def test_an_overflow_the_finite_rows_contradict_is_not_the_cause(monkeypatch):
    """Every row of this case has its max rise by far more than ln 65504 between key tiles, so an
    fp16 P without rescaling would overflow everywhere; batch 1 is NaN for another reason (left
    unwritten) and batch 0, with the same rises, is finite: "P overflows" explains every NaN row
    but is contradicted by as many finite ones, so it is not named (the H200's Triton tutorial
    case ``f16-d128-b2h4k4-s256x256-strided-tile_step_40-seed0`` had it first, at score 1)."""
    case = Case(**{**D64, "dtype": "float16"}, batch=2, seqlen_q=256, seqlen_k=256, family="tile_step_40")
    _, keep, found = _run("tests.cause_bugs:stale_nan_batch", case)
    keep.numerics, keep.kind = None, "peer"  # judged as a kernel of unknown numerics: P in fp16, no offset
    peer = data_causes(case=case, tensors=keep, rec={"status": "ran"}, th=TH)
    assert NF.overflow_cause(keep, C._tolerances(keep)) is None
    assert "overflow" not in [c.cause for c in [*found, *peer]], [c.as_dict() for c in found]
    # with the finite rows' contradiction ignored, it would be named, at score 1
    monkeypatch.setattr(NF, "OVERFLOW_PRECISION", 0.0)
    raw = NF.overflow_cause(keep, C._tolerances(keep))
    assert raw.score == pytest.approx(0.5) and "it also exceeds in 512 rows the kernel got finite" in raw.evidence


@pytest.mark.parametrize("bug", ["flat_batch_offset", "flat_batch_offset_raced"])
@pytest.mark.parametrize("causal", [False, True])
def test_the_tutorials_batch_addressing_is_named_misplaced_with_its_stride(causal, bug):
    """tests/cause_bugs.py's ``flat_batch_offset``, Triton's fused-attention tutorial's Hopper
    addressing emulated (batch 1 reads and writes batch 0's rows one row down): unlike
    ``batch_offset_unwritten`` what lands in batch 0 is no reference row of batch 1 (the reads move
    too), so only the batch-stride hypothesis names it, and follows the kernel wherever it moves.
    The rows no program addresses are left to the poisoned runs and said; where batch 0's own
    write wins the race on half the tiles (``_raced``: on the H200 the tutorial's batch 0 was moved
    on some cases and correct on others), the rows it won do not count against it (before they
    did, and the hypothesis fell under the floor on 12 of the tutorial's 21 failing cases)."""
    case = Case(**D64, dtype="float16", batch=2, heads_q=4, heads_kv=4, seqlen_q=128, seqlen_k=128, causal=causal)
    _, _, found = _run(f"tests.cause_bugs:{bug}", case)
    assert [c.cause for c in found] == ["misplaced_rows"], [c.as_dict() for c in found]
    assert found[0].detail == C._STRIDE_WORDS[1]
    assert found[0].score >= 0.99
    assert "and the kernel follows it at 100% of the" in found[0].evidence
    assert "violating elements in the 511 rows no program addresses are not counted" in found[0].evidence
    assert "a row two programs write may hold either write (they race)" in found[0].evidence


def test_a_row_moved_by_the_wrong_stride_counts_against_the_batch_stride():
    """Contested rows the kernel gets neither right nor as predicted still count: a kernel whose
    batch 1 lands two rows down (a stride of 2 rows, which no hypothesis predicts) is not named."""
    case = Case(**D64, dtype="float16", batch=2, heads_q=4, heads_kv=4, seqlen_q=128, seqlen_k=128)
    _, _, found = _run("tests.cause_bugs:flat_batch_offset_two", case)
    assert "misplaced_rows" not in [c.cause for c in found], [c.as_dict() for c in found]


VARLEN = {
    # sequences 0x50 (no query), 1x1 (one key: nothing past the diagonal), 5x0 (no key) cannot show it
    "bf16-d64-b6h4k2-s130x200-causal-vl0x50.1x1.37x30.130x130.5x0.64x200-student_t-seed0": "sequences 2..3, 5",
    # a paged KV cache: each sequence's used keys from the inputs' parts
    "bf16-d64-b3h4k1-s200x300-causal-vl70x300.1x129.200x200-page64-peaked-seed0": "sequence 2",
}


@pytest.mark.parametrize("name", list(VARLEN))
def test_a_varlen_case_is_scored_per_sequence_and_merged_by_detail(name):
    """A fixed-length bug run one sequence at a time (--per-sequence) on a varlen case: each
    sequence with violations is scored as its own batch-1 case, and the sequences where the same
    cause fits are named together; the model gets no cause on the same case."""
    case = SMOKE[name]
    kept = {}
    bug = "tests.cause_bugs:causal_diagonal_plus_one"
    rec = evaluate_case(bug, get_kernel(bug), case, torch.device("cpu"), TH, per_sequence=True, tensors=kept)
    assert rec["verdict"] == "fail"
    top = rec["diagnosis"]["causes"][0]
    assert (top["cause"], top["detail"]) == ("mask_edge", f"{VARLEN[name]}: causal_diagonal admits one key too many")
    assert top["score"] >= 0.9 and "scored per sequence, weighted by its violations" in top["evidence"]
    clean = evaluate_case("fa4-model", get_kernel("fa4-model"), case, torch.device("cpu"), TH, tensors=kept)
    assert clean["verdict"] == "pass" and not (clean.get("diagnosis") or {}).get("causes")
