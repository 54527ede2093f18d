"""Poisoned runs (audits/engine/poison.py): a kernel re-run with fresh memory filled with NaN, then
a finite pattern, names the causes unwritten_output and uninitialized_read, in this process and in
a worker process; correct kernels get neither; torch's global settings come back as they were."""

from pathlib import Path

import pytest
import torch
from torch.utils import deterministic

from audits.engine.backward import BackwardOptions
from audits.engine.poison import PATTERN_VALUES, _prefill_cuda, grad_poison_causes, poison_causes, poisoned
from audits.engine.worker import InProcess, Isolated
from audits.kernels import get_kernel
from audits.suites.cases import suite
from audits.suites.inputs import make_grad_output, make_inputs
from audits.verdict.causes import CAUSES
from tests import bugged_kernels, cause_bugs

ROOT = Path(__file__).parents[1]
SMOKE = suite("smoke")
#: batch 2, causal, 200 x 300: the batch offset bug shows (it needs a second batch)
CASE = SMOKE[0]
POISON = ("unwritten_output", "uninitialized_read")

#: each seeded bug: its cause and the words its detail must hold
BUGS = {
    "unwritten_rows": ("unwritten_output", "out rows 199 of every batch (2), every head"),
    "uninitialized_accumulator": ("uninitialized_read", "out rows 100..199 of every batch (2), every head"),
    "batch_offset_unwritten": ("unwritten_output", "out batch 1: every row, every head"),
}


@pytest.fixture(autouse=True)
def _settings_restored():
    """Every test here leaves torch's determinism settings as it found them."""
    was = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        deterministic.fill_uninitialized_memory,
    )
    yield
    now = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        deterministic.fill_uninitialized_memory,
    )
    assert now == was


@pytest.fixture
def _cwd(monkeypatch):
    monkeypatch.chdir(ROOT)  # tests.cause_bugs resolves as module:attr, here and in the workers


def causes_of(call, x) -> list:
    out, lse = call(x["q"], x["k"], x["v"], return_lse=True, **x["kw"])
    return poison_causes(call=call, x=x, out=out, lse=lse, device="cpu")


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_each_seeded_bug_is_named_by_its_poison_cause_in_process(bug):
    x = make_inputs(CASE, device="cpu")
    causes = causes_of(InProcess(bug, getattr(cause_bugs, bug)), x)
    cause, detail = BUGS[bug]
    assert causes and causes[0].cause == cause, [c.as_dict() for c in causes]
    assert causes[0].detail == detail
    assert all(c.cause in CAUSES for c in causes)
    assert 0 < causes[0].score <= 1
    assert "0x46" in causes[0].evidence and "NaN" in causes[0].evidence


def test_an_uninitialized_read_is_not_mistaken_for_unwritten_output():
    """The accumulator's rows become NaN under the NaN fill, as unwritten rows would: only the
    second fill (the value moves, but not to the pattern) tells that they were written."""
    x = make_inputs(CASE, device="cpu")
    causes = causes_of(InProcess("b", cause_bugs.uninitialized_accumulator), x)
    assert [c.cause for c in causes] == ["uninitialized_read"]
    assert "51,200 became NaN under the NaN fill" in causes[0].evidence  # rows 100..199 x 2 batches x 4 heads x 64


@pytest.mark.parametrize("case", [SMOKE[0], SMOKE[1], SMOKE[5], SMOKE[6]], ids=lambda c: c.name)
@pytest.mark.parametrize("kernel", ["fa4-model", "exact"])
def test_correct_kernels_get_no_poison_cause(kernel, case):
    fn = get_kernel(kernel) if kernel == "fa4-model" else bugged_kernels.exact
    assert causes_of(InProcess(kernel, fn), make_inputs(case, device="cpu")) == []


def test_a_normal_run_that_held_the_pattern_already_is_told_apart_by_the_second_pattern():
    """An accumulator never zeroed whose normal run read memory an earlier pattern run had filled
    (as a worker's allocator hands it back): the pattern run reproduces the normal run where the NaN
    run is NaN, as if the pattern had not reached the accumulator; a second pattern moves those
    elements, so they were read, not left unwritten (the worker test named them unwritten_output in
    2 of 10 runs, 2026-12-04)."""
    x = make_inputs(CASE, device="cpu")
    call = InProcess("b", cause_bugs.uninitialized_accumulator)
    with poisoned("pattern", device="cpu"):  # the normal run: stale memory that holds the pattern
        out, lse = call(x["q"], x["k"], x["v"], return_lse=True, **x["kw"])
    causes = poison_causes(call=call, x=x, out=out, lse=lse, device="cpu")
    assert [(c.cause, c.detail) for c in causes] == [BUGS["uninitialized_accumulator"]]
    assert "then byte 0x47 where the first pattern reproduced the normal run" in causes[0].evidence
    # without stale memory the first pattern decides, and the evidence names no second one
    out, lse = call(x["q"], x["k"], x["v"], return_lse=True, **x["kw"])
    fresh = poison_causes(call=call, x=x, out=out, lse=lse, device="cpu")
    assert [c.cause for c in fresh] == ["uninitialized_read"] and "0x47" not in fresh[0].evidence


def test_run_to_run_differences_are_not_an_uninitialized_read():
    """A kernel whose every call differs a little (atomics, say): the control run differs from the
    normal one as much as the pattern run does, so the pattern run's changes are not the fill's."""
    g = torch.Generator().manual_seed(0)

    def noisy(q, k, v, *, return_lse=False, **kw):
        out, lse = bugged_kernels.exact(q, k, v, return_lse=True, **kw)
        out = out + (torch.rand(out.shape, generator=g) < 0.01).to(out.dtype) * 2**-6
        return (out, lse) if return_lse else out

    assert causes_of(InProcess("noisy", noisy), make_inputs(SMOKE[1], device="cpu")) == []


def test_a_poisoned_run_that_raises_is_said_and_the_other_fill_still_judges():
    """A kernel that refuses deterministic mode: the NaN run fails (the evidence says why), the
    pattern run alone still finds the unwritten row."""

    def refuses(q, k, v, *, return_lse=False, **kw):
        if torch.are_deterministic_algorithms_enabled():
            raise RuntimeError("no deterministic implementation")
        return cause_bugs.unwritten_rows(q, k, v, return_lse=return_lse, **kw)

    causes = causes_of(InProcess("refuses", refuses), make_inputs(CASE, device="cpu"))
    assert [c.cause for c in causes] == ["unwritten_output"]
    assert "the nan run failed (RuntimeError: no deterministic implementation)" in causes[0].evidence


def test_nan_only_is_said_only_where_the_pattern_did_not_reach():
    """Rows the pattern cannot fill (an allocation out of the dispatch mode's sight, as an
    extension's own) are unwritten on the NaN run alone, and the evidence says the second fill did
    not reach them. Rows whose normal run already held the pattern (memory an earlier poisoned run
    filled, as a later case's allocator cache hands back on CUDA) took both fills: no such note
    (the H200's tutorial run said it of 98,240 elements the pattern had reached, 2026-12-04)."""
    from torch.utils._python_dispatch import _disable_current_modes

    def hidden(q, k, v, *, return_lse=False, **kw):
        o, lse = bugged_kernels.exact(q, k, v, return_lse=True, **kw)
        with _disable_current_modes():  # the mode does not see it; the NaN fill (C++) still does
            out = torch.empty_like(o)
        if not torch.are_deterministic_algorithms_enabled():  # (fill_uninitialized_memory acts under it)
            out.zero_()  # fresh pages, as the system hands them out: the same on every run
        out[:, :-1] = o[:, :-1]
        return (out, lse) if return_lse else out

    x = make_inputs(CASE, device="cpu")
    (cause,) = causes_of(InProcess("hidden", hidden), x)
    assert (cause.cause, cause.detail) == BUGS["unwritten_rows"]
    assert "512 of them NaN only: the second fill did not reach them" in cause.evidence  # 2 x 4 heads x 64

    call = InProcess("b", cause_bugs.unwritten_rows)
    out, lse = call(x["q"], x["k"], x["v"], return_lse=True, **x["kw"])
    out[:, -1] = PATTERN_VALUES[out.dtype]  # the normal run's unwritten rows held the pattern already
    (cause,) = poison_causes(call=call, x=x, out=out, lse=lse, device="cpu")
    assert (cause.cause, cause.detail) == BUGS["unwritten_rows"]
    assert "512 elements" in cause.evidence and "NaN only" not in cause.evidence


def test_the_score_is_the_share_of_the_violations_explained():
    x = make_inputs(CASE, device="cpu")
    call = InProcess("b", cause_bugs.unwritten_rows)
    out, lse = call(x["q"], x["k"], x["v"], return_lse=True, **x["kw"])
    viol = torch.zeros(out.shape, dtype=torch.bool)
    viol[:, -1] = True  # the unwritten rows (2 x 4 x 64 elements) ...
    viol[:, 0] = True  # ... and as many elsewhere
    (cause,) = poison_causes(call=call, x=x, out=out, lse=lse, device="cpu", violations={"out": viol})
    assert cause.score == 0.5
    (plain,) = poison_causes(call=call, x=x, out=out, lse=lse, device="cpu")
    assert plain.score == pytest.approx(512 / (out.numel() + lse.numel()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_fills_reach_fresh_cpu_memory(dtype):
    with poisoned("nan", device="cpu"):
        assert torch.isnan(torch.empty(5, dtype=dtype)).all()
        assert torch.isnan(torch.empty_like(torch.ones(3, dtype=dtype))).all()
    with poisoned("pattern", device="cpu"):
        assert (torch.empty(5, dtype=dtype) == PATTERN_VALUES[dtype]).all()
        assert (torch.ones(2, dtype=dtype).new_empty(4) == PATTERN_VALUES[dtype]).all()
        assert (torch.zeros(3, dtype=dtype) == 0).all()  # only uninitialized allocations


@pytest.mark.parametrize("before", [False, True])
def test_torch_settings_come_back_even_when_the_kernel_raises(before):
    old_fill = deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(before)
    deterministic.fill_uninitialized_memory = False
    try:
        with pytest.raises(RuntimeError, match="kernel died"), poisoned("nan", device="cpu"):
            assert torch.are_deterministic_algorithms_enabled() and deterministic.fill_uninitialized_memory
            raise RuntimeError("kernel died")
        assert torch.are_deterministic_algorithms_enabled() is before
        assert not torch.is_deterministic_algorithms_warn_only_enabled()
        assert deterministic.fill_uninitialized_memory is False
    finally:
        torch.use_deterministic_algorithms(False)
        deterministic.fill_uninitialized_memory = old_fill


@pytest.mark.slow  # two worker spawns (a torch import each)
@pytest.mark.usefixtures("_cwd")
def test_the_poisoning_reaches_a_worker_process():
    """In a worker the poison must fill the worker's memory, not the audit's: the fill travels with
    the call.  Each bug is named as in this process, a correct kernel is not."""
    x = make_inputs(CASE, device="cpu")
    for bug in ("uninitialized_accumulator", "batch_offset_unwritten"):
        iso = Isolated(f"tests.cause_bugs:{bug}", "cpu", timeout=120)
        try:
            causes = causes_of(iso, x)
            assert causes and (causes[0].cause, causes[0].detail) == BUGS[bug]
            assert causes_of(iso.entry(None), x)[0].cause == BUGS[bug][0]  # an entry's call: the same
        finally:
            iso.close()
    iso = Isolated("tests.bugged_kernels:exact", "cpu", timeout=120)
    try:
        assert causes_of(iso, x) == []
    finally:
        iso.close()


@pytest.mark.gpu
def test_the_pattern_prefills_the_cuda_allocator():
    """On CUDA the caching allocator's pre-filled blocks hold the pattern for an allocation that
    the dispatch mode does not see, and the dispatch mode fills an output allocated after the
    kernel's own arithmetic took those blocks: the unwritten rows are found (with the pre-fill
    alone they read as uninitialized_read on the H200, 2026-12-04)."""
    _prefill_cuda(torch.device("cuda"))  # alone, outside the mode: fresh allocations carved from it
    assert (torch.empty(1000, device="cuda") == PATTERN_VALUES[torch.float32]).all()
    assert (torch.empty(3 << 20, dtype=torch.bfloat16, device="cuda") == PATTERN_VALUES[torch.bfloat16]).all()
    x = make_inputs(CASE, device="cuda")
    causes = poison_causes(call=cause_bugs.unwritten_rows, x=x, device="cuda", **_result(cause_bugs.unwritten_rows, x))
    assert [(c.cause, c.detail) for c in causes] == [BUGS["unwritten_rows"]]


def _result(fn, x) -> dict:
    out, lse = fn(x["q"], x["k"], x["v"], return_lse=True, **x["kw"])
    return {"out": out, "lse": lse}


@pytest.mark.parametrize("command", ["run", "compare"])
def test_poison_is_a_run_option_on_by_default(command, tmp_path):
    from audits.cli import build_parser
    from audits.cli.run_options import run_options_from_args
    from audits.engine.options import RunOptions
    from audits.verdict.gate import load_thresholds

    def options(*flags):
        args = build_parser().parse_args([command, "--kernel", "fa4-model", "--out", str(tmp_path), *flags])
        return run_options_from_args(args, thresholds=load_thresholds(), label="smoke")

    assert options().poison is True and RunOptions().poison is True
    assert options("--no-poison").poison is False
    assert options("--poison").poison is True


@pytest.mark.parametrize("where", ["in-process", "worker"])
def test_a_backward_accumulator_never_zeroed_is_named_by_the_backward_poison_runs(where, _cwd):
    """dq rows past the first half add memory the backward never zeroed: the backward re-run under
    the NaN fill turns them NaN, under the pattern moves them off the normal run (not to the fill):
    ``uninitialized_read`` in dq rows 100..199, and nothing in dk or dv.  In a worker, the fill
    travels with the backward call."""
    x = make_inputs(CASE, device="cpu")
    if where == "worker":
        calls = Isolated("tests.cause_bugs:stale_dq_accumulator", "cpu", timeout=120)
    else:
        calls = InProcess("stale_dq", cause_bugs.stale_dq_accumulator)
    do, opts = make_grad_output(CASE, device="cpu")[0], BackwardOptions()
    try:
        status, res = calls.grad(x, do, opts)
        assert status["status"] == "ran", status
        causes = grad_poison_causes(calls=calls, x=x, do=do, opts=opts, grads=res[2][0], device="cpu")
    finally:
        calls.close()
    assert [c.cause for c in causes] == ["uninitialized_read"], [c.as_dict() for c in causes]
    assert causes[0].detail == "dq rows 100..199 of every batch (2), every head"
    assert causes[0].evidence.startswith("backward re-run with fresh memory filled with NaN")


def test_a_correct_backward_gets_no_backward_poison_cause():
    x = make_inputs(CASE, device="cpu")
    calls = InProcess("fa4-model", get_kernel("fa4-model"))
    do, opts = make_grad_output(CASE, device="cpu")[0], BackwardOptions()
    status, res = calls.grad(x, do, opts)
    assert status["status"] == "ran"
    trace = {}
    assert grad_poison_causes(calls=calls, x=x, do=do, opts=opts, grads=res[2][0], device="cpu", trace=trace) == []
    # the negative finding is stated (a failing case's diagnosis["poisoned"]), not silent
    assert trace["summary"].startswith("backward re-run with fresh memory filled (nan and pattern): dq, dk, dv ")
    assert "does not depend on memory the kernel never wrote" in trace["summary"]


def test_the_tutorials_batch_addressing_leaves_batch_1_unwritten():
    """tests/cause_bugs.py's ``flat_batch_offset`` (Triton's tutorial's addressing, emulated) on the
    shape of the H200's first tutorial case (f16, b2 h4, 128 x 128): the same sentence and counts
    as the H200 run of the tutorial itself (reports/h200/causes-2026-12-04/triton-tutorial)."""
    from audits.suites.cases import Case

    case = Case(d=64, dv=64, dtype="float16", batch=2, heads_q=4, heads_kv=4, seqlen_q=128, seqlen_k=128)
    causes = causes_of(InProcess("flat_batch_offset", cause_bugs.flat_batch_offset), make_inputs(case, device="cpu"))
    assert [(c.cause, c.detail) for c in causes] == [("unwritten_output", "out batch 1: every row, heads 0..3")]
    assert "32,704 elements of 66,560 took the fill in both runs" in causes[0].evidence


def test_the_console_says_both_poisoned_runs_when_no_cause_is_named(tmp_path, capsys):
    """A backward failure with no cause named: the console prints what the forward's and the
    backward's poisoned runs showed (the H200's head-dim defect printed the forward's alone, while
    its answer was the backward's, 2026-12-04).  The bug is one no gradient hypothesis models (dS
    from another exp2 than the LSE's); dq missing its scale, used before, is now named."""
    from audits import cli

    spec = f"{ROOT / 'tests' / 'bugged_backward.py'}:bug_ds_other_exp2"
    argv = ["run", "--kernel", spec, "--backward", "--case", CASE.name, "--out", str(tmp_path / "o")]
    assert cli.main(argv) == 1
    out = capsys.readouterr().out
    fwd = "    poisoned (forward): re-run with fresh memory filled (nan and pattern): out, lse bit-identical"
    bwd = "    poisoned (backward): backward re-run with fresh memory filled (nan and pattern): dq, dk, dv bit-"
    assert fwd in out and bwd in out, out
