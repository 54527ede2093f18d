"""Run a suite of cases for one or several kernels: inputs, the kernel, the FP64 reference
(certified on one row by an exact computation, ``numerics.reference.exact_attention_rows``),
metrics, the per-element bound, a verdict per case.

Every finished case is appended to ``OUT/journal.jsonl`` (flushed and fsynced) so that
``RunOptions(resume=True)`` continues after a crash, a kill or Ctrl-C without redoing finished cases.
Cases run in a stratified order (``audits.engine.shards.run_order``), so that any prefix of a
run spans the suite's axes; JIT kernels are cached per compile key, so each variant still
compiles once per process.  A run stops early, cleanly, at Ctrl-C, at ``deadline`` (``run
--budget``) or at the first failure (``-x``), saying why (``Runs.stopped``, a ``StopReason``).
:func:`shard_cases` cuts a deterministic 1/n slice balanced by expected cost.  Failing cases get a reproducer:
their inputs saved under ``OUT/repro/`` and a one-line command in the report.

A varlen case (``Case.seqlens``, ``docs/varlen.md``) runs through the kernel's varlen entry
(``audits.kernels.get_varlen_kernel``), or with ``per_sequence`` through a fixed-length kernel
called once per sequence (``audits.kernels.per_sequence``); each sequence is referenced and
bounded as the fixed-length call on its rows and used keys, and the sequences' results are
measured together, packed along the tokens as the kernel returns them.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math
import time
from collections.abc import Callable

import torch

from audits.contract import contract_breaches, varlen_contract_breaches
from audits.engine.backward import BackwardOptions, analyse_backward, case_references
from audits.engine.failures import failure_reason, traceback_of
from audits.engine.poison import grad_poison_causes, poison_causes
from audits.engine.worker import (
    KernelCalls,
    KernelTimeout,
    WorkerCrashed,
    as_calls,
)
from audits.kernels import (
    MODELS,
    base_kernel,
    claims_nonfinite_inputs,
    fa4_arch,
    fa4_varlen_numerics,
    fa4_varlen_splits,
    model_overrides,
)
from audits.report.schema import FAILING
from audits.suites.cases import Case
from audits.suites.inputs import NotApplicable, make_grad_output, make_inputs, make_varlen_inputs
from audits.verdict.bias import bias_cause
from audits.verdict.causes import Cause, data_causes, rank_causes
from audits.verdict.diagnosis import CaseTensors, diagnose
from audits.verdict.gate import judge
from audits.verdict.grad_causes import grad_causes
from numerics.call import AttentionCall
from numerics.forward_bound import forward_error_bound
from numerics.fp import bit_view
from numerics.metrics import bias_record, bound_check, fa_floor, lse_errors, output_errors
from numerics.reference import attention_lowprec, attention_reference, exact_attention_rows

__all__ = ["evaluate_case"]


def _certify(
    x: dict, ref: torch.Tensor, rl: torch.Tensor, row: tuple[int, int, int], scale: torch.Tensor
) -> tuple[float, float] | None:
    """Largest |FP64 reference - exact| over one row's (batch, head, query) outputs and LSE (the
    exact row from ``numerics.reference.exact_attention_rows``, ~1e-23 relative), and the row's
    scale: the largest of its outputs' scales sum_j P_ij |V_jc| (``scale``, the reference's own) and
    its |LSE|, what the FP64 evaluation's rounding is proportional to.  None when the row is not
    certifiable (non-finite inputs reach it: the semantics rules judge it)."""
    (got,) = exact_attention_rows(x["q"], x["k"], x["v"], [row], call=AttentionCall.from_kwargs(**x["kw"]))
    if got is None:
        return None
    mo, ml = got
    r = ref[row[0], row[2], row[1]].double().cpu().tolist()
    lse = float(rl[row[0], row[1], row[2]])
    diffs = [abs(float(a) - b) for a, b in zip(mo, r)]
    if math.isfinite(float(ml)) or math.isfinite(lse):
        diffs.append(abs(float(ml) - lse))  # inf if only one of them is infinite
    s = scale[row[0], row[2], row[1]].double()
    s = float(s[torch.isfinite(s)].max()) if bool(torch.isfinite(s).any()) else 0.0
    return max(diffs), max(s, abs(lse) if math.isfinite(lse) else 0.0)


@functools.lru_cache(maxsize=4)  # consecutive kernels on one case share it; GPU memory is better spent elsewhere
def _reference(case: Case, device: str) -> tuple:
    """FP64 reference, its LSE, the low-precision PyTorch result, the exact-row certification
    and the output's scale sum_j P_ij |V_jc| (the floor of FA's criterion,
    ``numerics.metrics.fa_floor``; from the reference's own pass, ``return_scale``) of one case:
    they depend on the inputs only, so a process auditing several kernels on the same suite
    computes them once."""
    x = make_inputs(case, device=device)
    call = AttentionCall.from_kwargs(**x["kw"])
    ref, rl, scale = attention_reference(x["q"], x["k"], x["v"], call=call, return_lse=True, return_scale=True)
    low = attention_lowprec(x["q"], x["k"], x["v"], call=call)
    cert = _certify(x, ref, rl, (case.batch - 1, case.heads_q - 1, case.seqlen_q - 1), scale)
    return ref, rl, low, cert, scale


#: the float32 products a peer's base-2 score is formed with before its row max is subtracted
#: (``numerics.forward_bound.score_product_error``): the scale and log2(e) as two multiplies, as
#: flex_attention's Triton template does (docs/peers.md); FA4 rounds only the difference (0)
PEER_SCORE_PRODUCTS = 2


def _score_products(kind: str) -> dict:
    """The bound's ``score_products`` keyword for a bound of ``kind`` ("fa4" | "peer")."""
    return {"score_products": PEER_SCORE_PRODUCTS} if kind == "peer" else {}


@functools.lru_cache(maxsize=4)
def _bound(case: Case, device: str, nm, kind: str = "fa4") -> tuple:
    """Per-element forward bound of a case under numerics ``nm`` of bound ``kind``: kernels
    sharing numerics (the three SDPA backends; production SM90 and its model) share it."""
    x = make_inputs(case, device=device)
    call = AttentionCall.from_kwargs(**x["kw"])
    ref = _reference(case, device)[:2]
    return forward_error_bound(x["q"], x["k"], x["v"], nm, call=call, reference=ref, **_score_products(kind))


def _domain(q, k, v, case: Case, nm) -> str | None:
    """Why these inputs lie outside the float32 range the kernel's design covers (the headroom
    analysis of ``numerics.bounds``), or None: logits |q.k| beyond FLT_MAX, or P.V sums up to
    seqlen_k * P_max * max|V| beyond it, P_max = 2**(threshold + max_offset)."""
    fin = lambda t: t.double()[torch.isfinite(t.double())]
    qa, ka, va = (fin(t).abs().max().item() if fin(t).numel() else 0.0 for t in (q, k, v))
    flt = 3.4028234663852886e38
    if qa * ka * case.d >= flt:
        return f"logits can reach {qa * ka * case.d:.3g} > float32 max (max|q| {qa:.3g}, max|k| {ka:.3g}, d {case.d})"
    pmax = 2.0 ** (nm.rescale_threshold + nm.max_offset) if nm is not None else 1.0
    if va > 0 and math.log2(case.seqlen_k * pmax * va) >= 128:
        return f"P.V sums can reach seqlen_k * P_max * max|V| = {case.seqlen_k} * {pmax:g} * {va:.3g} > float32 max"
    return None


def _peer_numerics(q: torch.Tensor):
    """Generic flash-attention numerics for kernels that do not implement FA4's (thresholds
    ``peer_bound``): float32 softmax, hardware-class exp2, P rounded to the input dtype."""
    from fa4.model import FA4Numerics  # lazy: fa4.model loads numba (~0.2 s)

    return FA4Numerics(
        arch="sm90", tile_m=128, tile_n=128, exp2="hardware", rescale_threshold=0.0, max_offset=0, p_dtype=q.dtype
    )


def _fa4_numerics(kernel: str, x: dict, case: Case):
    """The FA4Numerics a kernel implementing FA4's numerics runs ``case`` with (None for the
    others), the call (inputs ``x``, its mods among ``x["kw"]``) resolved as production resolves
    it: ``FA4Numerics.for_call`` (with a mask_mod, causal and the window dropped; with block
    sparsity, the tiles fitted to the sparse block); a model variant's overrides on top
    (``audits.kernels.model_overrides``: the bound analyses the numerics the variant runs)."""
    arch = fa4_arch(kernel)
    if arch is None:
        return None
    from fa4.model import FA4Numerics  # lazy: numba

    kw = x["kw"]
    nm = FA4Numerics.for_call(
        arch,
        x["q"],
        x["k"],
        x["v"],
        causal=case.causal,
        window_size=tuple(case.window),
        mask_mod=kw.get("mask_mod"),
        block_sparse_tensors=kw.get("block_sparse_tensors"),
    )
    return dataclasses.replace(nm, **model_overrides(kernel))


def _analyse(
    rec: dict, kernel: str, case: Case, x: dict, out: torch.Tensor, lse, device: torch.device, keep: CaseTensors
) -> None:
    """Reference, metrics, bound and criteria of a kernel result, into ``rec``; the tensors a
    failing verdict is localized with, into ``keep``."""
    q = x["q"]
    nm = _fa4_numerics(kernel, x, case)
    kind = "fa4" if nm is not None else "peer"
    nm = nm if nm is not None else _peer_numerics(q)
    refs, bounds = _reference(case, str(device)), _bound(case, str(device), nm, kind)
    _measure(rec, kernel, case, x, out, lse, refs, bounds, (kind, nm), keep)
    b = rec["bound"]
    finite_excess = b["violations"] - b["nonfinite"] + b["lse_violations"] - b.get("lse_nonfinite", 0)
    if finite_excess and base_kernel(kernel) not in MODELS:  # a model's (variant's) own excess: it is the kernel
        rec["model_check"] = _model_check(x, nm, kind, refs, bounds)


def _model_check(x: dict, nm, kind: str, refs: tuple, bounds: tuple) -> dict:
    """Evidence for a bound violation (``audits.verdict.gate``): the FA4 model run on the same
    inputs with the numerics the bound analyses (``nm``: the kernel's own FA4 numerics, or the
    generic flash-attention numerics of a peer), checked against the same per-element bounds.
    Within them, the analysis covers that arithmetic and the kernel departs from it; beyond them
    too, the analysis misses a step of the arithmetic it claims to cover (or the model does)."""
    from fa4.model import attention as model_attention  # lazy: fa4.model loads numba (~0.2 s)

    with torch.no_grad():
        mo, ml = model_attention(x["q"], x["k"], x["v"], return_lse=True, numerics=nm, **x["kw"])
    ob, lb = bounds
    got = bound_check(mo, refs[0], ob, ml, refs[1], lb)
    keys = ("violations", "tightness", "lse_violations", "lse_tightness")
    return {"numerics": kind, **{k: got[k] for k in keys}}


def _measure(
    rec: dict, kernel: str, case: Case, x: dict, out, lse, refs: tuple, bounds: tuple, nm: tuple, keep: CaseTensors
) -> None:
    """The measurements of a result against its references ``refs`` (FP64 out and LSE, the
    low-precision result, the certification) and its per-element ``bounds`` (out, LSE) under
    numerics ``nm`` ((kind, FA4Numerics)), into ``rec``; the tensors themselves into ``keep``
    (``audits.verdict.diagnosis``: a failing verdict is localized from them, after ``judge``)."""
    q, k, v = x["q"], x["k"], x["v"]
    ref, rl, low, cert, scale = refs
    keep.kind, keep.numerics, keep.out, keep.lse, keep.ref, keep.ref_lse = nm[0], nm[1], out, lse, ref, rl
    keep.out_bound, keep.lse_bound = bounds
    rec["out"] = output_errors(out, ref)
    if lse is not None:
        rec["lse"] = lse_errors(lse, rl)
    ob, lb = bounds
    rec["bound"] = {"kind": nm[0], **bound_check(out, ref, ob, lse, rl, lb)}
    rec["out_of_domain"] = _domain(q, k, v, case, nm[1])
    # the verdict reads the kind (audits.report.schema.OUT_OF_DOMAIN_KINDS), never the message
    rec["out_of_domain_kind"] = None if rec["out_of_domain"] is None else "float32-range"
    if (
        rec["out_of_domain"] is None
        and not claims_nonfinite_inputs(kernel)
        and not all(bool(torch.isfinite(t.float()).all()) for t in (q, k, v))
    ):
        rec["out_of_domain"] = f"inputs contain NaN/inf and {kernel} claims no semantics for them"
        rec["out_of_domain_kind"] = "nonfinite-inputs"
    rec["fa_criterion"] = fa_floor(out, ref, low, scale=scale)
    rec["bias"] = bias_record(out=out, ref=ref, lse=lse, ref_lse=rl)  # signed bias: a warn even inside the bound
    rec["mpmath_max_abs"] = None if cert is None else cert[0]
    if cert is not None:
        rec["mpmath_scale"] = cert[1]  # the certified row's scale: the gate allows its share of it


def _call(fn: Callable, x: dict) -> tuple[dict, tuple | None]:
    """Call the kernel: ({"status": "ran"}, (out, lse)) or the status and reason of why not.
    Only ``NotImplementedError`` is a refusal (skipped); production's adapter raises it only
    for its documented refusals (``fa4.refusals.REFUSALS``); any other exception is an error."""
    try:
        res = fn(x["q"], x["k"], x["v"], return_lse=True, **x["kw"])
    except WorkerCrashed as exc:  # its worker died (audits.engine.worker): the reason says how
        return {"status": "crash", "reason": str(exc)}, None
    except KernelTimeout as exc:  # past --timeout: its worker was killed
        return {"status": "timeout", "reason": str(exc)}, None
    except NotImplementedError as exc:
        return {"status": "skipped", "reason": f"kernel does not support this configuration: {exc}"}, None
    except Exception as exc:  # any other exception is the case's verdict, never a pass
        cause, why = failure_reason(exc)  # out-of-memory said as such
        return {"status": "error", "reason": why, "cause": cause, "traceback": traceback_of(exc)}, None
    return {"status": "ran"}, (res if isinstance(res, tuple) else (res, None))


def _timed_call(fn: Callable, x: dict, rec: dict, twice: bool) -> tuple[dict, tuple | None]:
    """:func:`_call`, its wall time into ``rec["call_seconds"]`` (a list); with ``twice``, a second
    call on the same inputs after it, its time appended, ``rec["second_call_identical"]``
    whether its out and LSE have the first call's bits and ``rec["second_call_differing"]`` how
    many elements do not (a forward that differs from itself makes a comparison's forward
    differences run to run: ``audits.engine.compare.label_run_to_run``).  The first call's excess over the second is
    compilation and first use (a CuTe-DSL or Triton kernel compiles on its first call per compile
    key); the calls return their results on the CPU, so the time includes the copy back."""
    t0 = time.perf_counter()
    status, res = _call(fn, x)
    rec["call_seconds"] = [time.perf_counter() - t0]
    if twice and res is not None:
        t0 = time.perf_counter()
        _, again = _call(fn, x)
        rec["call_seconds"].append(time.perf_counter() - t0)
        if again is None:
            rec["second_call_identical"] = False
        else:  # how many out and LSE elements moved: the forward's own run-to-run count
            rec["second_call_differing"] = sum(_differing(a, b) for a, b in zip(res, again, strict=True))
            rec["second_call_identical"] = rec["second_call_differing"] == 0
    return status, res


def _differing(a, b) -> int:
    """Elements of two results (a tensor or None) whose bits differ; all of them, and at least one,
    where the shape or dtype changed (or one is None)."""
    if a is None or b is None:
        return 0 if a is None and b is None else max((a if a is not None else b).numel(), 1)
    if a.shape != b.shape or a.dtype != b.dtype:
        return max(a.numel(), b.numel(), 1)
    return int((bit_view(a.detach().cpu()) != bit_view(b.detach().cpu())).sum())


def _analyse_or_oom(rec: dict, kernel: str, case: Case, x: dict, out, lse, device, keep: CaseTensors) -> None:
    """:func:`_analyse` (:func:`_analyse_varlen` for a varlen case); an OOM in the audit's own
    FP64 work (not the kernel's) frees the caches and retries once, then becomes the case's error."""
    analyse = _analyse_varlen if case.varlen else _analyse
    try:
        analyse(rec, kernel, case, x, out, lse, device, keep)
    except torch.OutOfMemoryError:
        for cached in (_reference, _bound, _varlen_reference, _varlen_bound):
            cached.cache_clear()
        torch.cuda.empty_cache()
        try:
            analyse(rec, kernel, case, x, out, lse, device, keep)
        except torch.OutOfMemoryError as exc:
            why = str(exc).splitlines()[0]
            rec.update(status="error", reason=f"the audit's FP64 reference or bound ran out of GPU memory: {why}")
            rec["audit_error"] = True  # the audit's failure, not the kernel's: --resume redoes it


# ---- varlen cases (docs/varlen.md) ---------------------------------------------------------

#: the fixed-length call's keywords among a varlen call's (the others place the sequences)
_FORWARD_KEYS = ("softmax_scale", "causal", "window_size", "softcap", "learnable_sink")
#: a varlen case's backward half under ``run --backward``
_VARLEN_BACKWARD = {
    "status": "skipped",
    "reason": "varlen cases audit the forward pass only (no backward through the varlen entry, docs/varlen.md)",
}


def _sequence(x: dict, i: int) -> tuple:
    """Sequence ``i`` of varlen inputs ``x`` as the fixed-length call it computes: (q, k, v, its
    keywords), batch 1, its used keys only, the forward keywords only, and the mods as sequence
    ``i`` sees them (``fa4.varlen.sequence_mods``: batch index i, positions within the sequence).
    A sequence with queries and no key gets one zero key that no row sees (the window's right
    edge at -1, intersected with a mask_mod's keys by the reference and the bound): the FP64
    reference, the low-precision result and the bound then give FA's convention for rows with no
    visible key (out 0; LSE -inf, or the sink) from their own code, which needs a key."""
    q, k, v = x["parts"][i]
    kw = {n: x["kw"][n] for n in _FORWARD_KEYS if n in x["kw"]}
    mods = {
        n: x["kw"][n]
        for n in ("score_mod", "mask_mod", "aux_tensors", "aux_scalars", "block_sparse_tensors")
        if x["kw"].get(n) is not None
    }
    if mods:  # the sequence's mods as the varlen entry hands them: batch_idx = i (fa4.varlen.sequence_mods)
        from fa4.varlen import sequence_mods  # lazy: numba

        kw.update(sequence_mods(i, **mods))
    if k.shape[1] == 0:
        k, v = k.new_zeros(1, 1, *k.shape[2:]), v.new_zeros(1, 1, *v.shape[2:])
        kw["window_size"] = (tuple(kw.get("window_size", (None, None)))[0], -1)
    return q, k, v, kw


def _used_k(case: Case, i: int) -> int:
    return case.seqused_k[i] if case.seqused_k else case.seqlens[i][1]


@functools.lru_cache(maxsize=4)
def _varlen_reference(case: Case, device: str) -> tuple:
    """:func:`_reference` of a varlen case: per sequence (:func:`_sequence`) the FP64 reference,
    its LSE, the low-precision result and the output's scale, concatenated along the tokens into
    batch-1 tensors (1, total_q, hq, dv) and (1, hq, total_q), as the kernel packs them; the certification of
    the last row of the last sequence with queries and keys (None without one)."""
    x = make_varlen_inputs(case, device=device)
    refs, rls, lows, scales, cert = [], [], [], [], None
    for i, (sq, _) in enumerate(case.seqlens):
        if sq == 0:
            continue
        q, k, v, kw = _sequence(x, i)
        call = AttentionCall.from_kwargs(**kw)
        ref, rl, scale = attention_reference(q, k, v, call=call, return_lse=True, return_scale=True)
        refs.append(ref)
        rls.append(rl)
        lows.append(attention_lowprec(q, k, v, call=call))
        scales.append(scale)
        if _used_k(case, i):
            cert = ({"q": q, "k": k, "v": v, "kw": kw}, ref, rl, (0, case.heads_q - 1, sq - 1), scale)
    cert = None if cert is None else _certify(*cert)  # the last sequence with queries and keys
    if not refs:  # no sequence has a query: nothing to compare, empty tensors of the right shapes
        q = x["q"]
        refs = [torch.zeros(1, 0, case.heads_q, case.dv, dtype=torch.float64, device=q.device)]
        rls = [torch.zeros(1, case.heads_q, 0, dtype=torch.float64, device=q.device)]
        lows = [refs[0].to(torch.bfloat16 if q.dtype.itemsize == 1 else q.dtype)]
        scales = [refs[0]]
    return torch.cat(refs, 1), torch.cat(rls, 2), torch.cat(lows, 1), cert, torch.cat(scales, 1)


def _split_keywords(case: Case, splits: int) -> dict:
    """``forward_error_bound``'s split-KV keywords for a sequence of ``case`` run in ``splits``
    splits: num_splits, and pack_gqa as the kernel runs it (the case's, else the default, on for
    GQA); none for an unsplit sequence."""
    if splits == 1:
        return {}
    from fa4.varlen import packs_gqa  # lazy: numba

    return {"num_splits": splits, "pack_gqa": packs_gqa(case.pack_gqa, case.heads_q, case.heads_kv)}


@functools.lru_cache(maxsize=4)
def _varlen_bound(case: Case, device: str, nms: tuple, splits: tuple, kind: str = "fa4") -> tuple:
    """:func:`_bound` of a varlen case: per sequence with queries, the bound of its fixed-length
    call under its numerics ``nms[i]``, in ``splits[i]`` splits (:func:`_split_keywords`),
    packed as :func:`_varlen_reference`."""
    x = make_varlen_inputs(case, device=device)
    ref, rl = _varlen_reference(case, device)[:2]
    obs, lbs, row = [ref[:, :0]], [rl[:, :, :0]], 0
    for i, (sq, _) in enumerate(case.seqlens):
        if sq == 0:
            continue
        q, k, v, kw = _sequence(x, i)
        seq_ref = (ref[:, row : row + sq], rl[:, :, row : row + sq])
        extra = _split_keywords(case, splits[i]) | _score_products(kind)
        ob, lb = forward_error_bound(q, k, v, nms[i], call=AttentionCall.from_kwargs(**kw), reference=seq_ref, **extra)
        obs.append(ob)
        lbs.append(lb)
        row += sq
    return torch.cat(obs, 1), torch.cat(lbs, 2)


def _varlen_numerics(kernel: str, case: Case, x: dict) -> tuple[str, tuple, tuple]:
    """(the bound's kind, per sequence the numerics it holds the kernel to, per sequence its
    split count): an FA4 kernel's own for each sequence of its varlen entry
    (``audits.kernels.fa4_varlen_numerics``, ``fa4_varlen_splits``: SM100 splits each sequence
    its own way), or generic flash-attention numerics (:func:`_peer_numerics`) with the case's
    ``num_splits`` for every sequence."""
    nmf, spf = fa4_varlen_numerics(kernel), fa4_varlen_splits(kernel)
    if nmf is None:
        return "peer", tuple(_peer_numerics(x["q"]) for _ in case.seqlens), (case.num_splits,) * len(case.seqlens)
    kw = {
        "num_splits": case.num_splits,
        "page_size": case.page_size,
        "pack_gqa": case.pack_gqa,
        "max_seqlen_q": x["kw"]["max_seqlen_q"],
    }
    if case.block_sparse:  # the tiles production fits to the sparse block (fa4.varlen.sequence_numerics)
        kw["block_sparse"] = tuple(case.block_sparse)
    nms = []
    # with a mask_mod the entry drops causal and the window (interface._resolve_causal_local_window)
    causal, window = (False, (None, None)) if case.mask_mod else (case.causal, tuple(case.window))
    for i in range(len(case.seqlens)):
        q, k, v, _ = _sequence(x, i)
        nms.append(nmf(q, k, v, causal, window, **kw))
    return "fa4", tuple(nms), tuple(spf(x["q"], x["k"], x["kw"]))


def _analyse_varlen(
    rec: dict, kernel: str, case: Case, x: dict, out, lse, device: torch.device, keep: CaseTensors
) -> None:
    """:func:`_analyse` of a varlen result (out (total_q, hq, dv), lse (hq, total_q)): measured
    as one batch-1 result against the sequences' packed references and bounds; the record's
    ``varlen`` names the sequence of the largest output error."""
    kind, nms, splits = _varlen_numerics(kernel, case, x)
    refs, bounds = _varlen_reference(case, str(device)), _varlen_bound(case, str(device), nms, splits, kind)
    lse1 = None if lse is None else lse.unsqueeze(0)
    _measure(rec, kernel, case, x, out.unsqueeze(0), lse1, refs, bounds, (kind, nms[0]), keep)
    cu = x["kw"]["cu_seqlens_q"].tolist()
    if cu[-1]:
        rec["varlen"]["worst_sequence"] = bisect.bisect_right(cu, rec["out"]["argmax"][1]) - 1
    if case.num_splits > 1:
        rec["varlen"]["splits"] = list(splits)  # per sequence, as the kernel's entry splits it


def _varlen_record(case: Case, per_seq: bool) -> dict:
    """The record's ``varlen``: sequence count, tokens (queries, keys used), the run's
    ``--per-sequence``; the entry that ran is added once known."""
    used = sum(_used_k(case, i) for i in range(len(case.seqlens)))
    return {
        "sequences": len(case.seqlens),
        "total_q": sum(a for a, _ in case.seqlens),
        "total_k": used,
        "per_sequence": per_seq,
    }


def _no_varlen_entry(kernel: str) -> str:
    return (
        f"{kernel} is a fixed-length kernel with no varlen entry (a kernel declares the varlen contract with "
        "fn.fa4_audit_contract = 'varlen', docs/varlen.md); run with --per-sequence to audit it on varlen cases, "
        "one fixed-length call per sequence"
    )


def _backward(
    kernel: str, calls: KernelCalls, case: Case, x: dict, device: torch.device, opts: BackwardOptions, keep: CaseTensors
) -> dict:
    """The case's backward half (``audits.engine.backward``): a seeded dO, the kernel's
    gradients, their measurements (the tensors into ``keep``); an OOM in the audit's own FP64
    work is the case's error."""
    do, fam = make_grad_output(case, device=device)
    keep.grad_output = do  # the backward's poisoned re-runs use the same dO
    status, res = calls.grad(x, do, opts)
    b = {**status, "do_family": fam, "repeat": opts.repeat, "deterministic": opts.deterministic}
    if res is None:
        return b
    q = x["q"]
    nm = _fa4_numerics(kernel, x, case)
    nm = (nm, "fa4") if nm is not None else (_peer_numerics(q), "peer")
    try:
        b.update(analyse_backward(nm, x, do, res, case, keep=keep))
    except torch.OutOfMemoryError as exc:
        case_references.cache_clear()
        torch.cuda.empty_cache()
        b.update(status="error", reason=f"the audit's FP64 gradients ran out of GPU memory: {str(exc).splitlines()[0]}")
        b["audit_error"] = True
    return b


def evaluate_case(
    kernel: str,
    fn: Callable | KernelCalls,
    case: Case,
    device: torch.device,
    thresholds: dict,
    backward: BackwardOptions | None = None,
    domain=None,
    per_sequence: bool = False,
    *,
    error_map: dict | None = None,
    tensors: dict | None = None,
    poison: bool = False,
    time_calls: bool = False,
) -> dict:
    """Measurements and verdict of one case (a JSON-able dict); with ``backward``, its gradients
    too (``rec["backward"]``).  ``fn``: the kernel (``audits.engine.worker.KernelCalls``, or a plain
    callable called in this process).  A failing case gets ``rec["diagnosis"]``, where its violations
    lie (``audits.verdict.diagnosis``, from the tensors kept until the verdict); its error-map
    data goes into ``error_map["map"]`` when given (``ErrorMap``: the caller writes the file), and
    the kernel's results with their references (``CaseTensors``) into ``tensors["keep"]`` when
    given (``fa4-audit compare`` holds them against another kernel's).  A failing (or biased)
    case's tested causes go into ``rec["diagnosis"]["causes"]`` (:func:`_causes`; with
    ``poison``, re-runs of the kernel with poisoned fresh memory among them).  ``rec["call_seconds"]``:
    the kernel call's wall time, and with ``time_calls`` a second call's after it (``_timed_call``).
    ``domain`` (``audits.suites.domain.Domain``, the kernel's declared one): a case outside it is
    ``skipped`` with the reason, decided before the kernel is called.  A varlen case runs through
    the kernel's varlen entry, else with ``per_sequence`` through ``fn`` once per sequence, else
    is ``skipped`` (the reason names ``--per-sequence``)."""
    rec = {"case": case.name, "config": case.as_dict(), "family": case.family, "seed": case.seed}
    t0 = time.perf_counter()
    calls = fn = as_calls(kernel, fn)
    if case.varlen:
        rec["varlen"] = _varlen_record(case, per_sequence)
    why = domain.refusal(case) if domain is not None else None
    if why is not None:  # never called: the kernel said up front it does not support this
        return _skipped(rec, f"outside the kernel's declared domain: {why}", t0)
    if case.varlen:
        fn, rec["varlen"]["entry"] = calls.varlen_entry(per_sequence)
        if fn is None:
            return _skipped(rec, _no_varlen_entry(kernel), t0)
    try:
        x = make_varlen_inputs(case, device=device) if case.varlen else make_inputs(case, device=device)
    except NotApplicable as exc:  # a family's precondition: this case is reported, the run goes on
        return _skipped(rec, f"input family not applicable here: {exc}", t0)
    status, res = _timed_call(fn, x, rec, time_calls)
    rec.update(status)
    keep = CaseTensors(case, inputs=x)
    if res is not None:
        out, lse = res
        rec["lse_returned"] = lse is not None  # judged by [policy] lse_missing: never silently unchecked
        if case.varlen:
            bad = varlen_contract_breaches(q=x["q"], v=x["v"], out=out, lse=lse, packed=True)
        else:
            bad = contract_breaches(q=x["q"], v=x["v"], out=out, lse=lse)
        if bad:  # each tensor named, with its fault (audits.report.records.ContractRecord)
            rec.update(status="error", reason="; ".join(b.reason for b in bad))
            rec["contract"] = [b.as_record() for b in bad]
        else:
            _analyse_or_oom(rec, kernel, case, x, out, lse, device, keep)
    if backward is not None and rec["status"] == "ran":
        if case.varlen:
            rec["backward"] = dict(_VARLEN_BACKWARD)
        else:
            rec["backward"] = _backward(kernel, calls, case, x, device, backward, keep)
        if rec["backward"].get("audit_error"):
            rec["audit_error"] = True
    rec["verdict"], rec["reasons"] = judge(rec, thresholds)
    runs = _poison_runs(
        keep, fn if poison and res is not None else None,
        (calls, backward) if poison and backward is not None and keep.grads else None, device,
    )  # fmt: skip
    checked = _judged_written(rec, thresholds, keep, runs)
    if rec["verdict"] in FAILING:
        rec["diagnosis"], emap = _diagnose(rec, thresholds, keep)
        if emap is not None and error_map is not None:
            error_map["map"] = emap
    _record_causes(rec, thresholds, keep, runs, checked)
    if tensors is not None:
        tensors["keep"] = keep
    rec["seconds"] = time.perf_counter() - t0
    return rec


def _memory_like(pairs) -> int:
    """How many elements of a case's results the checks accepted on values fresh memory could have
    supplied, over ``pairs`` of (the kernel's tensor, its FP64 reference; either may be None):
    where the kernel returned NaN, an infinity or 0 (what fresh memory holds as readily as a kernel
    computes it: a freed tensor's NaN, pages the operating system hands out zeroed), or where the
    reference is NaN or infinite (the semantics check compares non-finite classes only there).
    Anywhere else an element the kernel never wrote would have to hold memory within the bound of
    the exact value to pass, which the poisoned runs of a failing case already catch."""
    n = 0
    for got, ref in pairs:
        if got is None:
            continue
        g = got.float()  # fp8 has no isfinite or comparisons
        like = ~torch.isfinite(g) | (g == 0)
        if ref is not None and ref.shape == got.shape:
            like |= ~torch.isfinite(ref).to(like.device)
        n += int(like.sum())
    return n


def _written(n: int, run) -> tuple[dict, tuple[list[Cause], dict]]:
    """The ``written`` record of poisoned runs made because ``n`` accepted values were memory-like,
    ``run(trace)`` running them (``audits.engine.poison``): ``memory_like`` (``n``), ``unwritten``
    and ``read`` (elements that took both fills, or changed with them), their places
    (``unwritten_where``, ``read_where``), or ``note`` when every poisoned run failed (nothing
    checked; the verdict stands).  With it, the causes and the trace, which the case's causes reuse."""
    trace: dict = {}
    found = run(trace)
    written = {"memory_like": n, **trace.get("counts", {"unwritten": 0, "read": 0})}
    if "counts" not in trace:
        written["note"] = trace.get("summary", "no poisoned run ran")
    for c in found:
        written["unwritten_where" if c.cause == "unwritten_output" else "read_where"] = c.detail
    return written, (found, trace)


def _poison_runs(keep: CaseTensors, poison_call, grad_poison: tuple | None, device) -> dict:
    """A case's poisoned re-runs (``audits.engine.poison``), per half, each ``run(trace) -> causes``:
    ``"forward"`` with ``poison_call`` (``--poison``, the call the case ran through), ``"backward"``
    with ``grad_poison`` (its ``KernelCalls`` and ``BackwardOptions``, where its gradients were
    measured: the same dO as the case's backward)."""
    runs = {}
    if poison_call is not None:
        runs["forward"] = lambda trace: poison_causes(
            call=poison_call, x=keep.inputs, out=keep.out, lse=keep.lse, device=device, trace=trace
        )
    if grad_poison is not None:
        calls, opts = grad_poison
        runs["backward"] = lambda trace: grad_poison_causes(
            calls=calls, x=keep.inputs, do=keep.grad_output, opts=opts, grads=keep.grads, device=device, trace=trace
        )
    return runs


def _judged_written(rec: dict, thresholds: dict, keep: CaseTensors, runs: dict) -> dict:
    """The poisoned runs (``runs``, :func:`_poison_runs`) of a case the checks accepted (a pass or a
    warn), of each half whose results hold values fresh memory could have supplied
    (:func:`_memory_like`): a kernel that never writes rows whose reference is NaN, inf or 0 passes
    on memory that happened to hold them (Triton's tutorial's unwritten batch passed on the H200 and
    in Triton's interpreter, 2026-12-04, where it held NaN and the reference was NaN); a backward
    that never writes the dq of rows that see no key, or the dk, dv of keys no query sees, passes
    where memory held 0.  ``rec["written"]`` (the forward's out and LSE) and
    ``rec["backward"]["written"]`` (dq, dk, dv: :func:`_written`), and the case judged again with
    them (the gate's ``unwritten``, ``memory-read``).  Returns what ran, per half
    ({"forward"|"backward": (causes, trace)}), for the case's causes to reuse."""
    checked: dict = {}
    if rec["verdict"] in FAILING or rec["status"] != "ran":
        return checked
    grads = {g: keep.grads.get(g) for g in ("dq", "dk", "dv")} if keep.grads else {}
    pairs = {
        "forward": ((keep.out, keep.ref), (keep.lse, keep.ref_lse)),
        "backward": [(t, (keep.grad_refs or {}).get(g)) for g, t in grads.items()],
    }
    for half, run in runs.items():
        if n := _memory_like(pairs[half]):
            where = rec if half == "forward" else rec["backward"]
            where["written"], checked[half] = _written(n, run)
    if checked:
        rec["verdict"], rec["reasons"] = judge(rec, thresholds)
    return checked


def _record_causes(rec: dict, thresholds: dict, keep: CaseTensors, runs: dict, checked: dict) -> None:
    """:func:`_causes` into the record's diagnosis: ``causes``, ``poisoned`` (what the poisoned
    re-runs showed when no cause came of them) and ``causes_error`` (why the analysis broke; the
    verdict stands).  ``checked``: the poisoned runs :func:`_judged_written` already ran, reused."""
    causes, broke, poisoned = _causes(rec, thresholds, keep, runs, checked)
    if causes:
        rec.setdefault("diagnosis", {})["causes"] = [c.as_dict() for c in causes]
    if poisoned:
        rec.setdefault("diagnosis", {})["poisoned"] = poisoned
    if broke:
        rec.setdefault("diagnosis", {})["causes_error"] = broke


def _causes(
    rec: dict, thresholds: dict, keep: CaseTensors, runs: dict, checked: dict
) -> tuple[list[Cause], str | None, dict[str, str]]:
    """The tested causes of a judged case (``audits.verdict.causes``), best first, why their
    analysis broke (None when it did not), and what the poisoned re-runs showed where no cause
    came of them ({"forward"|"backward": sentence}): of a failing case, the hypotheses tested on
    its data and its poisoned re-runs (``runs``, :func:`_poison_runs`; those :func:`_judged_written`
    made, ``checked``, reused); of a case inside its bound, its rounding bias
    (``audits.verdict.bias``).  An exception in an analysis is recorded, never the case's verdict."""
    found, broke, poisoned = [], None, {}
    try:
        if rec["verdict"] in FAILING and rec.get("status") == "ran" and keep.out is not None:
            analyses = (
                ("data hypotheses", lambda: data_causes(case=keep.case, tensors=keep, rec=rec, th=thresholds)),
                ("gradient hypotheses", lambda: grad_causes(tensors=keep, rec=rec)),  # where the backward ran
            )
            for what, analysis in analyses:  # one breaking does not keep the other from running
                try:
                    found += analysis()
                except Exception as exc:  # noqa: BLE001 - recorded beside the verdict, which stands
                    why = f"{what}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                    broke = why if broke is None else f"{broke}; {why}"
            for half, run in runs.items():  # the runs _judged_written made (and that failed the case), reused
                if half in checked:
                    got, trace = checked[half]
                else:
                    trace = {}
                    got = run(trace)
                found += got
                if "summary" in trace:
                    poisoned[half] = trace["summary"]
        # a bias is a finding inside the bound (a warn); past it, the error is beyond rounding and
        # its lean says nothing of rounding (2% of outputs moved by +1 lean high too)
        if rec["verdict"] not in FAILING and (bias := bias_cause(rec, th=thresholds)) is not None:
            found.append(bias)
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        broke = "out of GPU memory"
    return rank_causes(found), broke, poisoned


def _diagnose(rec: dict, thresholds: dict, keep: CaseTensors) -> tuple:
    """``audits.verdict.diagnosis.diagnose``; an OOM in it (full-size masks beside the FP64
    references) frees the caches and leaves the case undiagnosed ({}), its verdict unchanged."""
    try:
        return diagnose(rec=rec, th=thresholds, tensors=keep)
    except torch.OutOfMemoryError:
        for cached in (_reference, _bound, _varlen_reference, _varlen_bound, case_references):
            cached.cache_clear()
        torch.cuda.empty_cache()
        return {}, None


def _skipped(rec: dict, reason: str, t0: float) -> dict:
    """``rec`` as a case skipped for ``reason``, the kernel not called."""
    rec.update(status="skipped", reason=reason, verdict="skipped")
    rec["reasons"], rec["seconds"] = [reason], time.perf_counter() - t0
    return rec
