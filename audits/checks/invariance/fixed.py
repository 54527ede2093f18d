"""``batch`` and ``decode`` of a fixed-length kernel (no varlen entry), bitwise on out and LSE.

* ``batch``: each sequence of a batch computed alone (batch 1, sliced inputs) against the same
  sequence inside the full batch, and inside the batch reversed (another position).  A batch-1
  case is widened to a batch of 2 (the case's family at batch 2) so that there is a batch.
* ``decode``: the last r query rows (r in ``DECODE_ROWS``, r < seqlen_q) computed with q
  restricted to those rows, against the same KV, versus those rows inside the full call.  The
  masks are bottom-right aligned, so the restricted call gives those rows the same visible keys;
  this is checked (``numerics.reference.visible_mask``) and the property is not applicable where
  it would not hold.
"""

from __future__ import annotations

import dataclasses

import torch

from audits.checks.invariance.compare import call_fixed, pair, verdict
from audits.suites.inputs import make_inputs
from numerics.call import AttentionCall
from numerics.forward_bound import forward_error_bound
from numerics.reference import attention_reference, visible_mask

__all__ = ["DECODE_ROWS", "FixedInputs", "batch", "decode", "decode_rows", "decode_variant", "rows_case"]

DECODE_ROWS = (1, 4)


class FixedInputs:
    """A case's inputs, shared by every kernel audited on it (the measured one and its model):
    each kernel's full call, the FP64 reference and each kernel's forward bound, made lazily."""

    def __init__(self, case, device):
        self.case = case
        x = make_inputs(case, device=device)
        self.q, self.k, self.v, self.kw = x["q"], x["k"], x["v"], x["kw"]
        self.attention_call = AttentionCall.from_kwargs(**self.kw)
        self._ref = None
        self._bounds: dict = {}
        self._full: dict = {}

    def ref(self):
        if self._ref is None:
            self._ref = attention_reference(self.q, self.k, self.v, call=self.attention_call, return_lse=True)
        return self._ref

    def bound(self, t):
        """(out_bound, lse_bound) of target ``t``'s numerics (``numerics.forward_bound``), or
        (None, None) for a kernel without FA4 numerics."""
        if t.nmf is None:
            return None, None
        if t.name not in self._bounds:
            nm = t.nmf(self.q, self.k, self.v, self.case.causal, tuple(self.case.window))
            self._bounds[t.name] = forward_error_bound(
                self.q, self.k, self.v, nm, call=self.attention_call, reference=self.ref()
            )
        return self._bounds[t.name]

    def full(self, t):
        if t.name not in self._full:
            self._full[t.name] = call_fixed(t.fn, self.q, self.k, self.v, self.kw)
        return self._full[t.name]

    def call(self, t, q, k, v):
        return call_fixed(t.fn, q, k, v, self.kw)

    def lazy(self, t, bs: slice, rs: slice):
        """The reference and the bound of batch rows ``bs``, query rows ``rs``, when asked."""

        def get():
            ro, rl = self.ref()
            fo, fl = self.bound(t)
            bo, bl = (None, None) if fo is None else (fo[bs, rs], fl[bs, :, rs])
            return ro[bs, rs], rl[bs, :, rs], bo, bl

        return get


def _rows(res, bs: slice, rs: slice = slice(None)):
    out, lse = res
    return out[bs, rs], None if lse is None else lse[bs, :, rs]


def batch(x: FixedInputs, t, note: str | None) -> dict:
    nb = x.case.batch
    perm = list(range(nb))[::-1]
    rev = x.call(t, *(u[perm] for u in (x.q, x.k, x.v)))
    comps = []
    for b in range(nb):
        sl = slice(b, b + 1)
        alone = x.call(t, x.q[sl], x.k[sl], x.v[sl])
        pos = perm.index(b)
        lazy = x.lazy(t, sl, slice(None))
        comps.append(pair(f"sequence {b}: alone vs inside the batch", alone, _rows(x.full(t), sl), lazy))
        where = f"sequence {b}: alone vs at position {pos} of the reversed batch"
        comps.append(pair(where, alone, _rows(rev, slice(pos, pos + 1)), lazy))
    return verdict(comps, note)


def rows_case(case, r: int, sk: int):
    """The call of ``r`` query rows against ``sk`` keys that a decode comparison makes of
    ``case``, as a case (a varlen case as one sequence), for ``Domain.refusal`` to judge."""
    if case.varlen:
        return dataclasses.replace(case, seqlens=((r, sk),), seqused_k=(), batch=1, seqlen_q=r, seqlen_k=sk)
    return dataclasses.replace(case, seqlen_q=r, seqlen_k=sk)


def decode_rows(case, sq: int, sk: int, domain) -> tuple[list[int], list[str]]:
    """(the usable row counts r for a sequence of sq rows and sk keys, why the others are not):
    the r of ``DECODE_ROWS`` whose restricted call gives the last r rows the same visible keys
    and lies in the kernel's declared domain; where none does, the smallest r < sq whose call
    lies in the domain (a restricted domain's length multiple: the last 128 rows of 256 for a
    kernel taking multiples of 128), ``Domain.refusal`` judging each.  Where no r fits at all,
    the reasons say why (an equal-lengths domain: r rows against sk keys never fit)."""
    why, usable = [], []
    win = tuple(case.window)
    vis = None

    def same_keys(r: int) -> bool:
        nonlocal vis
        if vis is None:
            vis = visible_mask(sq, sk, causal=case.causal, window_size=win)
        return torch.equal(visible_mask(r, sk, causal=case.causal, window_size=win), vis[-r:])

    refused = False  # whether the domain (not the mask) ruled out an r of DECODE_ROWS
    for r in (r for r in DECODE_ROWS if r < sq):
        if not same_keys(r):
            why.append(f"r={r}: the restricted call would give the last rows other visible keys")
        elif domain is not None and (no := domain.refusal(rows_case(case, r, sk))):
            why.append(f"r={r}: seqlen_q {r} is outside the kernel's declared domain ({no})")
            refused = True
        else:
            usable.append(r)
    if usable or not refused:
        return usable, why
    for r in range(1, sq):
        if domain.refusal(rows_case(case, r, sk)) is None and same_keys(r):
            return [r], why
    qm = domain.seqlen_q_multiple
    tried = next(iter(range(qm, sq, qm)), None)  # the first row count of the domain's query multiple
    if tried is None:
        said = f"a call's query rows must be a multiple of {qm}, and seqlen_q {sq} has none below it"
    else:
        no = domain.refusal(rows_case(case, tried, sk)) or "the last rows would see other keys"
        said = f"r={tried}: {no}" + (f" (the last rows alone against all {sk} keys)" if domain.equal_seqlens else "")
    why = [f"no row count r < seqlen_q {sq} gives a call inside the kernel's declared domain; {said}"]
    return usable, why


def decode(x: FixedInputs, t) -> dict:
    case = x.case
    if case.seqlen_q <= min(DECODE_ROWS):
        return {"result": "not applicable", "reason": f"seqlen_q {case.seqlen_q}: the last row alone is the full call"}
    usable, why = decode_rows(case, case.seqlen_q, case.seqlen_k, t.domain)
    if not usable:
        return {"result": "not applicable", "reason": "; ".join(why)}
    comps = []
    for r in usable:
        rs = slice(case.seqlen_q - r, case.seqlen_q)
        alone = x.call(t, x.q[:, rs], x.k, x.v)
        where = f"last {r} row(s): alone vs inside the full call"
        comps.append(pair(where, alone, _rows(x.full(t), slice(None), rs), x.lazy(t, slice(None), rs)))
    return verdict(comps, "; ".join(why) or None)


def decode_variant(case, domain):
    """A case like ``case`` with a longer query (twice its rows, or seqlen_q + seqlen_k), inside
    ``domain``, whose last rows can be compared (:func:`decode_rows`): decode's comparison for a
    case whose own rows would be compared but for the domain (its lengths one block of a kernel
    that takes multiples of that block).  None when the domain is not what stops the comparison
    (a one-row case), or no such case lies in it."""
    if domain is None or case.varlen or not decode_rows(case, case.seqlen_q, case.seqlen_k, None)[0]:
        return None  # not the domain's doing: the case's own rows leave nothing to compare
    for sq in dict.fromkeys((2 * case.seqlen_q, case.seqlen_q + case.seqlen_k)):
        v = dataclasses.replace(case, seqlen_q=sq)
        if domain.refusal(v) is None and decode_rows(v, sq, v.seqlen_k, domain)[0]:
            return v
    return None
