"""A pass that rests on memory the kernel never wrote (audits/engine/evaluate.py, ``_judged_written``;
the gate's ``unwritten`` and ``memory-read``): a case whose result holds values fresh memory could
have supplied (NaN, inf, 0, or a non-finite reference) is re-run with poisoned memory, and fails
where elements took the fill or changed with it.  Fresh memory's contents are set here by a
dispatch mode (:class:`FreshMemoryHolds`), as the operating system's zeroed pages or a freed NaN
tensor set them on a real machine: Triton's tutorial's unwritten batch passed so on the H200 and in
Triton's interpreter (2026-12-04), where it held NaN and the reference was NaN."""

import dataclasses
import math

import pytest
import torch
from torch.utils import deterministic
from torch.utils._python_dispatch import TorchDispatchMode

from audits.engine.backward import BackwardOptions
from audits.engine.evaluate import evaluate_case
from audits.kernels import get_kernel
from audits.suites.cases import suite
from audits.verdict.gate import judge, load_thresholds
from tests import bugged_kernels, cause_bugs

SMOKE = suite("smoke")
#: causal, 130 x 70 bottom-right: rows 0..59 of each of its 2 heads see no key (FA's output 0 there)
EMPTY_ROWS = next(c for c in SMOKE if c.name == "bf16-d96-b1h2k2-s130x70-causal-peaked-seed0")
#: NaN in K and inf in V where every row sees them: the reference is NaN everywhere; batch 2
ALL_NAN = dataclasses.replace(
    next(c for c in SMOKE if c.name == "f16-d64-b1h2k2-s128x128-nan_inf_visible-seed0"), batch=2
)
TH = load_thresholds()
_EMPTIES = {torch.ops.aten.empty, torch.ops.aten.empty_like, torch.ops.aten.empty_strided}


class FreshMemoryHolds(TorchDispatchMode):
    """Fresh float allocations (``torch.empty*``) hold ``value``, as a machine's fresh memory holds
    zeros or a freed tensor's NaN, except under torch's own NaN fill (the first poisoned run's),
    which stands: the poisoned runs then see their fills, as on a machine."""

    def __init__(self, value: float):
        super().__init__()
        self.value = value

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        filled = deterministic.fill_uninitialized_memory and torch.are_deterministic_algorithms_enabled()
        if func.overloadpacket in _EMPTIES and out.is_floating_point() and not filled:
            out.fill_(self.value)
        return out


def _evaluate(fn, case, *, memory: float, poison: bool, backward: bool = False) -> dict:
    opts = BackwardOptions() if backward else None
    with FreshMemoryHolds(memory):
        return evaluate_case("k", fn, case, torch.device("cpu"), TH, opts, poison=poison)


def test_the_cases_hold_what_the_tests_need():
    rec = _evaluate(get_kernel("fa4-model"), EMPTY_ROWS, memory=0.0, poison=False)
    assert rec["verdict"] == "pass" and rec["out"]["checked"] == rec["out"]["elements"]
    rec = _evaluate(get_kernel("fa4-model"), ALL_NAN, memory=math.nan, poison=False)
    assert rec["out"]["checked"] == 0 and rec["out"]["nan_swallowed"] == 0  # NaN agreement only: nothing finite
    # FA4 returns -inf for a NaN row's LSE (a semantics deviation, [policy] nan_swallowed)
    assert rec["verdict"] == "warn" and rec["reasons"] == [
        "512 LSE values: the kernel returns -inf where the FP64 reference is NaN (a visible score is NaN: a NaN or "
        "inf in q or k) — a semantics deviation"
    ]


def test_rows_never_written_that_memory_zeroed_fail_as_unwritten():
    """60 rows of 2 heads, d 96: 11,520 elements never written, 0 in memory, 0 in the reference."""
    assert _evaluate(cause_bugs.unwritten_empty_rows, EMPTY_ROWS, memory=0.0, poison=False)["verdict"] == "pass"
    rec = _evaluate(cause_bugs.unwritten_empty_rows, EMPTY_ROWS, memory=0.0, poison=True)
    assert rec["verdict"] == "fail"
    assert rec["written"]["unwritten"] == 60 * 2 * 96 and rec["written"]["read"] == 0
    assert rec["reasons"][0].startswith(
        "11,520 elements of the result never written by the kernel (out rows 0..59 of every batch (1), every head): "
        "re-run with fresh memory filled with NaN, then a finite pattern, they took the fill both times"
    ), rec["reasons"]
    first = rec["diagnosis"]["causes"][0]
    assert (first["cause"], first["detail"]) == ("unwritten_output", rec["written"]["unwritten_where"])


def test_a_batch_never_written_that_memory_made_nan_fails_where_the_reference_is_nan():
    # without the poisoned runs, the model's LSE deviation alone: the unwritten output passes
    assert _evaluate(cause_bugs.unwritten_later_batches, ALL_NAN, memory=math.nan, poison=False)["verdict"] == "warn"
    rec = _evaluate(cause_bugs.unwritten_later_batches, ALL_NAN, memory=math.nan, poison=True)
    assert rec["verdict"] == "fail" and rec["written"]["unwritten"] == 128 * 2 * 64
    assert "(out batch 1: every row, every head)" in rec["reasons"][0]


def test_rows_computed_from_memory_never_zeroed_fail_as_reading_it():
    """A stale accumulator, scaled: 0 while memory holds 0, NaN under the NaN fill, not the pattern
    under the pattern's (12,689.6 x 2**-30)."""
    assert _evaluate(cause_bugs.stale_empty_rows, EMPTY_ROWS, memory=0.0, poison=False)["verdict"] == "pass"
    rec = _evaluate(cause_bugs.stale_empty_rows, EMPTY_ROWS, memory=0.0, poison=True)
    assert rec["verdict"] == "fail" and rec["written"]["unwritten"] == 0 and rec["written"]["read"] == 11_520
    assert rec["reasons"][0].startswith("11,520 elements of the result read memory the kernel never wrote (out rows")
    assert rec["diagnosis"]["causes"][0]["cause"] == "uninitialized_read"


@pytest.mark.parametrize(("case", "memory"), [(EMPTY_ROWS, 0.0), (ALL_NAN, math.nan)], ids=["zeros", "nan"])
@pytest.mark.parametrize("kernel", ["fa4-model", "exact"])
def test_a_correct_kernel_passes_the_check_and_says_it_was_made(kernel, case, memory):
    fn = get_kernel(kernel) if kernel == "fa4-model" else bugged_kernels.exact  # FP64, rounded once
    rec = _evaluate(fn, case, memory=memory, poison=True)
    assert rec["verdict"] in ("pass", "warn") and not any("memory" in r or "written" in r for r in rec["reasons"])
    assert rec["written"]["memory_like"] > 0 and rec["written"]["unwritten"] == rec["written"]["read"] == 0


def test_a_case_without_memory_like_values_is_not_rerun():
    """Finite, nonzero everywhere: an unwritten element would have to hold memory within the bound."""
    case = next(c for c in SMOKE if c.family == "normal" and not c.varlen)
    assert "written" not in _evaluate(get_kernel("fa4-model"), case, memory=0.0, poison=True)


def test_the_gate_reads_the_record_alone():
    """``judge`` on a record: ``written`` fails it, whatever else passed; a record without it is
    judged as before (reports written before the check)."""
    rec = _evaluate(get_kernel("fa4-model"), EMPTY_ROWS, memory=0.0, poison=True)
    assert judge(rec, TH)[0] == "pass"
    seeded = {**rec, "written": {**rec["written"], "read": 3, "read_where": "out rows 1..3"}}
    verdict, reasons = judge(seeded, TH)
    assert verdict == "fail" and reasons[0].startswith("3 elements of the result read memory the kernel never wrote")
    assert judge({k: v for k, v in rec.items() if k != "written"}, TH)[0] == "pass"


# ---- the backward: dq, dk, dv --------------------------------------------------------------------


def test_dq_rows_never_written_that_memory_zeroed_fail_as_unwritten_gradients():
    """dq rows whose gradient is 0, never written, 0 in memory: the 60 rows per head that see no key
    (FA's convention, which ``empty-row-nonzero`` checks) and row 60, which sees one key (P = 1,
    dP - D = dO.v - dO.o = 0 exactly).  The forward is the model's and passes its own check."""
    rec = _evaluate(cause_bugs.unwritten_empty_dq_rows, EMPTY_ROWS, memory=0.0, poison=False, backward=True)
    assert rec["verdict"] == "pass"
    rec = _evaluate(cause_bugs.unwritten_empty_dq_rows, EMPTY_ROWS, memory=0.0, poison=True, backward=True)
    assert rec["verdict"] == "fail"
    assert rec["written"]["unwritten"] == 0  # the forward wrote everything
    w = rec["backward"]["written"]
    assert w["unwritten"] == 61 * 2 * 96 and w["read"] == 0
    assert rec["reasons"][0].startswith(
        "11,712 elements of the gradients never written by the kernel (dq rows 0..60 of every batch (1), every head)"
    ), rec["reasons"]
    assert rec["diagnosis"]["causes"][0]["cause"] == "unwritten_output"


def test_a_correct_backward_passes_the_check_and_says_it_was_made():
    rec = _evaluate(get_kernel("fa4-model"), EMPTY_ROWS, memory=0.0, poison=True, backward=True)
    assert rec["verdict"] == "pass", rec["reasons"]
    w = rec["backward"]["written"]
    assert w["memory_like"] >= 60 * 2 * 96 and w["unwritten"] == w["read"] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="gpu test: no CUDA device")
@pytest.mark.parametrize("bug", ["unwritten_empty_rows", "unwritten_empty_dq_rows"])
def test_on_cuda_rows_never_written_fail_whatever_memory_held(bug):
    """On CUDA, memory as the caching allocator hands it out (no emulation): where it held 0 the
    check fails the case, where it held anything else the bound does; either way the cause is
    named first, and the forward, or the backward, says where."""
    opts = BackwardOptions() if bug.endswith("dq_rows") else None
    rec = evaluate_case("k", getattr(cause_bugs, bug), EMPTY_ROWS, torch.device("cuda"), TH, opts, poison=True)
    assert rec["verdict"] == "fail", rec["reasons"]
    first = rec["diagnosis"]["causes"][0]
    assert first["cause"] == "unwritten_output", rec["diagnosis"]["causes"]
    assert first["detail"].startswith("dq rows 0..60" if opts else "out rows 0..59"), first


def test_the_markdown_report_says_what_the_check_re_ran(tmp_path):
    from audits import cli

    out = tmp_path / "o"
    assert cli.main(["run", "--quiet", "--kernel", "fa4-model", "--case", EMPTY_ROWS.name, "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    assert (
        'Memory the kernel never wrote (docs/diagnosis.md, "A pass that rests on memory"): 1 case whose result held '
        "NaN, inf or 0 (or a non-finite reference) re-run with poisoned memory: none depends on it." in md
    ), md[:1500]
    out = tmp_path / "no-poison"
    assert (
        cli.main(
            ["run", "--quiet", "--kernel", "fa4-model", "--case", EMPTY_ROWS.name, "--no-poison", "--out", str(out)]
        )
        == 0
    )
    assert "Memory the kernel never wrote" not in (out / "report.md").read_text()


def test_a_case_the_backward_check_fails_still_says_what_its_forward_runs_showed():
    """dq reads an accumulator never zeroed (0 in memory, so the checks accept it): the backward's
    poisoned runs fail the case, and the forward's, made by the same check and finding nothing,
    leave their negative sentence, as a failing case's own poisoned runs do."""
    rec = _evaluate(cause_bugs.stale_dq_accumulator, EMPTY_ROWS, memory=0.0, poison=True, backward=True)
    assert rec["verdict"] == "fail" and rec["backward"]["written"]["read"] == 12_480
    assert rec["written"]["unwritten"] == rec["written"]["read"] == 0
    assert rec["diagnosis"]["poisoned"]["forward"].startswith(
        "re-run with fresh memory filled (nan and pattern): out, lse bit-identical to the normal run"
    )
    assert [c["cause"] for c in rec["diagnosis"]["causes"]] == ["uninitialized_read"]
