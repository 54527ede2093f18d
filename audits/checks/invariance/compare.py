"""The invariance audit's comparisons: calling a kernel (its refusals and contract breaks as
exceptions), comparing two variants of the same elements bit for bit, and merging comparisons
into a property's result (docs/invariance.md)."""

from __future__ import annotations

import math

import torch

from audits.engine.failures import failure_reason, traceback_of
from audits.engine.worker import KernelTimeout, WorkerCrashed
from audits.kernels import contract_error, varlen_contract_error
from numerics.fp import bit_view, format_of, step_distance, ulp_of

__all__ = ["RESULTS", "Refused", "Broken", "TimedOut", "call_fixed", "call_varlen", "compare", "merge", "verdict"]

RESULTS = ("holds", "differs", "not applicable", "skipped", "error", "timeout")


class Refused(Exception):
    """The kernel declined a call (NotImplementedError), or it lies outside its domain."""


class Broken(Exception):
    """The kernel raised something else, its worker died, or it returned out/LSE breaking the contract."""


class TimedOut(Exception):
    """A call in the kernel's worker passed ``--timeout`` (``audits.engine.worker``): killed."""


def _invoke(fn, q, k, v, kw):
    try:
        res = fn(q, k, v, return_lse=True, **kw)
    except NotImplementedError as exc:
        raise Refused(f"kernel does not support this configuration: {exc}") from exc
    except KernelTimeout as exc:
        raise TimedOut(str(exc)) from exc
    except WorkerCrashed as exc:
        raise Broken(str(exc)) from exc
    except Exception as exc:
        tb = traceback_of(exc, limit=2).strip().splitlines()[-1]
        raise Broken(f"{failure_reason(exc)[1]} ({tb})") from exc
    return res if isinstance(res, tuple) else (res, None)


def call_fixed(fn, q, k, v, kw) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out, lse) of the fixed-length kernel ``fn`` (lse None when it returns none)."""
    out, lse = _invoke(fn, q, k, v, kw)
    bad = contract_error(q, v, out, lse)
    if bad:
        raise Broken(bad)
    return out.detach(), (None if lse is None else lse.detach())


def call_varlen(fn, q, k, v, kw) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out, lse) of the varlen kernel ``fn`` on packed q (total_q, hq, d)."""
    out, lse = _invoke(fn, q, k, v, kw)
    bad = varlen_contract_error(q, v, out, lse, packed=True)
    if bad:
        raise Broken(bad)
    return out.detach(), (None if lse is None else lse.detach())


def _err(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|x - FP64| elementwise (float64): 0 where equal (infinities included) or both NaN, inf
    where one side only is NaN."""
    a = x.double()
    e = (a - ref).abs()
    e = torch.where((a == ref) | (torch.isnan(a) & torch.isnan(ref)), torch.zeros_like(e), e)
    return torch.where(torch.isnan(e), torch.full_like(e, math.inf), e)


def _fmax(t: torch.Tensor) -> float:
    return float(t.max()) if t.numel() else 0.0


def _ulps(a: torch.Tensor, b: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest |a - b| in ULPs of their format at the FP64 value (the design's ULP
    convention; inf where only one side is NaN or infinite)."""
    d = (a.double() - b.double()).abs()
    d = torch.where(bit_view(a) == bit_view(b), torch.zeros_like(d), d)
    d = torch.where(torch.isnan(d), torch.full_like(d, math.inf), d)
    return _fmax(d / ulp_of(torch.where(torch.isfinite(ref), ref, torch.zeros_like(ref)), format_of(a.dtype)))


def _within(e: torch.Tensor, bound: torch.Tensor) -> bool:
    """Every error within its bound; an infinite error (NaN against a number, an infinity
    against a finite value) never is, whatever the bound."""
    return bool((((e <= bound) & torch.isfinite(e)) | (e == 0)).all())


def compare(a: torch.Tensor, b: torch.Tensor, ref: torch.Tensor | None, bound) -> dict:
    """Variant ``a`` against variant ``b`` of the same elements: how many differ bitwise, by how
    many steps of the format (``max_steps``: adjacent values 1 apart, so values of opposite sign
    near zero are many steps apart) and by how many ULPs of the format at the FP64 value
    (``max_ulp``), each one's largest |x - FP64| against ``ref`` and (``bound``: one
    tensor for both, or a pair, one per variant) whether both stay within the forward bound.
    ``ref`` and ``bound`` are read only where something differs."""
    diff = bit_view(a) != bit_view(b)
    n = int(diff.sum())
    rec = {"compared": a.numel(), "differ": n}
    if n:
        st = step_distance(a, b)[diff]
        rec["max_steps"] = int(st.max())  # -1: only NaN against a number differs
        rec["nan_mismatch"] = int((st < 0).sum())
        rec["max_ulp"] = _ulps(a, b, ref)
        ea, eb = _err(a, ref), _err(b, ref)
        rec["max_err_fp64"] = [_fmax(ea), _fmax(eb)]
        if bound is not None:
            ba, bb = bound if isinstance(bound, tuple) else (bound, bound)
            rec["within_bound"] = _within(ea, ba) and _within(eb, bb)
    return rec


def merge(recs: list[dict]) -> dict | None:
    """One tensor's comparisons summed: counts added, maxima taken."""
    if not recs:
        return None
    m = {"compared": sum(r["compared"] for r in recs), "differ": sum(r["differ"] for r in recs)}
    bad = [r for r in recs if r["differ"]]
    if bad:
        m["max_steps"] = max(r["max_steps"] for r in bad)
        m["max_ulp"] = max(r["max_ulp"] for r in bad)
        m["nan_mismatch"] = sum(r["nan_mismatch"] for r in bad)
        m["max_err_fp64"] = [max(r["max_err_fp64"][i] for r in bad) for i in (0, 1)]
        if all("within_bound" in r for r in bad):
            m["within_bound"] = all(r["within_bound"] for r in bad)
    return m


def same_bits(a, b) -> bool:
    """Whether two (out, lse) results are equal bit for bit (an absent LSE compares out only)."""
    (oa, la), (ob, lb) = a, b
    return bool((bit_view(oa) == bit_view(ob)).all()) and (
        la is None or lb is None or bool((bit_view(la) == bit_view(lb)).all())
    )


def pair(label: str, a, b, lazy) -> dict:
    """A comparison record of results ``a`` and ``b`` (each (out, lse)); ``lazy()`` gives
    (ref_out, ref_lse, bound_out, bound_lse) for those elements, asked only where they differ
    (bounds: None, a tensor, or a pair per variant)."""
    (oa, la), (ob, lb) = a, b
    ref_o = ref_l = bo = bl = None
    if not same_bits(a, b):
        ref_o, ref_l, bo, bl = lazy()
    rec = {"comparison": label, "out": compare(oa, ob, ref_o, bo)}
    if la is not None and lb is not None:
        rec["lse"] = compare(la, lb, ref_l, bl)
    return rec


def _differs(c: dict) -> bool:
    return bool(c["out"]["differ"] or c.get("lse", {}).get("differ"))


def _in_bound(c: dict) -> bool:
    """Whether every differing tensor of comparison ``c`` stays within the bound (no bound: no)."""
    return all(c[t].get("within_bound", False) for t in ("out", "lse") if c.get(t, {}).get("differ"))


def verdict(comps: list[dict], note: str | None, *, within_bound_holds: bool = False) -> dict:
    """A property's result from its comparisons: ``holds`` when every compared element is equal
    bit for bit, else ``differs`` with the merged counts.  ``within_bound_holds`` (split): it
    holds when every differing comparison stays within the forward bound; ``bitwise`` says
    whether the variants were also equal.  A comparison marked ``"bitwise_claimed": True``
    (the mod properties: production computes the same arithmetic there) must be equal bit for
    bit even so."""
    out = merge([c["out"] for c in comps])
    lse = merge([c["lse"] for c in comps if "lse" in c])
    bad = [c for c in comps if _differs(c)]
    if within_bound_holds:
        beyond = [c for c in bad if c.get("bitwise_claimed") or not _in_bound(c)]
        rec = {"result": "differs" if beyond else "holds", "bitwise": not bad}
    else:
        beyond = bad
        rec = {"result": "differs" if bad else "holds"}
    rec.update({"comparisons": len(comps), "out": out, "lse": lse})
    if lse is None:
        rec["lse_note"] = "LSE not returned: out compared only"
    if bad:
        rec["differing"] = [c["comparison"] for c in bad]
    if within_bound_holds and beyond:
        rec["beyond_bound"] = [c["comparison"] for c in beyond]
    if note:
        rec["note"] = note
    return rec
