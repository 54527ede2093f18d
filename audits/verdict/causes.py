"""Why a failing case fails: cause hypotheses, each tested against the data (docs/diagnosis.md,
"Causes"), reported in ``case["diagnosis"]["causes"]``, best first."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from audits.suites.inputs import sequence_case
from audits.verdict.diagnosis import CaseTensors, forward_tiles
from audits.verdict.nonfinite import nan_leak_cause, overflow_cause, runs
from audits.verdict.vocabulary import CAUSES, Cause
from numerics.call import AttentionCall
from numerics.reference import attention_reference, visible_mask

__all__ = [
    "Cause", "CAUSES", "MIN_SCORE", "FALLBACK_ULPS", "MAX_SCORES", "data_causes", "edge_variants", "explained",
    "rank_causes", "score_of",
]  # fmt: skip


# ---- the tested hypotheses --------------------------------------------------------------------
#
# Every hypothesis H that recomputes a reference is scored the same way (docs/diagnosis.md,
# "Causes"), per element of out and the LSE:
#   violating   the kernel is past the element's tolerance from the FP64 reference (the bound),
#   predicted   H's reference is past it too: H says this element moves,
#   explained   violating, predicted, and the kernel within tolerance of H's reference;
# score = (explained / violating) x (explained / predicted): the share of the failure H accounts
# for times the share of its own prediction the kernel bears out.  A hypothesis that moves
# nothing the kernel got wrong, or moves much that the kernel got right, scores near 0.

#: a cause is reported when it explains at least this much (score, module comment above): half
#: the violations at half the precision, or a quarter of them exactly (a bug of two causes, say
#: rows written into the wrong batch and the rows left unwritten, gets both)
MIN_SCORE = 0.25
#: score elements (batch x heads x rows x keys) one recomputed reference may hold: 2**24 float64
#: values are 128 MiB; a larger case is scored on a sample of its rows (violating and clean)
MAX_SCORES = 2**24
#: output ULPs a kernel may differ from a reference when no bound was computed (``out_bound``
#: None): a correct flash-attention result is within a few ULPs of the row's largest output
FALLBACK_ULPS = 4
#: key tiles the dropped-tile hypothesis tries at most (those seen by the most violating rows)
MAX_TILES = 16
#: kv heads the head-mapping search reads each query head from at most
MAX_KV_SEARCH = 16
#: violating rows the row-matching search (misplaced_rows) compares with every reference row
MAX_ROW_SAMPLE = 512
#: reference rows that search compares them with at most (else: the same head only)
MAX_ROW_CANDIDATES = 1 << 15

_LOG2E = math.log2(math.e)


@dataclass
class _Scope:
    """The part of a case the hypotheses are scored on: batches ``b``, query rows ``rows`` (None:
    all), the inputs and tensors sliced to them (float64; out (B, R, H, Dv), lse (B, H, R)), the
    tolerance per element, the violating / checked masks."""

    b: torch.Tensor
    rows: torch.Tensor | None
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    call: AttentionCall
    out: torch.Tensor
    ref: torch.Tensor
    tol: torch.Tensor
    viol: torch.Tensor
    checked: torch.Tensor
    eps: float
    lse: torch.Tensor | None = None
    ref_lse: torch.Tensor | None = None
    ltol: torch.Tensor | None = None
    lviol: torch.Tensor | None = None
    lchecked: torch.Tensor | None = None
    seqlen_q: int = 0
    sample: str = ""  # "" when every row of the violating batches is scored, else what was kept


def _tolerances(t: CaseTensors) -> tuple:
    """(out tol, out violating, out checked, lse tol, lse violating, lse checked, eps) over the
    whole case: the bound where it is finite, else FALLBACK_ULPS ULPs of the row's largest |ref|."""
    out, ref = t.out.double(), t.ref.double()
    eps = float(torch.finfo(t.out.dtype).eps) if t.out.dtype.is_floating_point else 2.0**-8
    fin = torch.isfinite(ref)
    scale = torch.where(fin, ref.abs(), torch.zeros_like(ref)).amax(-1, keepdim=True)
    fallback = FALLBACK_ULPS * eps * scale + 1e-300
    tol = fallback.expand_as(ref).clone()
    if t.out_bound is not None:
        b = t.out_bound.double()
        tol = torch.where(torch.isfinite(b), b, tol)
    viol = fin & ~((out - ref).abs() <= tol)
    lt = lv = lc = None
    if t.lse is not None and t.ref_lse is not None and t.lse.shape == t.ref_lse.shape:
        a, r = t.lse.double(), t.ref_lse.double()
        lc = torch.isfinite(r)
        lt = 1e-4 * (1 + torch.where(lc, r.abs(), torch.zeros_like(r)))
        if t.lse_bound is not None:
            lb = t.lse_bound.double()
            lt = torch.where(torch.isfinite(lb), lb, lt)
        lv = lc & ~((a - r).abs() <= lt)
    return tol, viol, fin, lt, lv, lc, eps


def _scope(t: CaseTensors, tols: tuple) -> _Scope | None:
    """The rows the recomputing hypotheses score on (:class:`_Scope`): the batches holding
    violations, every row when they fit in :data:`MAX_SCORES`, else the violating rows and as
    many clean ones, evenly sampled (a mask or score mod sees its own indices: such a case is
    scored whole or not at all)."""
    case, x = t.case, t.inputs
    tol, viol, fin, lt, lv, lc, eps = tols
    call = AttentionCall.from_kwargs(**x["kw"])
    mods = call.score_mod is not None or call.has_mask_mods
    bad_b = viol.flatten(1).any(1) | (lv.flatten(1).any(1) if lv is not None else False)
    b = torch.nonzero(bad_b).flatten().cpu()
    if not len(b):
        return None
    sq, sk, hq = case.seqlen_q, case.seqlen_k, case.heads_q
    rows, sample = None, ""
    if len(b) * hq * sq * sk > MAX_SCORES:
        if mods:
            return None
        b = b[: max(1, MAX_SCORES // (hq * sq * sk))]
        n = max(1, MAX_SCORES // (len(b) * hq * sk))
        if n < sq:
            bad_r = viol[b].any(-1).any(-1).any(0).cpu()
            bad_r |= lv[b].any(1).any(0).cpu() if lv is not None else False
            br, cr = torch.nonzero(bad_r).flatten(), torch.nonzero(~bad_r).flatten()
            take = lambda idx, m: idx[torch.linspace(0, len(idx) - 1, min(m, len(idx))).long()] if len(idx) else idx
            br = take(br, max(1, n // 2))
            rows = torch.sort(torch.cat([br, take(cr, n - len(br))])).values
            sample = f"{len(rows)} of {sq} rows sampled"
    dev = t.out.device
    bd = b.to(dev)
    sl = lambda z: z[bd] if rows is None else z[bd][:, rows.to(dev)]
    sll = lambda z: z[bd] if rows is None else z[bd][:, :, rows.to(dev)]
    sc = _Scope(
        b=b,
        rows=rows,
        q=sl(x["q"]),
        k=x["k"][bd],
        v=x["v"][bd],
        call=call,
        out=sl(t.out.double()),
        ref=sl(t.ref.double()),
        tol=sl(tol),
        viol=sl(viol),
        checked=sl(fin),
        eps=eps,
        seqlen_q=sq,
        sample=sample,
    )
    if lv is not None:
        sc.lse, sc.ref_lse, sc.ltol = sll(t.lse.double()), sll(t.ref_lse.double()), sll(lt)
        sc.lviol, sc.lchecked = sll(lv), sll(lc)
    return sc


def _recompute(sc: _Scope, *, factor: float = 1.0, window=None, kv=None, drop=None) -> tuple:
    """The FP64 reference (out, lse) of the scope under one changed assumption: the score scale
    times ``factor``, the effective (left, right) ``window`` (causal folded in), query head h
    reading kv head ``kv[h]``, the keys ``drop`` (bool (seqlen_k,)) hidden from every row."""
    call, d = sc.call, sc.q.shape[-1]
    sq, sk, hq = sc.seqlen_q, sc.k.shape[1], sc.q.shape[2]
    left, right = call.effective_window() if window is None else window
    scale = call.scale(d) * factor
    dev = sc.q.device
    key_mask = None
    if sc.rows is None and (call.score_mod is not None or call.has_mask_mods):  # mods see their own indices
        c2 = replace(call, softmax_scale=scale, causal=False, window_size=(left, right))
    else:
        c2 = replace(call, softmax_scale=scale, causal=False, window_size=(None, None))
        key_mask = visible_mask(sq, sk, window_size=(left, right), device=dev)
        if sc.rows is not None:
            key_mask = key_mask[sc.rows.to(dev)]
    if drop is not None:
        keep = ~drop.to(dev)
        key_mask = keep.expand(sc.q.shape[1], sk) if key_mask is None else key_mask & keep
    if key_mask is not None:
        key_mask = key_mask.expand(hq, *key_mask.shape)
    k, v = sc.k, sc.v
    if kv is not None:
        idx = torch.as_tensor(kv, device=dev)
        k, v = k[:, :, idx], v[:, :, idx]
    out, lse = attention_reference(sc.q, k, v, call=c2, return_lse=True, key_mask=key_mask)
    return out, lse


def explained(
    got: torch.Tensor,
    ref: torch.Tensor,
    hyp: torch.Tensor,
    tol: torch.Tensor,
    viol: torch.Tensor,
    checked: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One tensor's (explained, predicted) masks under a hypothesis (module comment above): the
    kernel's ``got``, the FP64 ``ref``, the hypothesis' ``hyp``, the tolerance ``tol``, the
    ``viol``-ating and ``checked`` elements, ``eps`` the kernel dtype's (its last-ULP slack).
    Shared by the gradients' hypotheses (``audits.verdict.grad_causes``)."""
    # NaN where the hypothesis' reference is NaN is its prediction met (NaN != NaN otherwise
    # leaves a leak the hypothesis explains unexplained: a causal mask ignored on NaN keys)
    close = ((got - hyp).abs() <= tol + eps * hyp.abs()) | (got == hyp) | (torch.isnan(got) & torch.isnan(hyp))
    pred = checked & ~((hyp - ref).abs() <= tol)
    return viol & pred & close, pred  # fmt: skip


def _counts(
    sc: _Scope, out_h: torch.Tensor, lse_h: torch.Tensor | None, *, mask=None, lse_mask=None
) -> tuple[int, int, int]:
    """(explained, violating, predicted) of one hypothesis' reference (module comment above);
    ``mask``: only these out elements count, and their rows' LSE unless ``lse_mask`` says which."""
    parts = [(*explained(sc.out, sc.ref, out_h, sc.tol, sc.viol, sc.checked, sc.eps), sc.viol)]
    if sc.lse is not None and lse_h is not None:
        parts.append((*explained(sc.lse, sc.ref_lse, lse_h, sc.ltol, sc.lviol, sc.lchecked, 0.0), sc.lviol))
    e = v = p = 0
    for i, (expl, pred, viol) in enumerate(parts):
        if i == 0 or lse_mask is not None:
            m = mask if i == 0 else lse_mask
        else:  # the LSE of the rows the out mask touches
            m = None if mask is None else mask.any(-1).permute(0, 2, 1)
        if m is not None:
            expl, viol, pred = expl & m, viol & m, pred & m
        e, v, p = e + int(expl.sum()), v + int(viol.sum()), p + int(pred.sum())
    return e, v, p


def score_of(counts: tuple[int, int, int]) -> float:
    """(explained / violating) x (explained / predicted) of (explained, violating, predicted)
    counts; 0 when any is 0 (module comment above)."""
    e, v, p = counts
    return 0.0 if not (e and v and p) else (e / v) * (e / p)


def _evidence(what: str, counts: tuple[int, int, int], sc: _Scope | None = None) -> str:
    e, v, p = counts
    where = f" ({sc.sample})" if sc is not None and sc.sample else ""
    return (
        f"the FP64 reference {what} matches {e:,} of the {v:,} violating elements{where} "
        f"({e / v:.0%}), and the kernel follows it at {e / p:.0%} of the {p:,} elements it moves"
    )


# ---- softmax_scale ----------------------------------------------------------------------------


def _scale_candidates(d: int, dv: int, scale: float) -> list[tuple[float, str]]:
    """Factors c a kernel's scale is commonly off by, with their names."""
    cands = [
        (math.sqrt(d / dv), f"sqrt(d/dv) = sqrt({d}/{dv})"),
        (math.sqrt(dv / d), f"sqrt(dv/d) = sqrt({dv}/{d})"),
        (1 / scale, f"1/scale: the scale {scale:.4g} never applied"),
        (scale, f"scale = {scale:.4g} applied twice"),
        (_LOG2E, "log2(e): the exp2 scale applied to exp"),
        (1 / _LOG2E, "1/log2(e) = ln 2: exp2 of natural-log scores"),
    ]
    return [(c, n) for c, n in cands if abs(math.log(c)) > 1e-3]


def _softmax_scale(sc: _Scope, case) -> Cause | None:
    """Fit c (scores times c) to the violating elements: the named candidates and a log grid,
    then golden-section search on the mean log(1 + |out - out_c| / tol); scored at the fit (or
    the named candidate within 1 % of it)."""
    fit_sc = _row_sample(sc, 32)
    sel = fit_sc.viol & torch.isfinite(fit_sc.out)
    if not bool(sel.any()):
        return None

    def loss(logc: float) -> float:
        o, _ = _recompute(fit_sc, factor=math.exp(logc))
        return float(torch.log1p((fit_sc.out - o).abs()[sel] / fit_sc.tol[sel]).mean())

    cands = _scale_candidates(case.d, case.dv, sc.call.scale(case.d))
    grid = sorted({round(x, 6) for x in torch.linspace(-3, 3, 25).tolist()} | {math.log(c) for c, _ in cands})
    vals = [loss(g) for g in grid]
    i = min(range(len(grid)), key=lambda j: vals[j])
    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    g = (math.sqrt(5) - 1) / 2
    a, bb = hi - g * (hi - lo), lo + g * (hi - lo)
    fa, fb = loss(a), loss(bb)
    for _ in range(24):
        if fa < fb:
            hi, bb, fb = bb, a, fa
            a = hi - g * (hi - lo)
            fa = loss(a)
        else:
            lo, a, fa = a, bb, fb
            bb = lo + g * (hi - lo)
            fb = loss(bb)
    c = math.exp((lo + hi) / 2)
    if abs(math.log(c)) < 5e-3:
        return None
    named = [(cc, n) for cc, n in cands if abs(math.log(cc / c)) < 0.01]
    c_used, name = (named[0][0], named[0][1]) if named else (c, "")
    o, lse = _recompute(sc, factor=c_used)
    counts = _counts(sc, o, lse)
    s = score_of(counts)
    if s <= 0:
        return None
    detail = f"c = {c:.4g}" + (f" ({name})" if name else "")
    what = f"recomputed with the scores times c = {c_used:.4g}" + (f" ({name})" if name else " (fitted)")
    return Cause("softmax_scale", detail, _evidence(what, counts, sc), s)


def _row_sample(sc: _Scope, n: int) -> _Scope:
    """``sc`` cut to at most ``n`` of its violating rows (the fit's objective reads only them);
    a case with mods keeps its scope (its mods see their own indices)."""
    if sc.call.score_mod is not None or sc.call.has_mask_mods:
        return sc
    bad = sc.viol.any(-1).any(-1).any(0)
    idx = torch.nonzero(bad).flatten()
    if not len(idx) or len(idx) == bad.numel() and len(idx) <= n:
        return sc
    idx = idx[torch.linspace(0, len(idx) - 1, min(n, len(idx))).long()]
    base = sc.rows.to(idx.device)[idx] if sc.rows is not None else idx
    return replace(
        sc,
        rows=base.cpu(),
        q=sc.q[:, idx],
        out=sc.out[:, idx],
        ref=sc.ref[:, idx],
        tol=sc.tol[:, idx],
        viol=sc.viol[:, idx],
        checked=sc.checked[:, idx],
        lse=None,
    )


# ---- mask_edge --------------------------------------------------------------------------------


def edge_variants(case, call: AttentionCall) -> list[tuple[tuple, str]]:
    """((left, right) effective window, detail) of each mask-edge hypothesis of the call."""
    left, right = call.effective_window()
    right_name = "causal_diagonal" if case.causal else "window_right"
    out = []
    if left is not None:
        out.append(((left + 1, right), "window_left admits one key too many"))
        if left >= 1:
            out.append(((left - 1, right), "window_left admits one key too few"))
    if right is not None:
        out.append(((left, right + 1), f"{right_name} admits one key too many"))
        out.append(((left, right - 1), f"{right_name} admits one key too few"))
    off = case.seqlen_k - case.seqlen_q
    if off and (left is not None or right is not None):
        w = (None if left is None else left + off, None if right is None else right - off)
        out.append((w, f"seqlen offset ignored: mask aligned top-left, not bottom-right (s_k - s_q = {off})"))
    if case.causal:
        out.append(((left, None), "causal mask ignored"))
    elif case.local:
        out.append(((None, None), "window ignored"))
    if left is not None and right is not None:  # one edge ignored, the other kept
        out.append(((None, right), "window_left ignored"))
    if right is None:
        out.append(((left, 0), "causal mask applied where none was asked"))
        if off:
            out.append(((left, -off), "causal mask (top-left aligned) applied where none was asked"))
    return out


def _mask_edge(sc: _Scope, case) -> Cause | None:
    best = None
    for window, detail in edge_variants(case, sc.call):
        o, lse = _recompute(sc, window=window)
        counts = _counts(sc, o, lse)
        s = score_of(counts)
        if s > 0 and (best is None or s > best.score):
            what = f"recomputed with the effective window (left, right) = {window} ({detail})"
            best = Cause("mask_edge", detail, _evidence(what, counts, sc), s)
    return best


# ---- head_mapping -----------------------------------------------------------------------------


def _head_mapping(sc: _Scope, case) -> Cause | None:
    """Per query head, the kv head whose recomputed reference explains its violations best
    (every kv head tried, at most :data:`MAX_KV_SEARCH`); the mapping found, scored whole."""
    hq, hkv = case.heads_q, case.heads_kv
    if hkv < 2 or hkv > MAX_KV_SEARCH:
        return None
    group = hq // hkv
    own = [h // group for h in range(hq)]
    per_head = sc.viol.sum((0, 1, 3))
    if sc.lviol is not None:
        per_head = per_head + sc.lviol.sum((0, 2))
    found = list(own)
    best_e = [0] * hq
    for g in range(hkv):
        o, lse = _recompute(sc, kv=[g] * hq)
        for h in range(hq):
            if g == own[h] or not int(per_head[h]):
                continue
            m = torch.zeros_like(sc.viol)
            m[:, :, h] = True
            e, v, p = _counts(sc, o, lse, mask=m)
            if e * 2 > v and e > best_e[h]:
                found[h], best_e[h] = g, e
    if found == own:
        return None
    o, lse = _recompute(sc, kv=found)
    counts = _counts(sc, o, lse)
    s = score_of(counts)
    if s <= 0:
        return None
    if found == [h % hkv for h in range(hq)]:
        detail = f"query head h reads kv head h % {hkv} instead of h // {group}"
    else:
        moved = [h for h in range(hq) if found[h] != own[h]]
        groups = {}
        for h in moved:
            groups.setdefault((found[h], own[h]), []).append(h)
        detail = "; ".join(
            f"query head{'s' if len(hs) > 1 else ''} {runs(hs)} read{'s' if len(hs) == 1 else ''} kv head {g} "
            f"instead of {o_}"
            for (g, o_), hs in groups.items()
        )
    return Cause(
        "head_mapping", detail, _evidence(f"recomputed with query head h reading kv head {found}", counts, sc), s
    )


# ---- misplaced_rows ---------------------------------------------------------------------------


def _misplaced_rows(t: CaseTensors, tols: tuple) -> Cause | None:
    """Violating output rows matched (to tolerance) with reference rows of another batch, row or
    head (nearest in L2, then checked element-wise); the most common offsets tried as a whole
    hypothesis: every row holds the reference row at that offset (rows outside: their own)."""
    tol, viol, fin, lt, lv, lc, eps = tols
    out, ref = t.out.double(), t.ref.double()
    B, S, H, D = ref.shape
    rows_bad = torch.nonzero(viol.any(-1))  # (n, 3): b, i, h
    if not len(rows_bad):
        return None
    rows_bad = rows_bad[torch.linspace(0, len(rows_bad) - 1, min(MAX_ROW_SAMPLE, len(rows_bad))).long()]
    cross_heads = B * S * H <= MAX_ROW_CANDIDATES
    if not cross_heads and B * S > MAX_ROW_CANDIDATES:
        return None
    refz = torch.where(torch.isfinite(ref), ref, torch.zeros_like(ref))
    offsets = {}
    for h in range(H) if not cross_heads else [None]:
        sel = rows_bad if h is None else rows_bad[rows_bad[:, 2] == h]
        if not len(sel):
            continue
        cand = refz.reshape(-1, D) if h is None else refz[:, :, h].reshape(-1, D)
        got = out[sel[:, 0], sel[:, 1], sel[:, 2]]
        ok = torch.isfinite(got).all(-1)
        if not bool(ok.any()):
            continue
        sel, got = sel[ok], got[ok]
        near = torch.cdist(got, cand).argmin(-1)
        if h is None:
            nb, rest = near // (S * H), near % (S * H)
            ni, nh = rest // H, rest % H
        else:
            nb, ni, nh = near // S, near % S, torch.full_like(near, h)
        close = ((got - ref[nb, ni, nh]).abs() <= tol[nb, ni, nh] + eps * ref[nb, ni, nh].abs()).all(-1)
        for (b, i, hh), b2, i2, h2, c in zip(sel.tolist(), nb.tolist(), ni.tolist(), nh.tolist(), close.tolist()):
            if c and (b2, i2, h2) != (b, i, hh):
                key = (b2 - b, i2 - i, h2 - hh)
                offsets[key] = offsets.get(key, 0) + 1
    best, sc = None, _whole_scope(t, tols)
    for key, _ in sorted(offsets.items(), key=lambda kv: -kv[1])[:3]:
        o_h, l_h = _shifted(ref, t.ref_lse, key)
        counts = _counts(sc, o_h, l_h if lv is not None else None)
        s = score_of(counts)
        if s > 0 and (best is None or s > best.score):
            pred = fin & ~((o_h - ref).abs() <= tol)
            held = viol & pred & ((out - o_h).abs() <= tol + eps * o_h.abs())
            detail = _offset_words(key, held)
            what = f"with each row replaced by its row at offset (batch, row, head) {key}"
            best = Cause("misplaced_rows", detail, _evidence(what, counts), s)
    return best


def _whole_scope(t: CaseTensors, tols: tuple) -> _Scope:
    """The whole case as the scope a hypothesis that rearranges the reference is scored on (every
    batch and row; the call is not needed: nothing is recomputed from it)."""
    tol, viol, fin, lt, lv, lc, eps = tols
    x = t.inputs
    sc = _Scope(b=torch.arange(t.ref.shape[0]), rows=None, q=x["q"], k=x["k"], v=x["v"], call=None,
                out=t.out.double(), ref=t.ref.double(), tol=tol, viol=viol, checked=fin, eps=eps)  # fmt: skip
    if lv is not None:
        sc.lse, sc.ref_lse, sc.ltol, sc.lviol, sc.lchecked = t.lse.double(), t.ref_lse.double(), lt, lv, lc
    return sc


def _shifted(ref: torch.Tensor, ref_lse: torch.Tensor | None, key: tuple) -> tuple:
    """The reference with every (b, i, h) row replaced by row (b + db, i + di, h + dh) where
    that exists (``key`` = (db, di, dh)); the LSE alike."""
    db, di, dh = key
    B, S, H, _ = ref.shape
    o = ref.clone()
    lse = None if ref_lse is None else ref_lse.double().clone()
    src = lambda n, d: (slice(max(0, d), n + min(0, d)), slice(max(0, -d), n - max(0, d)))
    (sb, tb), (si, ti), (sh, th) = src(B, db), src(S, di), src(H, dh)
    o[tb, ti, th] = ref[sb, si, sh]
    if lse is not None:
        lse[tb, th, ti] = ref_lse.double()[sb, sh, si]
    return o, lse


def _offset_words(key: tuple, held: torch.Tensor) -> str:
    """The misplacement in words, from the rows it explains (``held``, out's shape): which
    batch is written into which, and how many rows or heads away."""
    db, di, dh = key
    bs = torch.nonzero(held.flatten(1).any(1)).flatten().tolist()
    dst, src = runs(bs), runs(b + db for b in bs)
    rows = f"{abs(di)} row{'s' if abs(di) > 1 else ''} {'down' if di < 0 else 'up'}"
    if db and di:
        words = f"batch {src} written into batch {dst}'s rows, {rows}"
    elif db:
        words = f"batch {dst} written with batch {src}'s output (batch b{db:+d})"
    else:
        words = f"rows written {rows}: row i holds reference row i{di:+d}" if di else ""
    return "; ".join(w for w in (words, f"head h holds head h{dh:+d}'s output" if dh else "") if w)


# ---- misplaced_rows: a batch addressed without its stride -------------------------------------


#: the batch-stride hypotheses in words, by the stride taken
_STRIDE_WORDS = {
    1: "batch z addressed as batch 0's rows z rows down (the batch stride taken as 1 row): read and written there",
    0: "every batch addressed as batch 0 (the batch stride taken as 0): batch 0's rows written by every batch",
}


def _batch_stride(t: CaseTensors, tols: tuple) -> Cause | None:
    """A kernel that addresses the (batch, head, row) rows of q, k, v and out flattened head-major
    (batch, head, seqlen: the layout ``(Z, H, N, D)`` of many Triton kernels) at ``z·s + h·N``
    instead of ``(z·H + h)·N``: with ``s`` 1 (the batch stride taken as one row; Triton's
    fused-attention tutorial, ``_attn_fwd_tma``'s ``offset_y = off_z + off_h * N_CTX``) batch z's
    programs read and write batch 0's rows z rows down, with ``s`` 0 (the batch ignored) batch 0's
    rows themselves.  The FP64 prediction runs every (z, h) program on the rows it addresses
    (rows past the tensor's end read as zeros, as a TMA load of them does) and writes its output
    where it addresses them, its LSE at its own row (the tutorial addresses M correctly).

    Two kinds of rows are scored apart.  Rows two programs write (batch 0's own program and a
    later batch's) race: either write may land, tile by tile, and on the H200 (2026-12-04) batch 0
    ended correct on some of the tutorial's cases and moved on others.  The prediction there is
    the later batch's; where the kernel holds the reference instead (the other write landed) the
    element is consistent with the hypothesis and not counted against it.  Rows no program
    addresses are never written: their violations are left out of the count (whatever they hold is
    what the hypothesis allows; ``unwritten_output`` is the poisoned runs' to name) and said in
    the evidence.  Only where the heads and sequence lengths of q and k/v agree and no mod sees
    its indices."""
    x = t.inputs
    q, k, v = x["q"], x["k"], x["v"]
    B, S, H, D = q.shape
    if B < 2 or k.shape[1:3] != (S, H) or B * H * S * S > MAX_SCORES:  # as one recomputation may hold
        return None
    call = AttentionCall.from_kwargs(**x["kw"])
    if call.score_mod is not None or call.has_mask_mods:
        return None
    flat = [u.double().permute(0, 2, 1, 3).reshape(B * H * S, -1) for u in (q, k, v)]
    dv = flat[2].shape[-1]
    sink = call.learnable_sink
    best, sc = None, _whole_scope(t, tols)
    for stride in (1, 0):
        pred = t.ref.double().permute(0, 2, 1, 3).reshape(B * H * S, dv).clone()
        lse = None if t.ref_lse is None else t.ref_lse.double().clone()
        written = torch.zeros(B * H * S, dtype=torch.bool)
        written[: H * S] = True  # batch 0's programs address their own rows, whatever the stride
        contested = torch.zeros_like(written)
        for z in range(1, B):
            for h in range(H):
                start = z * stride + h * S
                contested[start : start + S] |= written[start : start + S]
                written[start : start + S] = True
                rows = [
                    torch.cat([u[start : start + S], u.new_zeros(max(0, start + S - len(u)), u.shape[1])]) for u in flat
                ]
                one = replace(call, learnable_sink=None if sink is None else sink[h : h + 1])
                o, l1 = attention_reference(*(r.view(1, S, 1, -1) for r in rows), call=one, return_lse=True)
                end = min(start + S, len(pred))
                pred[start:end] = o.view(S, dv)[: end - start]
                if lse is not None:
                    lse[z, h] = l1.view(S)
        o_h = pred.view(B, H, S, dv).permute(0, 2, 1, 3)
        as_case = lambda rows: rows.view(B, H, S).permute(0, 2, 1).unsqueeze(-1).to(sc.viol.device)  # noqa: E731
        unwritten, raced = as_case(~written), as_case(contested)
        mask = ~unwritten & ~(raced & ~sc.viol)  # (B, S, H, Dv): the rows it predicts, moved where raced
        lse_mask = None if sc.lviol is None else torch.ones_like(sc.lviol)
        counts = _counts(sc, o_h, lse if tols[4] is not None else None, mask=mask, lse_mask=lse_mask)
        score = score_of(counts)
        if score > 0 and (best is None or score > best.score):
            detail = _STRIDE_WORDS[stride]
            what = f"with batch z's programs on the rows z·{stride} + h·seqlen of the head-major rows"
            left = int((sc.viol & unwritten).sum())
            silent = int((~written).sum())
            said = _evidence(what, counts) + (
                "; a row two programs write may hold either write (they race): it counts against the prediction "
                "only where the kernel holds neither"
                if bool(contested.any())
                else ""
            )
            if left:
                said += (
                    f"; the {left:,} violating elements in the {silent:,} rows no program addresses are not counted "
                    "(never written, as it predicts: the poisoned runs tell)"
                )
            best = Cause("misplaced_rows", detail, said, score)
    return best


# ---- dropped_tile -----------------------------------------------------------------------------


def _dropped_tile(sc: _Scope, t: CaseTensors) -> Cause | None:
    """The reference recomputed with one key tile hidden from every row, for the tiles the
    violating rows see (at most :data:`MAX_TILES`, the most seen first)."""
    case = t.case
    tile_n = forward_tiles(case=case, numerics=t.numerics, kind=t.kind)[1]
    sk = case.seqlen_k
    nt = -(-sk // tile_n)
    if nt < 2:
        return None
    rows = torch.arange(case.seqlen_q) if sc.rows is None else sc.rows
    vis = visible_mask(case.seqlen_q, sk, causal=case.causal, window_size=tuple(case.window))[rows]
    bad = sc.viol.any(-1).any(-1).any(0).cpu()
    seen = torch.stack([vis[bad, j * tile_n : (j + 1) * tile_n].any(1).sum() for j in range(nt)])
    order = [int(j) for j in torch.argsort(seen, descending=True, stable=True) if int(seen[j]) > 0][:MAX_TILES]
    best = None
    for j in sorted(order):
        drop = torch.zeros(sk, dtype=torch.bool)
        lo, hi = j * tile_n, min(sk, (j + 1) * tile_n)
        drop[lo:hi] = True
        o, lse = _recompute(sc, drop=drop)
        counts = _counts(sc, o, lse)
        s = score_of(counts)
        if s > 0 and (best is None or s > best.score):
            detail = f"keys {lo}..{hi - 1} (tile {j} of {tile_n} keys) dropped"
            best = Cause(
                "dropped_tile", detail, _evidence(f"recomputed with keys {lo}..{hi - 1} hidden", counts, sc), s
            )
    return best


# ---- the entry point --------------------------------------------------------------------------


def data_causes(*, case, tensors: CaseTensors, rec: dict, th: dict) -> list[Cause]:
    """The cause hypotheses of a failing case that its data bears out, best first (score
    descending; scores equal to 0.01 tie, taken in :data:`CAUSES` order), each at least
    :data:`MIN_SCORE`; [] when none fits, when nothing is past its tolerance, or when the case
    cannot be recomputed here (a varlen case with mods, a case that did not run, one without its inputs;
    ``rec`` is the case's record, ``th`` its thresholds).  Each hypothesis recomputes an FP64
    reference with one assumption changed (overflow and nan_leak inspect the intermediates and
    the inputs instead) and is scored by how much of the failure it explains (module comment,
    "the tested hypotheses"); docs/diagnosis.md, "Causes", has the vocabulary.  Why tested and
    not read from the configuration: a causal case that fails need not fail at its diagonal."""
    t = tensors
    if (
        (rec or {}).get("status", "ran") != "ran"
        or t is None
        or t.inputs is None
        or t.out is None
        or t.ref is None
        or t.out.shape != t.ref.shape
    ):
        return []
    with torch.no_grad():
        found = _varlen_causes(case, t) if case.varlen else _fixed_causes(case, t)
    return rank_causes([c for c in found if c is not None and c.score >= MIN_SCORE])


def _fixed_causes(case, t: CaseTensors) -> list[Cause | None]:
    """Every hypothesis' best cause on a fixed-length case (None where one found nothing)."""
    tols = _tolerances(t)
    if not (bool(tols[1].any()) or (tols[4] is not None and bool(tols[4].any()))):
        return []
    found = [overflow_cause(t, tols), nan_leak_cause(t, tols), _misplaced_rows(t, tols), _batch_stride(t, tols)]
    sc = _scope(t, tols)
    if sc is not None and bool(sc.viol.any() | (sc.lviol.any() if sc.lviol is not None else False)):
        found += [_softmax_scale(sc, case), _mask_edge(sc, case), _head_mapping(sc, case), _dropped_tile(sc, t)]
    return found


def _varlen_causes(case, t: CaseTensors) -> list[Cause | None]:
    """A varlen case's causes (its tensors packed, batch 1; its inputs' ``parts``: per sequence
    q, k, v with the keys it uses, ``audits.suites.inputs.make_varlen_inputs``): rows moved
    along the packed tokens (``misplaced_rows`` on the packed result: a sequence written into
    its neighbour's rows), then each sequence with violations as a batch-1 fixed-length case,
    its causes weighted by its share of the case's violations and merged across sequences by
    detail ("sequences 1..3: causal_diagonal admits one key too many").  Not with mods (their
    per-sequence forms are ``fa4.varlen.sequence_mods``'), nor without the parts."""
    kw = t.inputs["kw"]
    if case.score_mod or case.mask_mod or case.block_sparse or "parts" not in t.inputs or t.out.dim() != 4:
        return []
    tols = _tolerances(t)
    viol, lv = tols[1], tols[4]
    per_seq = lambda a, b: int(viol[:, a:b].sum()) + (int(lv[:, :, a:b].sum()) if lv is not None else 0)  # noqa: E731
    cu = kw["cu_seqlens_q"].tolist()
    total = per_seq(0, cu[-1])
    if not total:
        return []
    found, merged = [_misplaced_rows(t, tols)], {}
    flags = {n: kw[n] for n in ("causal", "window_size", "softcap", "learnable_sink", "softmax_scale") if n in kw}
    for i, (qi, ki, vi) in enumerate(t.inputs["parts"]):
        a, b = cu[i], cu[i + 1]
        if b == a or not (n := per_seq(a, b)):
            continue
        sub = sequence_case(case, i, b - a, ki.shape[1])  # its used keys
        cut = lambda x, dim, a=a, b=b: None if x is None else x.narrow(dim, a, b - a)  # noqa: E731
        st = replace(t, case=sub, out=cut(t.out, 1), lse=cut(t.lse, 2), ref=cut(t.ref, 1), ref_lse=cut(t.ref_lse, 2),
                     out_bound=cut(t.out_bound, 1), lse_bound=cut(t.lse_bound, 2), grads={}, grad_refs={},
                     grad_bounds=None, inputs={"q": qi, "k": ki, "v": vi, "kw": flags})  # fmt: skip
        for c in _fixed_causes(sub, st):
            if c is not None and c.score >= MIN_SCORE:
                m = merged.setdefault((c.cause, c.detail), {"seqs": [], "score": 0.0, "evidence": c.evidence})
                m["seqs"].append(i)
                m["score"] += c.score * n / total
    for (cause, detail), m in merged.items():
        seqs = f"sequence{'s' if len(m['seqs']) > 1 else ''} {runs(m['seqs'])}"
        evidence = f"{m['evidence']} (sequence {m['seqs'][0]}; scored per sequence, weighted by its violations)"
        found.append(Cause(cause, f"{seqs}: {detail}", evidence, m["score"]))
    return found


def rank_causes(causes: list[Cause]) -> list[Cause]:
    """``causes`` best first: score descending, scores equal to 0.01 a tie taken in
    :data:`CAUSES` order (two hypotheses that both explain the data to within a percent are
    told apart by which is the more specific statement, the vocabulary's order)."""
    return sorted(causes, key=lambda c: (-round(c.score, 2), CAUSES.index(c.cause)))
