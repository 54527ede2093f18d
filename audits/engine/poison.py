"""Poisoned runs: does a result depend on memory the kernel never wrote? (docs/diagnosis.md,
"Poisoned runs"; causes ``unwritten_output`` and ``uninitialized_read``, ``audits.verdict.causes``).

A failing case's kernel call is re-run three times on the same inputs and each result compared
with the normal one bit for bit:

* ``control``: nothing poisoned, to tell run-to-run differences (atomics, a kernel that reads
  garbage that happens to differ) from what the fills cause;
* ``nan``: ``torch.use_deterministic_algorithms(True, warn_only=True)`` with
  ``torch.utils.deterministic.fill_uninitialized_memory = True``: torch then fills every fresh
  float allocation (``torch.empty``, ``empty_like``, ``empty_strided``, ``new_empty``, ``resize_``;
  in C++ too, on CPU and CUDA, so an extension's ``at::empty`` is reached) with NaN (integers with
  their maximum).  Both settings (and the warn-only flag) are restored in ``finally``;
* ``pattern``: fresh memory filled with the byte :data:`POISON_BYTE` repeated, a finite value in
  every float dtype (:data:`PATTERN_VALUES`).  A ``TorchDispatchMode`` fills each float tensor
  that ``aten.empty*`` / ``new_empty*`` returns, on CPU and CUDA: it reaches the allocations a
  kernel makes through torch's dispatcher from Python (production's and Triton's wrappers
  allocate their outputs so), not those a C++ extension or custom op makes inside its own
  implementation.  On CUDA the caching allocator is pre-filled as well, for those: its unused
  cached blocks released (``torch.cuda.empty_cache``), then large and small blocks allocated,
  filled and freed, so that the kernel's next allocations on the current stream are carved from
  them (an allocation larger than what was pre-filled, on another stream, or of a block the call
  itself freed before, holds something else).  On CPU there is no allocator cache to pre-fill
  (glibc returns large blocks to the system and hands fresh pages out zeroed); what the mode
  cannot reach there gets NaN only, from the ``nan`` run.

A fourth run, under a second pattern (:data:`SECOND_PATTERN`), is made only where the pattern
run reproduced the normal run on elements the NaN run made NaN (:func:`_classify`); the evidence
names it when it ran.

An element that took the fill in both poisoned runs (NaN, and the pattern's value) was never
written: ``unwritten_output``.  An element that changed in a poisoned run but not to the fill
(NaN where the normal run was finite, or a pattern-run value differing from a stable normal one)
mixed a never-written value into its arithmetic: ``uninitialized_read``.  Where the pattern did
not reach (an extension's own allocation on CPU), a NaN of the ``nan`` run alone cannot tell the
two apart: whole rows count as unwritten, scattered elements as read, and the evidence says so.

For a kernel in a worker (``audits.engine.worker.Isolated``) the poisoning must happen in the
worker's process: the fill travels with the call as the keyword :data:`POISON_KW`, which the
worker's ``serve`` removes and applies with :func:`poisoned` around the kernel call.  Callables
that run elsewhere say so with a true attribute ``poisons_in_worker``; any other callable is
poisoned here, in this process.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch.utils import deterministic as _deterministic
from torch.utils._python_dispatch import TorchDispatchMode

from audits.verdict.nonfinite import runs
from audits.verdict.vocabulary import Cause

__all__ = ["POISON_KW", "POISON_BYTE", "PATTERN_VALUES", "FILLS", "poisoned", "poison_causes", "grad_poison_causes"]

#: the call keyword that carries a fill to the process that runs the kernel (the worker's ``serve``)
POISON_KW = "fa4_audit_poison"
#: the fills of the poisoned runs, in the order they run
FILLS = ("nan", "pattern")
#: a fill run only where the first two leave it ambiguous whether the pattern reached an element
#: (:func:`_classify`): the same fill with :data:`SECOND_BYTE`
SECOND_PATTERN = "pattern2"
#: the byte the ``pattern`` run fills fresh memory with: 0x4646 is 6.27 as float16 and 12672 as
#: bfloat16, 0x46464646 is 12689.57 as float32 (its bfloat16 rounding is 0x4646 again): finite and
#: recognisable in every float dtype
POISON_BYTE = 0x46
#: the second pattern's byte: 0x4747 is 7.28 as float16 and 50944 as bfloat16, 0x47474747 is
#: 51015.28 as float32; finite, and unlike the first in every dtype
SECOND_BYTE = 0x47
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _values_of(byte: int) -> dict:
    return {dt: float(torch.full((8,), byte, dtype=torch.uint8).view(dt)[0]) for dt in _FLOATS}


#: the pattern read as each float dtype
PATTERN_VALUES = _values_of(POISON_BYTE)
#: the second pattern read as each float dtype
SECOND_VALUES = _values_of(SECOND_BYTE)
#: each pattern fill's byte
_BYTES = {"pattern": POISON_BYTE, SECOND_PATTERN: SECOND_BYTE}
#: how many bytes of the CUDA caching allocator's large pool are pre-filled, at least
_CUDA_PREFILL_LARGE = 256 << 20
#: small-pool blocks (requests of at most 1 MiB are carved from 2 MiB segments) pre-filled
_CUDA_PREFILL_SMALL = 64

_aten = torch.ops.aten
_EMPTIES = (_aten.empty, _aten.empty_like, _aten.empty_strided, _aten.empty_permuted, _aten.new_empty)
_EMPTIES += (_aten.new_empty_strided,)


def _fill_storage(t: torch.Tensor, byte: int = POISON_BYTE) -> None:
    """Every byte of ``t``'s storage set to ``byte`` (a fresh tensor owns all of it)."""
    raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
    raw.fill_(byte)


class _FillEmpty(TorchDispatchMode):
    """Float tensors returned by torch's uninitialized-allocation ops filled with a pattern byte."""

    def __init__(self, byte: int = POISON_BYTE):
        super().__init__()
        self.byte = byte

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in _EMPTIES and isinstance(out, torch.Tensor):
            if (out.is_floating_point() or out.is_complex()) and out.device.type in ("cpu", "cuda"):
                _fill_storage(out, self.byte)
        return out


def _prefill_cuda(device: torch.device, byte: int = POISON_BYTE) -> None:
    """The caching allocator's free blocks on ``device``'s current stream, pattern-filled."""
    with torch.cuda.device(device):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # unused cached blocks released: the free blocks are all ours
        free = torch.cuda.mem_get_info()[0]
        large = min(_CUDA_PREFILL_LARGE, free // 4)
        blocks = [torch.empty(large // 4, dtype=torch.uint8, device=device) for _ in range(4)]
        blocks += [torch.empty(1 << 20, dtype=torch.uint8, device=device) for _ in range(_CUDA_PREFILL_SMALL)]
        for b in blocks:
            b.fill_(byte)
        torch.cuda.synchronize()
        del blocks  # back to the allocator's cache, not to the device: the next allocations reuse them


@contextmanager
def poisoned(fill: str | None, *, device: torch.device | str) -> Iterator[None]:
    """Fresh memory poisoned with ``fill`` ("nan", "pattern"; None: nothing) while the block runs,
    on ``device``; torch's global settings restored after, whatever happens."""
    if fill is None:
        yield
        return
    if fill not in (*FILLS, SECOND_PATTERN):
        raise ValueError(f"poison fill {fill!r}: expected one of {', '.join((*FILLS, SECOND_PATTERN))}")
    try:
        yield from _poisoned(fill, torch.device(device))
    finally:
        _forget_compiled()


def _forget_compiled() -> None:
    """Drop what torch.compile traced during a poisoned run: a graph traced under the fill's
    settings (a dispatch mode, deterministic mode) and its failures stay in Dynamo's caches and
    broke the kernel's next normal call (eager flex_attention on the CPU, which traces through
    Dynamo, raised ``Unsupported`` on every later case, 2026-12-04)."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        dynamo.reset()


def _poisoned(fill: str, dev: torch.device) -> Iterator[None]:
    """:func:`poisoned`'s body for a fill."""
    if fill == "nan":
        was = (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
            _deterministic.fill_uninitialized_memory,
        )
        try:
            _deterministic.fill_uninitialized_memory = True
            torch.use_deterministic_algorithms(True, warn_only=True)
            with warnings.catch_warnings():  # warn_only's "no deterministic implementation" warnings
                warnings.simplefilter("ignore")
                yield
        finally:
            torch.use_deterministic_algorithms(was[0], warn_only=was[1])
            _deterministic.fill_uninitialized_memory = was[2]
        return
    if dev.type == "cuda":
        # both: the pre-fill alone missed a block the call itself freed and took again (on the H200,
        # 2026-12-04, an output from torch.empty_like after the model's own arithmetic held its
        # intermediates, not the pattern, and tests/test_poison.py's unwritten rows read as
        # uninitialized_read); the dispatch mode alone misses an extension's own at::empty
        _prefill_cuda(dev, _BYTES[fill])
    with _FillEmpty(_BYTES[fill]):
        yield


# ---- comparing the runs ----------------------------------------------------------------------

_INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _same(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: the same bits."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return torch.zeros(a.shape, dtype=torch.bool, device=a.device)
    if a.dtype.is_floating_point and a.dtype.itemsize in _INTS:
        return a.contiguous().view(_INTS[a.dtype.itemsize]) == b.contiguous().view(_INTS[b.dtype.itemsize])
    return a == b


def _is_pattern(t: torch.Tensor, pattern: dict = PATTERN_VALUES) -> torch.Tensor:
    """Elementwise: ``t`` holds the pattern (``pattern``: its values per dtype), as its own dtype or
    another float dtype's cast to it."""
    if not t.dtype.is_floating_point:
        return torch.zeros(t.shape, dtype=torch.bool, device=t.device)
    values = torch.tensor([pattern[dt] for dt in _FLOATS], dtype=torch.float64)
    values = torch.unique(values.to(t.dtype).double()).to(t.device)
    return torch.isin(t.double(), values)


def _rows_of(name: str, t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as (batch, row, head, column): out (b, s, h, d), lse (b, h, s); a varlen
    packed out (tokens, h, d) or lse (h, tokens) as one batch of tokens."""
    if name == "lse":
        t = t.unsqueeze(0) if t.dim() == 2 else t
        return t.transpose(1, 2).unsqueeze(-1)
    return t.unsqueeze(0) if t.dim() == 3 else t


def _where(name: str, mask: torch.Tensor) -> tuple[str, int]:
    """Where ``mask`` (over tensor ``name``) lies, in rows: "out rows 199 of every batch (2), every
    head"; and how many of its elements lie in whole rows (every column of a (batch, row, head))."""
    m = _rows_of(name, mask)
    whole = m.all(dim=-1)  # (b, s, h)
    in_rows = int(whole.sum()) * m.shape[-1]
    if not bool(whole.any()):
        return f"{name}: {int(mask.sum()):,} scattered elements, no whole row", 0
    heads = whole.any(dim=(0, 1)).nonzero().flatten().tolist()
    every_head = whole.all(dim=2) == whole.any(dim=2)
    head_text = "every head" if len(heads) == m.shape[2] and bool(every_head.all()) else f"heads {runs(heads)}"
    per_batch = [whole[b].any(dim=-1).nonzero().flatten().tolist() for b in range(m.shape[0])]
    batches = [b for b, r in enumerate(per_batch) if r]
    s = m.shape[1]
    if len(batches) == m.shape[0] and all(r == per_batch[0] for r in per_batch) and len(per_batch[0]) < s:
        where = f"rows {runs(per_batch[0])} of every batch ({m.shape[0]})"
    else:
        said = {b: "every row" if len(per_batch[b]) == s else f"rows {runs(per_batch[b])}" for b in batches}
        parts = [f"batch {b}: {rows}" for b, rows in said.items()]
        where = "; ".join(parts[:4]) + (f"; and {len(parts) - 4} more batches" if len(parts) > 4 else "")
    if mask.dim() == (2 if name == "lse" else 3):  # varlen: packed tokens, one "batch"
        where = where.replace("batch 0: ", "").replace("rows", "tokens").replace(" of every batch (1)", "")
    if name in ("dk", "dv"):  # a key gradient's rows are keys
        where = where.replace("rows", "keys")
    rest = int(mask.sum()) - in_rows
    extra = f", and {rest:,} elements in partial rows" if rest else ""
    return f"{name} {where}, {head_text}{extra}", in_rows


def _results(res) -> dict[str, torch.Tensor]:
    """A kernel call's result as {"out": ..., "lse": ...} (no lse when it returned none)."""
    out, lse = res if isinstance(res, tuple) else (res, None)
    got = {"out": out}
    if lse is not None:
        got["lse"] = lse
    return got


def _run(call: Callable, x: dict, fill: str | None, device) -> tuple[dict | None, str | None]:
    """One run of ``call`` on ``x`` under ``fill``: (its results, None) or (None, why it failed)."""
    kw = dict(x["kw"])
    remote = bool(getattr(call, "poisons_in_worker", False))
    if remote and fill is not None:
        kw[POISON_KW] = fill
    try:
        with torch.no_grad(), poisoned(None if remote else fill, device=device):
            res = call(x["q"], x["k"], x["v"], return_lse=True, **kw)
        return {n: t.detach() for n, t in _results(res).items()}, None
    except Exception as exc:  # the case's own call succeeded: a poisoned run's failure is evidence, not a crash
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _plural(n: int, what: str) -> str:
    return f"{n:,} {what}" + ("" if n == 1 else "s")


def poison_causes(
    *,
    call: Callable,
    x: dict,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    device: torch.device | str,
    violations: dict[str, torch.Tensor] | None = None,
    trace: dict | None = None,
) -> list[Cause]:
    """The poison causes of a case whose normal run of ``call`` on inputs ``x`` (``make_inputs``:
    q, k, v, kw) returned ``out`` and ``lse``: ``unwritten_output`` and/or ``uninitialized_read``,
    best first; [] when no poisoned run changes the result.  ``call`` is the callable the engine
    ran (an ``audits.engine.worker.KernelCalls`` or its varlen entry: one with ``poisons_in_worker``
    is poisoned in its worker); ``device`` where the kernel runs.  Each cause's score is the share
    of the case's violating elements it accounts for when ``violations`` gives them ({"out": mask,
    "lse": mask}, each in its tensor's shape), else the share of the result's elements (out and
    lse) it accounts for; capped at 1."""
    normal = {"out": out} if lse is None else {"out": out, "lse": lse}
    normal = {n: t.detach() for n, t in normal.items()}
    return _findings(normal, lambda fill: _run(call, x, fill, device), violations, "re-run", trace)


def grad_poison_causes(
    *,
    calls,
    x: dict,
    do: torch.Tensor,
    opts,
    grads: dict,
    device: torch.device | str,
    violations: dict[str, torch.Tensor] | None = None,
    trace: dict | None = None,
) -> list[Cause]:
    """:func:`poison_causes` of a case's backward: its forward and backward re-run under each fill
    through ``calls.grad`` (``audits.engine.worker.KernelCalls``: in the kernel's worker when it has
    one) with the same inputs ``x`` and output gradient ``do``, one backward run each (``opts``
    with ``repeat`` 1), and dq, dk, dv compared bit for bit with ``grads`` (the normal run's first
    backward).  A gradient accumulated in memory the backward never zeroes changes with the fill
    (``uninitialized_read``); one never written takes it (``unwritten_output``).  dk and dv are
    read per key (their rows are keys); the sink's gradient (one per head) is not analysed."""
    normal = {n: grads[n].detach() for n in ("dq", "dk", "dv") if grads.get(n) is not None}
    if not normal:
        return []
    one = dataclasses.replace(opts, repeat=1)
    return _findings(normal, lambda fill: _run_grad(calls, x, do, one, fill), violations, "backward re-run", trace)


def _run_grad(calls, x: dict, do: torch.Tensor, opts, fill: str | None) -> tuple[dict | None, str | None]:
    """One forward and backward of ``calls`` under ``fill``: (its gradients, None) or (None, why not)."""
    try:
        status, res = calls.grad(x, do, opts, fill=fill)
    except Exception as exc:  # noqa: BLE001 - the case's own backward ran: a poisoned run's failure is evidence
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    if res is None:
        return None, status.get("reason") or status.get("status", "no result")
    return {n: t for n, t in res[2][0].items() if t is not None}, None


def _findings(normal: dict, run, violations, what: str, trace: dict | None = None) -> list[Cause]:
    """The poison causes of results ``normal`` ({name: tensor}) from ``run(fill)`` (results and
    why a run failed) under no fill, then each of :data:`FILLS`; ``what`` names the re-run.
    ``trace`` (when given) gets ``"summary"``: what the runs showed when no cause came of them (every
    result bit-identical under the fills, or every poisoned run failed), so that a negative
    finding is stated, not silent; and ``"counts"`` (``{"unwritten": n, "read": n}``, elements of the
    results) whenever a poisoned run ran."""
    results, failed = {}, {}
    for fill in (None, *FILLS):
        results[fill], why = run(fill)
        if why is not None:
            failed[fill or "control"] = why
    control, nan_run, pat_run = results[None], results["nan"], results["pattern"]
    if nan_run is None and pat_run is None:
        if trace is not None:
            trace["summary"] = f"{what}s under the fills all failed: {_said(failed)}"
        return []
    total = sum(t.numel() for t in normal.values())
    unwritten: dict[str, torch.Tensor] = {}
    read: dict[str, torch.Tensor] = {}
    nan_only_rows = unstable_total = 0
    second = functools.cache(lambda: run(SECOND_PATTERN)[0])  # made the first time it is asked for
    for name, o in normal.items():
        runs_of = tuple(_of(r, name, o) for r in (control, nan_run, pat_run))
        unwritten[name], read[name], rows, unstable = _classify(name, o, *runs_of, second)
        nan_only_rows += rows
        unstable_total += unstable
    causes = []
    fills = f"NaN (torch fill_uninitialized_memory) and byte 0x{POISON_BYTE:02X} ({_pattern_words()})"
    if second.cache_info().currsize:  # the second pattern ran: it decided elements the first could not
        fills += f", then byte 0x{SECOND_BYTE:02X} where the first pattern reproduced the normal run"
    failed_text = "".join(f"; the {f} run failed ({why})" for f, why in failed.items())
    unstable_text = _unstable_words(unstable_total) if "control" not in failed else ""
    n_unw = sum(int(m.sum()) for m in unwritten.values())
    if n_unw:
        wheres = [_where(name, m)[0] for name, m in unwritten.items() if bool(m.any())]
        alone = f" ({nan_only_rows:,} of them NaN only: the second fill did not reach them)" if nan_only_rows else ""
        causes.append(
            Cause(
                cause="unwritten_output",
                detail="; ".join(wheres),
                evidence=f"{what} with fresh memory filled with {fills}: {_plural(n_unw, 'element')} of {total:,} took "
                f"the fill in both runs{alone}, so the kernel never wrote them{failed_text}",
                score=_score(unwritten, violations, total),
            )
        )
    n_read = sum(int(m.sum()) for m in read.values())
    if n_read:
        wheres = [_where(name, m)[0] for name, m in read.items() if bool(m.any())]
        n_nan = sum(int((m & _nan_mask(nan_run, name, m)).sum()) for name, m in read.items())
        causes.append(
            Cause(
                cause="uninitialized_read",
                detail="; ".join(wheres),
                evidence=f"{what} with fresh memory filled with {fills}: {_plural(n_read, 'element')} of {total:,} "
                f"changed without taking the fill ({n_nan:,} became NaN under the NaN fill), so they mix values read "
                f"from memory the kernel never wrote into their arithmetic{unstable_text}{failed_text}",
                score=_score(read, violations, total),
            )
        )
    if trace is not None:  # the counts always; the negative sentence where no cause came of the runs
        negative = {} if causes else {"summary": _unchanged(normal, results, what, failed_text + unstable_text)}
        trace.update(counts={"unwritten": n_unw, "read": n_read}, **negative)
    return sorted(causes, key=lambda c: -c.score)


def _classify(name: str, o, c, n, p, second: Callable) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Tensor ``name``'s elements never written, and read from memory never written (masks), the
    elements counted unwritten on the NaN run alone (whole rows), and how many elements an
    unpoisoned re-run moved: from the normal run ``o`` and the control, NaN and pattern runs' ``c``,
    ``n``, ``p`` (None: that run failed).  ``second``: the run under :data:`SECOND_PATTERN`, asked
    for only where an element became NaN under the NaN fill while the pattern run reproduced the
    normal one: the pattern did not reach it (an allocation it cannot fill), or the normal run
    already held what the pattern gives, from memory an earlier poisoned run filled and freed
    (tests/test_poison.py's worker test named an accumulator never zeroed ``unwritten_output`` so,
    2 of 10 runs, 2026-12-04).  Under a second pattern the first case stays put, the second moves."""
    zero = torch.zeros(o.shape, dtype=torch.bool, device=o.device)
    nan_new = torch.isnan(n) & ~torch.isnan(o) if n is not None else zero
    pat_new = _is_pattern(p) & ~_is_pattern(o) if p is not None else zero
    rows = 0
    if n is not None and p is not None:
        # the fill in both runs, whatever the normal run's stale memory held there: never written
        both = torch.isnan(n) & _is_pattern(p)
        # a NaN that only the NaN fill brings (the pattern run is finite there) came from the fill
        fill_nan = torch.isnan(n) & ~torch.isnan(p)
        # NaN where the pattern run is what the normal run was (not where both runs took their
        # fill: a normal run holding the pattern already, from memory an earlier poisoned run
        # filled, the pattern did reach); the second pattern tells whether it reached them
        nan_alone = nan_new & _same(p, o) & ~both
        if bool(nan_alone.any()) and (p2 := _of(second(), name, o)) is not None:
            took = nan_alone & _is_pattern(p2, SECOND_VALUES)
            # moved by the second pattern, in a kernel whose unpoisoned re-run reproduced the normal
            # run everywhere else (an atomics kernel's noise would move them too)
            steady = c is not None and bool(_same(c, o)[~nan_alone].all())
            moved = nan_alone & ~_same(p2, p) & ~took if steady else zero
            both = both | took
            nan_alone = nan_alone & ~took & ~moved  # the moved ones: read (fill_nan holds them)
        if bool(nan_alone.any()):  # not reached by either pattern: whole rows of NaN are never written
            whole = _whole_rows(name, nan_alone)
            rows = int(whole.sum())
            both = both | whole
    else:  # one run failed: the other's fill where the normal run differs
        both, fill_nan = nan_new | pat_new, nan_new
    # a kernel whose unpoisoned re-run differs outside its unwritten elements (atomics; garbage
    # that differs run to run): a pattern-run change is no evidence there, only NaN is
    unstable = int((~_same(c, o) & ~both).sum()) if c is not None else o.numel()
    p_changed = ~_same(p, o) if p is not None and unstable == 0 else zero
    return both, (fill_nan | nan_new | p_changed) & ~both, rows, unstable


def _unstable_words(unstable_total: int) -> str:
    """The evidence's note on a kernel whose unpoisoned re-run differs at ``unstable_total`` elements
    ("" at none)."""
    if not unstable_total:
        return ""
    return (
        f"; an unpoisoned re-run differs from the normal run at {_plural(unstable_total, 'element')}, so only NaN "
        "under the NaN fill counted"
    )


def _said(failed: dict) -> str:
    return "; ".join(f"{f}: {w}" for f, w in failed.items())


def _unchanged(normal: dict, results: dict, what: str, notes: str) -> str:
    """The sentence of poisoned runs that changed nothing attributable to a fill."""
    ran = " and ".join(f for f in FILLS if results[f] is not None)
    return (
        f"{what} with fresh memory filled ({ran}): {', '.join(normal)} bit-identical to the normal run wherever "
        f"it was stable, so the result does not depend on memory the kernel never wrote{notes}"
    )


def _whole_rows(name: str, mask: torch.Tensor) -> torch.Tensor:
    """``mask`` (over tensor ``name``) kept where it covers a whole row (every column of a
    (batch, row, head)), in the tensor's own shape."""
    m = _rows_of(name, mask)
    whole = m.all(dim=-1, keepdim=True).expand(m.shape)
    if name == "lse":
        return whole.squeeze(-1).transpose(1, 2).reshape(mask.shape)
    return whole.reshape(mask.shape)


def _score(masks: dict[str, torch.Tensor], violations: dict[str, torch.Tensor] | None, total: int) -> float:
    """The share of the violating elements that ``masks`` cover (of all ``total`` elements,
    without violations given or with none of the right shape), at most 1."""
    viol = {n: v.to(masks[n].device) for n, v in (violations or {}).items() if n in masks and v.shape == masks[n].shape}
    n_viol = sum(int(v.sum()) for v in viol.values())
    if n_viol:
        return min(1.0, sum(int((masks[n] & v).sum()) for n, v in viol.items()) / n_viol)
    return min(1.0, sum(int(m.sum()) for m in masks.values()) / max(total, 1))


def _of(run: dict | None, name: str, like: torch.Tensor) -> torch.Tensor | None:
    """A poisoned run's tensor ``name`` on ``like``'s device; None without one of ``like``'s shape and dtype."""
    t = None if run is None else run.get(name)
    if t is None or t.shape != like.shape or t.dtype != like.dtype:
        return None
    return t.to(like.device)


def _nan_mask(run: dict | None, name: str, like: torch.Tensor) -> torch.Tensor:
    """Where the NaN run's ``name`` is NaN (all False without one)."""
    if run is None or name not in run or run[name].shape != like.shape:
        return torch.zeros(like.shape, dtype=torch.bool, device=like.device)
    return torch.isnan(run[name].to(like.device))


def _pattern_words() -> str:
    """The pattern's values in words, in the dtypes kernels write."""
    shown = (dt for dt in PATTERN_VALUES if dt != torch.float64)
    return ", ".join(f"{PATTERN_VALUES[dt]:.6g} as {str(dt).removeprefix('torch.')}" for dt in shown)
