"""One case's results of a candidate kernel against a baseline's, on the same inputs in the same
run (``fa4-audit compare``, docs/compare.md): per tensor (out, LSE, each gradient) whether every
bit is the same and, where not, how far apart (``numerics.metrics.bit_diff``: ULP histogram,
largest distance, NaN/inf changes) and where the differing elements lie (the diagnosis axes,
``audits.verdict.diagnosis.localize``).  The verdicts, bounds and criteria of each side are in
each kernel's own record; the run's comparison (``audits.report.compare``) reads both.

A gradient that differs is set against each side's own run-to-run spread (the backward's runs on
one graph, ``audits.engine.backward``): a kernel that accumulates with atomics differs from
itself, so a difference in such a tensor says nothing about the change between the kernels."""

from __future__ import annotations

import torch

from audits.suites.case import Case
from audits.verdict.diagnosis import CaseTensors, backward_tiles, canonical, forward_tiles, layout_of, localize
from numerics.fp import bit_view, format_of, ulp_of
from numerics.metrics import bit_diff

__all__ = ["compare_case", "label_run_to_run", "COMPARED", "NOT_COMPARED", "FORWARD_TENSORS"]

#: the forward's tensors; the others are gradients
FORWARD_TENSORS = ("out", "lse")

#: a comparison's ``status``: both sides' tensors were compared, or they could not be
COMPARED, NOT_COMPARED = "compared", "not compared"

#: each tensor's level in the diagnosis layout (``audits.verdict.diagnosis.Layout``)
_LEVEL = {"out": "row", "lse": "row", "dq": "row", "dk": "key", "dv": "key", "dsink": "head"}


def _tensors(t: CaseTensors) -> dict:
    """The results of one side by name: out, lse (when returned) and the first backward run's gradients."""
    got = {"out": t.out, "lse": t.lse}
    got.update(t.grads or {})
    return {n: x for n, x in got.items() if x is not None}


def _where(case: Case, name: str, diff_mask, base: CaseTensors) -> dict | None:
    """Where the differing elements of tensor ``name`` lie (``localize``'s record), tiles read
    from the baseline's numerics; None where the layout does not apply (a varlen gradient)."""
    if name in ("dq", "dk", "dv", "dsink"):
        tiles = backward_tiles(case=case, numerics=base.bwd_numerics, kind=base.bwd_kind or "peer")
    else:
        tiles = forward_tiles(case=case, numerics=base.numerics, kind=base.kind or "peer")
    level = _LEVEL[name]
    try:
        lay = layout_of(case=case, level=level, tile=tiles[0] if level == "row" else tiles[1])
    except ValueError:
        return None
    return localize(tensor=name, mask=canonical(name, diff_mask), layout=lay, words=("element", "identical"))


def row_ulp_change(base, cand, ref) -> float:
    """The largest |cand - base| over elements where both are finite, in ULPs of their dtype at the
    row's scale: the largest magnitude in the row (last dim) of the reference and both results
    (an output row is a convex combination of V rows: its rounding is set by its largest entries,
    and a row the reference has at 0 still has the results' own scale).  0.0 without such elements."""
    fmt = format_of(base.dtype)
    a, b = base.double(), cand.double()
    both = torch.isfinite(a) & torch.isfinite(b)
    mag = lambda t: torch.where(torch.isfinite(t), t.abs(), torch.zeros_like(t)).amax(dim=-1, keepdim=True)
    scale = ulp_of(torch.maximum(torch.maximum(mag(ref.double()), mag(a)), mag(b)), fmt)
    d = torch.where(both, (a - b).abs() / scale, torch.zeros_like(a))
    return float(d.max()) if d.numel() else 0.0


def _run_to_run(rec: dict | None, name: str) -> int | None:
    """How many elements of gradient ``name`` differed between the kernel's own backward runs on
    one graph (its record's ``backward.spread``), or None where not measured (one run, no backward)."""
    spread = ((rec or {}).get("backward") or {}).get("spread") or {}
    n = (spread.get(name) or {}).get("differing")
    return int(n) if isinstance(n, int) else None


def _forward_run_to_run(rec: dict | None) -> int | None:
    """How many out and LSE elements differed between the kernel's two forward calls on the case
    (``--time-calls``: its record's ``second_call_differing``; 0 from an older record's
    ``second_call_identical``), or None where it was called once."""
    rec = rec or {}
    n = rec.get("second_call_differing")
    if isinstance(n, int):
        return n
    return 0 if rec.get("second_call_identical") is True else None


def _backward_changed(rec: dict) -> bool | None:
    """Whether the gradients changed beyond what each kernel changes from run to run: True where a
    gradient is missing on one side or differs and is attributable; False where every differing
    gradient also differs between a side's own runs (or none differs); None without gradients, or
    where a differing gradient's run-to-run spread was not measured on a side (unknown)."""
    if rec["backward_identical"] is None:
        return None
    if any(n not in FORWARD_TENSORS for n in rec["missing"]):
        return True
    differing = [d for n, d in rec["tensors"].items() if n not in FORWARD_TENSORS and d["differ"]]
    if any(d["attributable"] for d in differing):
        return True
    noisy = lambda d: any(v for v in d["run_to_run"].values())  # a side known to differ from itself
    return False if all(noisy(d) for d in differing) else None


def compare_case(
    *,
    case: Case,
    base: CaseTensors | None,
    cand: CaseTensors | None,
    base_rec: dict | None = None,
    cand_rec: dict | None = None,
) -> dict:
    """The candidate's results on ``case`` against the baseline's: ``{"status": COMPARED,
    "identical", "forward_identical", "backward_identical" (None without gradients),
    "backward_changed" (``_backward_changed``), "tensors": {name: bit_diff record + "where" and,
    for out and dq/dk/dv, ``max_row_ulp`` (the largest change in ULPs at its row's largest
    reference magnitude), and "attributable" when elements differ}, "missing": tensors only one side
    returned}``, or ``{"status": NOT_COMPARED, "why"}`` when a side has no result (it did not run,
    or its record was resumed from a journal).

    ``base_rec``, ``cand_rec``: the two kernels' case records (``evaluate_case``'s).  A differing
    gradient gets ``run_to_run``: ``{"baseline", "candidate"}``, the elements that differed between
    that side's own backward runs (None where not measured: ``--repeat 1``, no record), and is
    ``attributable`` to the change only where both are known to be 0: a tensor that differs from
    itself from run to run may differ between the kernels by that alone.  A differing forward tensor
    gets ``run_to_run`` from both sides' second forward calls (``--time-calls``; None where a side
    called it once) and is ``attributable`` unless a side's second call moved elements: without
    ``--time-calls`` an assumption (a forward that differs from itself would read as a change)."""
    if base is None or cand is None or base.out is None or cand.out is None:
        side = "the baseline" if base is None or base.out is None else "the candidate"
        return {"status": NOT_COMPARED, "why": f"{side} returned no result on this case"}
    a, b = _tensors(base), _tensors(cand)
    rec = {"status": COMPARED, "tensors": {}, "missing": sorted(set(a) ^ set(b))}
    for name in (n for n in a if n in b):
        x, y = a[name].detach(), b[name].detach()
        if x.shape != y.shape or x.dtype != y.dtype:
            rec["tensors"][name] = {
                "elements": x.numel(),
                "differ": x.numel(),
                "layout_changed": f"{x.dtype}{tuple(x.shape)} -> {y.dtype}{tuple(y.shape)}",
            }
            continue
        y = y.to(x.device)
        d = bit_diff(x, y)
        if d["differ"]:
            mask = bit_view(x) != bit_view(y)
            d["where"] = _where(case, name, mask, base)
            refs = {"out": base.ref, **{g: r for g, r in (base.grad_refs or {}).items() if g in ("dq", "dk", "dv")}}
            ref = refs.get(name)
            if ref is not None and ref.shape == x.shape:
                # integer ULPs overstate changes of entries near 0; this reads them at the row's scale
                d["max_row_ulp"] = row_ulp_change(x, y, ref.to(x.device))
        rec["tensors"][name] = d
    fwd = [n for n in FORWARD_TENSORS if n in rec["tensors"]]
    bwd = [n for n in rec["tensors"] if n not in FORWARD_TENSORS]
    same = lambda names: all(rec["tensors"][n]["differ"] == 0 for n in names)
    rec["forward_identical"] = same(fwd) and not any(n in FORWARD_TENSORS for n in rec["missing"])
    rec["backward_identical"] = (
        (same(bwd) and not any(n not in FORWARD_TENSORS for n in rec["missing"]))
        if (bwd or any(n not in FORWARD_TENSORS for n in rec["missing"]))
        else None
    )
    rec["identical"] = rec["forward_identical"] and rec["backward_identical"] is not False
    return label_run_to_run(rec, base_rec=base_rec, cand_rec=cand_rec)


def label_run_to_run(rec: dict, *, base_rec: dict | None, cand_rec: dict | None) -> dict:
    """``rec`` (a :func:`compare_case` record) with each differing tensor's ``run_to_run`` (both
    sides' own spread, from their case records) and ``attributable``, and ``backward_changed``;
    also applied by ``audits.report.compare`` to records journalled before these fields existed."""
    for name, d in rec["tensors"].items():
        if not d["differ"]:
            continue
        if name in FORWARD_TENSORS:
            # measured only with --time-calls; unmeasured, a forward difference is taken as the change
            d["run_to_run"] = {"baseline": _forward_run_to_run(base_rec), "candidate": _forward_run_to_run(cand_rec)}
            d["attributable"] = not any(d["run_to_run"].values())
            continue
        d["run_to_run"] = {"baseline": _run_to_run(base_rec, name), "candidate": _run_to_run(cand_rec, name)}
        # another shape or dtype is the change itself, whatever either side's runs do
        d["attributable"] = "layout_changed" in d or all(n == 0 for n in d["run_to_run"].values())
    rec["backward_changed"] = _backward_changed(rec)
    return rec
