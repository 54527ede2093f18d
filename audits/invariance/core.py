"""Invariance properties of a fixed-length kernel, checked bitwise on out and LSE.

* ``batch``: each sequence of a batch computed alone (batch 1, sliced inputs) against the same
  sequence inside the full batch, and inside the batch reversed (another position).  A batch-1
  case is widened to a batch of 2 (the case's family at batch 2) so that there is a batch.
* ``decode``: the last r query rows (r in ``DECODE_ROWS``, r < seqlen_q) computed with q
  restricted to those rows, against the same KV, versus those rows inside the full call.  The
  masks are bottom-right aligned, so the restricted call gives those rows the same visible keys;
  this is checked (``numerics.reference.visible_mask``) and the property is not applicable where
  it would not hold.

A property of a case is ``holds`` (every compared element bitwise equal, NaN payloads included),
``differs`` (how many elements, the largest distance in steps of the output's format, each
variant's largest |x - FP64| and, for FA4 kernels, whether both stay within
``numerics.forward_bound``), ``not applicable`` (with the reason), ``skipped`` (the kernel raised
NotImplementedError, or the case lies outside its declared domain) or ``error`` (the kernel raised
anything else, or broke the output contract).
"""

from __future__ import annotations

import dataclasses
import math
import time
import traceback

import torch

from audits.kernels import contract_error
from numerics.fp import bit_view, step_distance

__all__ = ["PROPERTIES", "DECODE_ROWS", "run_case", "summarize", "markdown", "cell"]

#: the properties this audit checks, with what each compares
PROPERTIES = {
    "batch": "a sequence alone (batch 1) == inside the batch == inside the batch reversed",
    "decode": "the last r query rows alone (q restricted, same KV) == those rows of the full call",
}
DECODE_ROWS = (1, 4)
RESULTS = ("holds", "differs", "not applicable", "skipped", "error")


class _Refused(Exception):
    """The kernel declined a call (NotImplementedError), or it lies outside its domain."""


class _Broken(Exception):
    """The kernel raised something else, or returned out/LSE breaking the contract."""


def _call(fn, q, k, v, kw) -> tuple[torch.Tensor, torch.Tensor | None]:
    try:
        res = fn(q, k, v, return_lse=True, **kw)
    except NotImplementedError as exc:
        raise _Refused(f"kernel does not support this configuration: {exc}") from exc
    except Exception as exc:
        tb = traceback.format_exc(limit=2).strip().splitlines()[-1]
        raise _Broken(f"kernel raised {type(exc).__name__}: {exc} ({tb})") from exc
    out, lse = res if isinstance(res, tuple) else (res, None)
    bad = contract_error(q, v, out, lse)
    if bad:
        raise _Broken(bad)
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


def _compare(a: torch.Tensor, b: torch.Tensor, ref: torch.Tensor | None, bound: torch.Tensor | None) -> dict:
    diff = bit_view(a) != bit_view(b)
    n = int(diff.sum())
    rec = {"compared": a.numel(), "differ": n}
    if n:
        st = step_distance(a, b)[diff]
        rec["max_steps"] = int(st.max())  # -1: only NaN against a number differs
        rec["nan_mismatch"] = int((st < 0).sum())
        ea, eb = _err(a, ref), _err(b, ref)
        rec["max_err_fp64"] = [_fmax(ea), _fmax(eb)]
        if bound is not None:
            ok = lambda e: bool(((e <= bound) | (e == 0)).all())
            rec["within_bound"] = ok(ea) and ok(eb)
    return rec


def _merge(recs: list[dict]) -> dict | None:
    """One tensor's comparisons summed: counts added, maxima taken."""
    if not recs:
        return None
    m = {"compared": sum(r["compared"] for r in recs), "differ": sum(r["differ"] for r in recs)}
    bad = [r for r in recs if r["differ"]]
    if bad:
        m["max_steps"] = max(r["max_steps"] for r in bad)
        m["nan_mismatch"] = sum(r["nan_mismatch"] for r in bad)
        m["max_err_fp64"] = [max(r["max_err_fp64"][i] for r in bad) for i in (0, 1)]
        if all("within_bound" in r for r in bad):
            m["within_bound"] = all(r["within_bound"] for r in bad)
    return m


class _Inputs:
    """A case's inputs, its full call and (lazily) its FP64 reference and forward bound."""

    def __init__(self, case, fn, device, bound_numerics):
        from audits.inputs import make_inputs

        self.case, self.fn = case, fn
        x = make_inputs(case, device=device)
        self.q, self.k, self.v, self.kw = x["q"], x["k"], x["v"], x["kw"]
        self._ref = self._bound = None
        self._nmf = bound_numerics
        self.full = _call(fn, self.q, self.k, self.v, self.kw)

    def ref(self):
        if self._ref is None:
            from numerics.reference import attention_reference

            self._ref = attention_reference(self.q, self.k, self.v, return_lse=True, **self.kw)
        return self._ref

    def bound(self):
        """(out_bound, lse_bound) for FA4 kernels (``numerics.forward_bound``), else (None, None)."""
        if self._nmf is None:
            return None, None
        if self._bound is None:
            from numerics.forward_bound import forward_error_bound

            nm = self._nmf(self.q, self.k, self.v, self.case.causal, tuple(self.case.window))
            self._bound = forward_error_bound(self.q, self.k, self.v, nm, reference=self.ref(), **self.kw)
        return self._bound

    def call(self, q, k, v):
        return _call(self.fn, q, k, v, self.kw)


def _pair_compare(x: _Inputs, label: str, a, b, sel) -> dict:
    """Compare variant a with variant b (each (out, lse)) on the elements ``sel`` picks from
    the full call: ``sel = (batch slice, row slice)``."""
    bs, rs = sel
    (oa, la), (ob, lb) = a, b
    same = bool((bit_view(oa) == bit_view(ob)).all()) and (
        la is None or lb is None or bool((bit_view(la) == bit_view(lb)).all())
    )
    ref_o = ref_l = bo = bl = None
    if not same:  # the reference and the bound only where something differs
        ro, rl = x.ref()
        ref_o, ref_l = ro[bs, rs], rl[bs, :, rs]
        fo, fl = x.bound()
        bo, bl = (None, None) if fo is None else (fo[bs, rs], fl[bs, :, rs])
    rec = {"comparison": label, "out": _compare(oa, ob, ref_o, bo)}
    if la is not None and lb is not None:
        rec["lse"] = _compare(la, lb, ref_l, bl)
    return rec


def _batch(case, fn, device, nmf, domain) -> dict:
    note = None
    if case.batch < 2:
        case = dataclasses.replace(case, batch=2)
        note = "a batch-1 case: compared inside a batch of 2 built from the case's family and seed"
    x = _Inputs(case, fn, device, nmf)
    nb = case.batch
    perm = list(range(nb))[::-1]
    rev = x.call(*(t[perm] for t in (x.q, x.k, x.v)))
    comps = []
    for b in range(nb):
        sl = slice(b, b + 1)
        alone = x.call(x.q[sl], x.k[sl], x.v[sl])
        pos = perm.index(b)
        sel = (sl, slice(None))
        inside = tuple(None if t is None else t[sl] for t in x.full)
        moved = (rev[0][pos : pos + 1], None if rev[1] is None else rev[1][pos : pos + 1])
        comps.append(_pair_compare(x, f"sequence {b}: alone vs inside the batch", alone, inside, sel))
        where = f"sequence {b}: alone vs at position {pos} of the reversed batch"
        comps.append(_pair_compare(x, where, alone, moved, sel))
    return _verdict(comps, note)


def _decode(case, fn, device, nmf, domain, x: _Inputs | None) -> dict:
    from numerics.reference import visible_mask

    rows = [r for r in DECODE_ROWS if r < case.seqlen_q]
    if not rows:
        return {"result": "not applicable",
                "reason": f"seqlen_q {case.seqlen_q}: the last row alone is the full call"}  # fmt: skip
    why = []
    vis = visible_mask(case.seqlen_q, case.seqlen_k, causal=case.causal, window_size=tuple(case.window))
    usable = []
    for r in rows:
        sub = visible_mask(r, case.seqlen_k, causal=case.causal, window_size=tuple(case.window))
        if not torch.equal(sub, vis[-r:]):
            why.append(f"r={r}: the restricted call would give the last rows other visible keys")
        elif domain is not None and (no := domain.refusal(dataclasses.replace(case, seqlen_q=r))):
            why.append(f"r={r}: seqlen_q {r} is outside the kernel's declared domain ({no})")
        else:
            usable.append(r)
    if not usable:
        return {"result": "not applicable", "reason": "; ".join(why)}
    x = x or _Inputs(case, fn, device, nmf)
    comps = []
    for r in usable:
        rs = slice(case.seqlen_q - r, case.seqlen_q)
        alone = x.call(x.q[:, rs], x.k, x.v)
        inside = (x.full[0][:, rs], None if x.full[1] is None else x.full[1][:, :, rs])
        where = f"last {r} row(s): alone vs inside the full call"
        comps.append(_pair_compare(x, where, alone, inside, (slice(None), rs)))
    return _verdict(comps, "; ".join(why) or None)


def _verdict(comps: list[dict], note: str | None) -> dict:
    out = _merge([c["out"] for c in comps])
    lse = _merge([c["lse"] for c in comps if "lse" in c])
    differs = out["differ"] or (lse is not None and lse["differ"])
    rec = {"result": "differs" if differs else "holds", "comparisons": len(comps), "out": out, "lse": lse}
    if lse is None:
        rec["lse_note"] = "LSE not returned: out compared only"
    if differs:
        rec["differing"] = [c["comparison"] for c in comps if c["out"]["differ"] or c.get("lse", {}).get("differ")]
    if note:
        rec["note"] = note
    return rec


def run_case(case, fn, *, device, bound_numerics=None, domain=None) -> dict:
    """Every property of ``case`` for the kernel ``fn``: the case's record."""
    from audits.inputs import NotApplicable

    t0 = time.perf_counter()
    rec = {"case": case.name, "config": case.as_dict(), "properties": {}}
    no = domain.refusal(case) if domain is not None else None
    for prop in PROPERTIES:
        if no:
            rec["properties"][prop] = {"result": "skipped", "reason": f"outside the kernel's declared domain: {no}"}
            continue
        try:
            if prop == "batch":
                res = _batch(case, fn, device, bound_numerics, domain)
            else:
                res = _decode(case, fn, device, bound_numerics, domain, None)
        except NotApplicable as exc:
            res = {"result": "not applicable", "reason": f"inputs: {exc}"}
        except _Refused as exc:
            res = {"result": "skipped", "reason": str(exc)}
        except _Broken as exc:
            res = {"result": "error", "reason": str(exc)}
        rec["properties"][prop] = res
    rec["seconds"] = round(time.perf_counter() - t0, 3)
    return rec


def summarize(records: list[dict], required: list[str]) -> dict:
    """Counts per property and result; whether the required properties hold."""
    counts = {p: dict.fromkeys(RESULTS, 0) for p in PROPERTIES}
    for r in records:
        for p, res in r["properties"].items():
            counts[p][res["result"]] += 1
    compared = sum(counts[p]["holds"] + counts[p]["differs"] for p in PROPERTIES)
    failing = [p for p in required if counts[p]["differs"] or counts[p]["error"]]
    return {"counts": counts, "required": required, "compared": compared, "failing": failing,
            "passed": compared > 0 and not failing}  # fmt: skip


def cell(res: dict) -> str:
    r = res["result"]
    if r == "holds":
        return f"holds ({res['comparisons']} comparisons)"
    if r != "differs":
        return f"{r}: {res.get('reason', '')}"
    parts = []
    for t in ("out", "lse"):
        m = res.get(t)
        if m and m["differ"]:
            e = m["max_err_fp64"]
            wb = {True: ", within bound", False: ", BEYOND bound"}.get(m.get("within_bound"), "")
            parts.append(f"{t}: {m['differ']}/{m['compared']} differ, max {m['max_steps']} steps, "
                         f"max err vs FP64 {e[0]:.3g} / {e[1]:.3g}{wb}")  # fmt: skip
    return "differs: " + "; ".join(parts)


def markdown(report: dict) -> str:
    s = report["summary"]
    lines = [
        f"# Invariance: {report['kernel']} on {report['suite']}",
        "",
        f"`{report['command']}` ({report['created']}, {report['environment']}; {report['seconds']:.1f} s)",
        "",
        f"Required: {', '.join(s['required']) or 'none'}; "
        + ("**pass**" if s["passed"] else f"**fail** ({', '.join(s['failing']) or 'nothing compared'})"),
        "",
        "| property | " + " | ".join(RESULTS) + " |",
        "|---|" + "---|" * len(RESULTS),
    ]
    for p in PROPERTIES:
        lines.append(f"| {p} | " + " | ".join(str(s["counts"][p][r]) for r in RESULTS) + " |")
    lines += ["", "| case | " + " | ".join(PROPERTIES) + " |", "|---|" + "---|" * len(PROPERTIES)]
    for r in report["cases"]:
        lines.append(f"| {r['case']} | " + " | ".join(cell(r["properties"][p]) for p in PROPERTIES) + " |")
    return "\n".join(lines) + "\n"
