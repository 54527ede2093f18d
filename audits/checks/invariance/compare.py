"""The invariance audit's comparisons: calling a kernel (its refusals and contract breaks as
exceptions), comparing two variants of the same elements bit for bit, and merging comparisons
into a property's result (docs/invariance.md).

"Bitwise equal" on non-finite values (:func:`same_elements`): two elements are equal when their
bits are equal, or when both are NaN, whatever their payloads and signs.  So an infinity equals
only the infinity of the same sign (its bits), +inf against -inf differs, a NaN against any
number (finite or infinite) differs, and -0 against +0 differs (the sign of zero is a value
arithmetic can observe: 1/x, copysign).  Why a NaN's payload and sign do not count: they carry
no value.  IEEE 754-2019 (6.2.3) only recommends, never requires, that an operation propagate an
input NaN's payload, and leaves the payload and sign of a NaN an invalid operation creates to
the implementation: x86's SSE/AVX create the "default NaN" 0xFFC00000 (sign set), PTX the
canonical 0x7FFFFFFF (docs/design.md), and which operand's payload a two-NaN operation keeps
depends on the operand order the compiler chose for a vector or a scalar loop.  A kernel that
takes a vectorized path for a full batch and a scalar tail for one decode row can then return
NaNs of another sign in the same places: the same result, which a bitwise property must not call
different.  The count of NaN pairs whose bits differ is kept in the record (``nan_payloads``),
never among the differing elements."""

from __future__ import annotations

import math

import torch

from audits.contract import contract_error, varlen_contract_error
from audits.engine.failures import failure_reason, traceback_of
from audits.engine.worker import KernelTimeout, WorkerCrashed
from numerics.fp import bit_view, format_of, step_distance, ulp_of

__all__ = [
    "RESULTS",
    "Refused",
    "Broken",
    "TimedOut",
    "call_fixed",
    "call_varlen",
    "same_elements",
    "compare",
    "merge",
    "verdict",
]

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


def _isnan(x: torch.Tensor) -> torch.Tensor:
    return torch.isnan(x.float() if x.element_size() == 1 else x)  # fp8 has no isnan kernel


def same_elements(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise, whether ``a`` and ``b`` are equal in the invariance audit's sense (the module's
    docstring): equal bits, or both NaN (any payload, any sign)."""
    return (bit_view(a) == bit_view(b)) | (_isnan(a) & _isnan(b))


def _ulps(a: torch.Tensor, b: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest |a - b| in ULPs of their format at the FP64 value (the design's ULP
    convention; 0 where :func:`same_elements`, inf where only one side is NaN or infinite)."""
    d = (a.double() - b.double()).abs()
    d = torch.where(same_elements(a, b), torch.zeros_like(d), d)
    d = torch.where(torch.isnan(d), torch.full_like(d, math.inf), d)
    return _fmax(d / ulp_of(torch.where(torch.isfinite(ref), ref, torch.zeros_like(ref)), format_of(a.dtype)))


def _within(e: torch.Tensor, bound: torch.Tensor) -> bool:
    """Every error within its bound; an infinite error (NaN against a number, an infinity
    against a finite value) never is, whatever the bound."""
    return bool((((e <= bound) & torch.isfinite(e)) | (e == 0)).all())


def compare(a: torch.Tensor, b: torch.Tensor, ref: torch.Tensor | None, bound) -> dict:
    """Variant ``a`` against variant ``b`` of the same elements: how many differ (not
    :func:`same_elements`), by how many steps of the format (``max_steps``: adjacent values 1
    apart, so values of opposite sign near zero are many steps apart; -1 when only NaN against a
    number differs), how many of them are a NaN against a number (``nan_mismatch``) and an
    infinity against the other infinity (``inf_sign_mismatch``), by how many ULPs of the format
    at the FP64 value (``max_ulp``), each one's largest |x - FP64| against ``ref`` and
    (``bound``: one tensor for both, or a pair, one per variant) whether both stay within the
    forward bound.  ``nan_payloads``: NaN pairs whose bits differ, equal here (present when
    some are).  ``ref`` and ``bound`` are read only where something differs."""
    same_bits_ = bit_view(a) == bit_view(b)
    nan_a, nan_b = _isnan(a), _isnan(b)
    diff = ~same_bits_ & ~(nan_a & nan_b)
    n = int(diff.sum())
    rec = {"compared": a.numel(), "differ": n}
    payloads = int((~same_bits_ & nan_a & nan_b).sum())
    if payloads:
        rec["nan_payloads"] = payloads
    if n:
        st = step_distance(a, b)[diff]
        rec["max_steps"] = int(st.max())  # -1: only NaN against a number differs
        rec["nan_mismatch"] = int((nan_a ^ nan_b).sum())
        fa, fb = a.float(), b.float()
        rec["inf_sign_mismatch"] = int((torch.isinf(fa) & torch.isinf(fb) & (fa != fb)).sum())
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
    payloads = sum(r.get("nan_payloads", 0) for r in recs)
    if payloads:
        m["nan_payloads"] = payloads
    bad = [r for r in recs if r["differ"]]
    if bad:
        m["max_steps"] = max(r["max_steps"] for r in bad)
        m["max_ulp"] = max(r["max_ulp"] for r in bad)
        m["nan_mismatch"] = sum(r["nan_mismatch"] for r in bad)
        m["inf_sign_mismatch"] = sum(r.get("inf_sign_mismatch", 0) for r in bad)
        m["max_err_fp64"] = [max(r["max_err_fp64"][i] for r in bad) for i in (0, 1)]
        if all("within_bound" in r for r in bad):
            m["within_bound"] = all(r["within_bound"] for r in bad)
    return m


def same_bits(a, b) -> bool:
    """Whether two (out, lse) results are equal bit for bit, NaN equal to NaN
    (:func:`same_elements`; an absent LSE compares out only)."""
    (oa, la), (ob, lb) = a, b
    return bool(same_elements(oa, ob).all()) and (la is None or lb is None or bool(same_elements(la, lb).all()))


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
