"""The invariance properties of a kernel's varlen entry (``flash_attn_varlen_func``'s contract,
``audits.kernels.get_varlen_kernel``), each compared per sequence, on out and LSE:

* ``batch``: a sequence alone (a 1-sequence call) == inside the case's batch == inside the batch
  reversed == beside shorter sequences (each sequence after a copy of another cut to half its
  rows and keys: other lengths, other token offsets; in a restricted domain the longest cut
  inside it, or a whole copy).  Bitwise.
* ``decode``: the last r rows of each sequence (r in ``DECODE_ROWS``), a call whose q is those
  rows against the same KV, == those rows of the prefill.  Bitwise; per sequence, not applicable
  where bottom-right alignment would give the rows other visible keys.
* ``split``: num_splits 1 against N (``SPLITS`` and the case's own): expected to differ; it
  *holds* when both variants stay within the per-element forward bound wherever they differ
  (``bitwise`` says whether they were also equal), and differs otherwise.
* ``paged``: a paged KV cache of each size in ``PAGE_SIZES`` (and the case's) against contiguous
  KV, and consecutive page sizes against each other.  Bitwise.
* ``pack_gqa``: pack_gqa on against off (GQA cases only).  Bitwise.

Every call keeps the case's own layout (page size, num_splits, pack_gqa) but for the knob the
property varies.  A fixed-length case becomes a varlen call of its batch rows (each a sequence).
"""

from __future__ import annotations

import dataclasses

import torch

from audits.checks.invariance.compare import Refused, call_varlen, pair, verdict
from audits.checks.invariance.fixed import DECODE_ROWS, decode_rows, rows_case
from audits.suites import inputs  # its ``paged`` pool builder, beside this module's ``paged`` property
from audits.suites.inputs import make_inputs, make_varlen_inputs
from fa4.varlen import packs_gqa, sequence_numerics, split_counts
from numerics.call import AttentionCall
from numerics.forward_bound import forward_error_bound
from numerics.reference import attention_reference

__all__ = ["PAGE_SIZES", "SPLITS", "VarlenInputs", "batch", "decode", "split", "paged", "pack_gqa", "bound_keywords"]

#: page sizes compared with contiguous KV: ones that divide the 128-key tile and ones that do not
PAGE_SIZES = (16, 48, 64, 128, 256)
#: num_splits compared with 1 (and the case's own when it is > 1)
SPLITS = (2, 3)


@dataclasses.dataclass(frozen=True)
class Spec:
    """The knobs a call's numerics may depend on: num_splits, page size (0: contiguous), pack_gqa."""

    num_splits: int
    page: int
    pack_gqa: bool | None


@dataclasses.dataclass
class VarlenCall:
    """One varlen call: packed q, k, v, its keywords, each sequence's [start, stop) rows in the
    packed q, and its knobs."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    kw: dict
    offsets: list[tuple[int, int]]
    spec: Spec
    _splits: dict = dataclasses.field(default_factory=dict)

    def splits(self, arch: str, j: int) -> int:
        """How many splits the FA4 numerics of ``arch`` give sequence ``j`` of this call: the
        requested num_splits, or SM100's per-sequence count on varlen queries, which follows the
        whole batch (``fa4.varlen.split_counts``)."""
        if self.spec.num_splits == 1:
            return 1
        if arch not in self._splits:
            self._splits[arch] = split_counts(self.q, self.k, arch=arch, **self.kw)
        return self._splits[arch][j]


def bound_keywords(num_splits: int, pack_gqa: bool) -> dict:
    """``numerics.forward_bound.forward_error_bound``'s split-KV keywords for a call in
    ``num_splits`` splits run with ``pack_gqa``."""
    return {"num_splits": num_splits, "pack_gqa": pack_gqa}


def _offsets(cu: torch.Tensor) -> list[tuple[int, int]]:
    c = cu.tolist()
    return list(zip(c[:-1], c[1:]))


class VarlenInputs:
    """A case's varlen inputs, shared by every kernel audited on it: its sequences (``parts``,
    batch 1 each), the case's call, the FP64 reference and forward bounds per sequence (lazy),
    and each kernel's results of whole-batch calls (cached by knobs)."""

    def __init__(self, case, device):
        self.case, self.device = case, device
        x = make_varlen_inputs(case, device=device) if case.varlen else make_inputs(case, device=device)
        kw = x["kw"]
        self.common = {n: kw[n] for n in ("causal", "window_size", "softcap", "learnable_sink") if n in kw}
        self.hq, self.hk = x["q"].shape[-2], x["k"].shape[-2]
        if case.varlen:
            self.parts = list(x["parts"])
            spec = Spec(case.num_splits, case.page_size, case.pack_gqa)
            base = VarlenCall(x["q"], x["k"], x["v"], kw, _offsets(kw["cu_seqlens_q"].cpu()), spec)
        else:
            q, k, v = x["q"], x["k"], x["v"]
            self.parts = [(q[i : i + 1], k[i : i + 1], v[i : i + 1]) for i in range(case.batch)]
            base = self.pack(self.parts, Spec(1, 0, None))
        self.base = base
        self._calls = {base.spec: base}
        self._results: dict = {}
        self._refs: dict = {}
        self._bounds: dict = {}

    # ---- calls ----------------------------------------------------------------------------

    def pack(self, parts, spec: Spec, last: int | None = None) -> VarlenCall:
        """The varlen call of ``parts`` (each (q, k, v), batch 1) with knobs ``spec``; ``last``:
        q restricted to each sequence's last rows."""
        qs = [p[0][0] if last is None else p[0][0, -last:] for p in parts]
        ks, vs = [p[1][0] for p in parts], [p[2][0] for p in parts]
        lq, lk = [t.shape[0] for t in qs], [t.shape[0] for t in ks]
        cu = lambda ls: torch.tensor([0, *torch.tensor(ls).cumsum(0).tolist()], dtype=torch.int32)
        kw = dict(self.common, cu_seqlens_q=cu(lq).to(self.device), max_seqlen_q=max(lq), max_seqlen_k=max(lk))
        if spec.page:
            g = torch.Generator().manual_seed(self.case.seed * 1009 + spec.page)
            table = inputs.page_table(lk, spec.page, g)
            k = inputs.paged([t.cpu() for t in ks], table, spec.page).to(self.device)
            v = inputs.paged([t.cpu() for t in vs], table, spec.page).to(self.device)
            kw["page_table"] = table.to(self.device)
            kw["seqused_k"] = torch.tensor(lk, dtype=torch.int32, device=self.device)
        else:
            k, v = torch.cat(ks), torch.cat(vs)
            kw["cu_seqlens_k"] = cu(lk).to(self.device)
        kw["num_splits"] = spec.num_splits
        if spec.pack_gqa is not None:
            kw["pack_gqa"] = spec.pack_gqa
        return VarlenCall(torch.cat(qs), k, v, kw, _offsets(cu(lq)), spec)

    def full(self, **changes) -> VarlenCall:
        """The whole batch with the base's knobs but ``changes``: the base's own tensors where
        only num_splits / pack_gqa change, the sequences repacked where the page size does."""
        spec = dataclasses.replace(self.base.spec, **changes)
        if spec not in self._calls:
            b = self.base
            if spec.page == b.spec.page:
                kw = {n: x for n, x in b.kw.items() if n != "pack_gqa"}
                kw["num_splits"] = spec.num_splits
                if spec.pack_gqa is not None:
                    kw["pack_gqa"] = spec.pack_gqa
                self._calls[spec] = VarlenCall(b.q, b.k, b.v, kw, b.offsets, spec)
            else:
                self._calls[spec] = self.pack(self.parts, spec)
        return self._calls[spec]

    def run(self, t, call: VarlenCall, *, cache: bool = False):
        key = (t.name, call.spec)
        if cache and key in self._results:
            return self._results[key]
        res = call_varlen(t.varlen, call.q, call.k, call.v, call.kw)
        if cache:
            self._results[key] = res
        return res

    def try_run(self, t, call: VarlenCall):
        """The call's result, or the Refused exception when the kernel declines it."""
        try:
            return self.run(t, call, cache=True)
        except Refused as exc:
            return exc

    @staticmethod
    def seq(res, call: VarlenCall, i: int, rows: slice = slice(None)):
        """Sequence ``i``'s rows of a call's result, shaped as a batch-1 fixed-length result:
        out (1, sq, hq, dv), lse (1, hq, sq)."""
        out, lse = res
        r0, r1 = call.offsets[i]
        o = out[r0:r1][rows].unsqueeze(0)
        return o, None if lse is None else lse[:, r0:r1][:, rows].unsqueeze(0)

    # ---- reference and bound --------------------------------------------------------------

    def ref(self, i: int):
        if i not in self._refs:
            self._refs[i] = attention_reference(
                *self.parts[i], call=AttentionCall.from_kwargs(**self.common), return_lse=True
            )
        return self._refs[i]

    def bound(self, t, i: int, call: VarlenCall, j: int):
        """Sequence ``i``'s (out_bound, lse_bound) for target ``t``'s numerics as sequence ``j``
        of ``call``, or None for a kernel without FA4 numerics."""
        if t.arch is None:
            return None

        q, k, v = self.parts[i]
        spec = call.spec
        pack = packs_gqa(spec.pack_gqa, self.hq, self.hk)
        # the numerics fa4.varlen.varlen_attention picks for this sequence of a packed call
        nm = sequence_numerics(
            t.arch,
            q,
            k,
            v,
            self.common["causal"],
            self.common["window_size"],
            varlen_q=True,
            num_splits=spec.num_splits,
            page_size=spec.page,
            pack=pack,
            max_seqlen_q=call.kw["max_seqlen_q"],
        )
        extra = bound_keywords(call.splits(t.arch, j), pack)  # split-KV: numerics.forward_bound.split_error_bound
        key = (i, nm, tuple(sorted(extra.items())))  # calls of the same numerics share one
        if key not in self._bounds:
            call = AttentionCall.from_kwargs(**self.common)
            self._bounds[key] = forward_error_bound(q, k, v, nm, call=call, reference=self.ref(i), **extra)
        return self._bounds[key]

    def lazy(self, t, i: int, rows: slice, a: tuple[VarlenCall, int], b: tuple[VarlenCall, int]):
        """Sequence ``i``'s reference and the bound of each variant (sequence j of a call) on
        ``rows``, when asked.  A decode call's bound is the prefill's rows (its splits aside)."""

        def get():
            ro, rl = self.ref(i)
            ba, bb = self.bound(t, i, *a), self.bound(t, i, *b)
            bo = bl = None
            if ba is not None:
                bo = (ba[0][:, rows], bb[0][:, rows])
                bl = (ba[1][:, :, rows], bb[1][:, :, rows])
            return ro[:, rows], rl[:, :, rows], bo, bl

        return get


def _short(p, case, domain):
    """A copy of sequence ``p`` cut to half its rows and keys (at least one of each); inside a
    restricted ``domain`` (``Domain.refusal`` of a call of those lengths), the longest cut of at
    most half the rows that fits it (keys cut in proportion, or to the rows' count); the whole
    sequence (a copy at another token offset) when no cut fits."""
    q, k, v = p
    sq, sk = q.shape[1], k.shape[1]
    fits = lambda n, m: domain is None or domain.refusal(rows_case(case, n, m)) is None
    n, m = max(1, sq // 2), max(1, sk // 2)
    if not fits(n, m):
        cuts = ((a, b) for a in range(sq // 2, 0, -1) for b in dict.fromkeys((max(1, a * sk // sq), a)) if b <= sk)
        n, m = next(((a, b) for a, b in cuts if fits(a, b)), (sq, sk))
    return q[:, :n], k[:, :m], v[:, :m]


def batch(x: VarlenInputs, t) -> dict:
    n = len(x.parts)
    spec = x.base.spec
    variants = []  # (label, call, result, position of sequence i)
    if n > 1:
        variants.append(("inside the case's batch", x.base, x.run(t, x.base, cache=True), list(range(n))))
        rev = x.pack(x.parts[::-1], spec)
        variants.append(("inside the batch reversed", rev, x.run(t, rev), list(range(n))[::-1]))
    shorts = [_short(p, x.case, t.domain) for p in x.parts]
    mixed = x.pack([s for p, short in zip(x.parts, shorts) for s in (short, p)], spec)
    variants.append(("beside shorter sequences", mixed, x.run(t, mixed), [2 * i + 1 for i in range(n)]))
    comps = []
    for i, p in enumerate(x.parts):
        one = x.pack([p], spec)
        alone = x.seq(x.run(t, one), one, 0)
        for label, call, res, pos in variants:
            where = f"sequence {i}: alone vs {label} (position {pos[i]})"
            lazy = x.lazy(t, i, slice(None), (one, 0), (call, pos[i]))
            comps.append(pair(where, alone, x.seq(res, call, pos[i]), lazy))
    notes = [] if n > 1 else ["one sequence: compared alone vs beside a shorter one"]
    whole = [i for i, (p, short) in enumerate(zip(x.parts, shorts)) if short[0].shape[1] == p[0].shape[1]]
    if whole:  # no shorter sequence lies in the kernel's declared domain: beside a copy of itself
        notes.append(
            f"sequence {', '.join(map(str, whole))}: beside a copy of the same length (no shorter one lies "
            "in the kernel's declared domain)"
        )
    return verdict(comps, "; ".join(notes) or None)


def _decode_plan(x: VarlenInputs, t) -> tuple[dict[int, list[int]], list[str]]:
    """{r: the sequences whose last r rows can be compared}, and why the others cannot."""
    plan: dict[int, list[int]] = {}
    why: dict[str, list[int]] = {}
    for i, (q, k, _) in enumerate(x.parts):
        usable, no = decode_rows(x.case, q.shape[1], k.shape[1], t.domain)
        for r in usable:
            plan.setdefault(r, []).append(i)
        for w in no:
            why.setdefault(w, []).append(i)
    return plan, [f"{w} (sequence {', '.join(map(str, s))})" for w, s in why.items()]


def decode(x: VarlenInputs, t) -> dict:
    longest = max(p[0].shape[1] for p in x.parts)
    if longest <= min(DECODE_ROWS):
        return {"result": "not applicable", "reason": f"seqlen_q {longest}: the last row alone is the full call"}
    plan, why = _decode_plan(x, t)
    if not plan:
        return {"result": "not applicable", "reason": "; ".join(why)}
    base = x.base
    full = x.run(t, base, cache=True)
    comps = []
    for r, seqs in sorted(plan.items()):
        step = x.pack([x.parts[i] for i in seqs], base.spec, last=r)
        res = x.run(t, step)
        for j, i in enumerate(seqs):
            sq = x.parts[i][0].shape[1]
            rows = slice(sq - r, sq)
            where = f"sequence {i}, last {r} row(s): decode call vs prefill"
            lazy = x.lazy(t, i, rows, (step, j), (base, i))
            comps.append(pair(where, x.seq(res, step, j), x.seq(full, base, i, rows), lazy))
    return verdict(comps, "; ".join(why) or None)


def _against(x: VarlenInputs, t, label: str, a: tuple, b: tuple) -> list[dict]:
    """Per sequence, call a's result against call b's (each (call, result))."""
    (ca, ra), (cb, rb) = a, b
    return [
        pair(f"sequence {i}: {label}", x.seq(ra, ca, i), x.seq(rb, cb, i), x.lazy(t, i, slice(None), (ca, i), (cb, i)))
        for i in range(len(x.parts))
    ]


def _note_or_skip(refused: list[str], comps: list[dict], note: str | None) -> str | None:
    """The property's note, naming the variants the kernel declined; Refused (the property is
    skipped) when it declined every one."""
    if not comps:
        raise Refused("; ".join(refused))
    return "; ".join([*refused, *([note] if note else [])]) or None


def split(x: VarlenInputs, t) -> dict:
    ns = sorted({*SPLITS, *([x.case.num_splits] if x.case.num_splits > 1 else [])})
    one = x.full(num_splits=1)
    a = (one, x.run(t, one, cache=True))
    comps, refused = [], []
    for n in ns:
        call = x.full(num_splits=n)
        res = x.try_run(t, call)
        if isinstance(res, Refused):
            refused.append(f"num_splits {n}: {res}")
            continue
        comps += _against(x, t, f"num_splits 1 vs {n}", a, (call, res))
    if t.arch is None:
        note = "no forward bound for this kernel's numerics: split holds only where the results are equal bitwise"
    else:
        note = "bound: numerics.forward_bound with its split-KV terms"
    return verdict(comps, _note_or_skip(refused, comps, note), within_bound_holds=True)


def paged(x: VarlenInputs, t) -> dict:
    sizes = sorted({*PAGE_SIZES, *([x.case.page_size] if x.case.page_size else [])})
    contig = x.full(page=0)
    c = (contig, x.run(t, contig, cache=True))
    comps, refused, prev = [], [], None
    for size in sizes:
        call = x.full(page=size)
        res = x.try_run(t, call)
        if isinstance(res, Refused):
            refused.append(f"page size {size}: {res}")
            continue
        comps += _against(x, t, f"contiguous KV vs pages of {size}", c, (call, res))
        if prev is not None:
            comps += _against(x, t, f"pages of {prev[0].spec.page} vs {size}", prev, (call, res))
        prev = (call, res)
    return verdict(comps, _note_or_skip(refused, comps, None))


def pack_gqa(x: VarlenInputs, t) -> dict:
    if x.hq == x.hk:
        return {"result": "not applicable", "reason": f"not a GQA case (heads_q {x.hq} == heads_kv {x.hk})"}
    on, off = x.full(pack_gqa=True), x.full(pack_gqa=False)
    a, b = (on, x.run(t, on, cache=True)), (off, x.run(t, off, cache=True))
    return verdict(_against(x, t, "pack_gqa on vs off", a, b), None)
