"""The cause hypotheses of non-finite results (docs/diagnosis.md, "Causes"): ``overflow`` (an
intermediate past the range of the dtype it is held in) and ``nan_leak`` (NaN/inf from keys the
row does not see), which inspect the intermediates and the inputs rather than recompute a
reference; ``audits.verdict.causes`` ranks them with the others."""

from __future__ import annotations

import math

import torch

from audits.verdict.diagnosis import CaseTensors, forward_tiles
from audits.verdict.vocabulary import Cause
from numerics.call import AttentionCall
from numerics.reference import call_visibility

__all__ = ["overflow_cause", "nan_leak_cause", "runs", "MAX_OVERFLOW_ROWS", "OVERFLOW_PRECISION"]

#: non-finite rows the overflow hypothesis inspects at most (evenly spaced; their share scaled up):
#: a 4096 x 4096 causal case with a sink had 32,762 (H200, 2026-12-04)
MAX_OVERFLOW_ROWS = 4096
#: the share of the rows where an intermediate exceeds its range that must be non-finite for the
#: overflow to be named: an overflow is deterministic, so a finite row where it is predicted
#: refutes it; the slack is for the hypothesis' model of the row max (no lazy-rescale threshold)
OVERFLOW_PRECISION = 0.9
#: finite range of the dtypes an intermediate may be held in
_RANGE = {
    torch.float16: 65504.0,
    torch.bfloat16: 3.3895313892515355e38,
    torch.float32: 3.4028234663852886e38,
    torch.float8_e4m3fn: 448.0,
    torch.float8_e5m2: 57344.0,
}


def runs(values) -> str:
    """Sorted integers as runs: "0..63, 70"; a long list as its first runs and how many."""
    vals = sorted(set(int(x) for x in values))
    runs, start = [], None
    for i, x in enumerate(vals):
        if start is None:
            start = x
        if i + 1 == len(vals) or vals[i + 1] != x + 1:
            runs.append(f"{start}..{x}" if x > start else f"{x}")
            start = None
    return ", ".join(runs[:4]) + (f" and {len(runs) - 4} more runs" if len(runs) > 4 else "")


def _bad_rows(t: CaseTensors, tols: tuple) -> torch.Tensor:
    """(b, i, h) bool: rows with a non-finite out element or LSE where the reference is finite."""
    fin = tols[2]
    rows = (fin & ~torch.isfinite(t.out.double())).any(-1)
    if tols[5] is not None:
        rows |= (tols[5] & ~torch.isfinite(t.lse.double())).permute(0, 2, 1)
    return rows


def _explained_nonfinite(t: CaseTensors, tols: tuple, rows: torch.Tensor) -> tuple[int, int]:
    """(non-finite violating elements in ``rows``, all violating elements) of out and the LSE."""
    viol, lv = tols[1], tols[4]
    e = int((viol & ~torch.isfinite(t.out.double()) & rows[..., None]).sum())
    v = int(viol.sum())
    if lv is not None:
        e += int((lv & ~torch.isfinite(t.lse.double()) & rows.permute(0, 2, 1)).sum())
        v += int(lv.sum())
    return e, v


def _row_scores(t: CaseTensors, call: AttentionCall, idx: torch.Tensor) -> torch.Tensor:
    """FP64 logits (n, seqlen_k) of the (b, i, h) rows ``idx``, the keys each row cannot see
    -inf (the flag masks; with mods their visibility too); softcap applied, score_mod not."""
    q, k = t.inputs["q"], t.inputs["k"]
    B, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    b, i, h = idx[:, 0], idx[:, 1], idx[:, 2]
    s = torch.einsum("nd,njd->nj", q[b, i, h].double(), k[b, :, h // (hq // hkv)].double()) * call.scale(d)
    if call.softcap:
        s = call.softcap * torch.tanh(s / call.softcap)
    vis = call_visibility(batch=B, heads=hq, seqlen_q=sq, seqlen_k=sk, call=call, rows=i, device=q.device)
    if vis.dim() == 4:  # mods: per batch and head
        vb = b if vis.shape[0] > 1 else torch.zeros_like(b)
        vh = h if vis.shape[1] > 1 else torch.zeros_like(h)
        vis = vis[vb, vh, torch.arange(len(idx), device=vis.device)]
    return s.masked_fill(~vis, -math.inf)


def _intermediates(t: CaseTensors, call: AttentionCall, idx: torch.Tensor, tile_n: int) -> dict:
    """Per intermediate that exceeds its range on some of the (b, i, h) rows ``idx``: (mask over
    ``idx``, detail).  P's dtype and offset are the kernel's FA4 numerics' (else the input dtype)."""
    nm, q_dt = t.numerics, t.inputs["q"].dtype
    p_dt = (getattr(nm, "p_dtype", None) or q_dt) if nm is not None else q_dt
    offset = 2.0 ** getattr(nm, "max_offset", 0) if nm is not None else 1.0
    p_range, f32 = _RANGE.get(p_dt, _RANGE[torch.float32]), _RANGE[torch.float32]
    lags, maxs, sinks = [], [], []
    for c in range(0, len(idx), 64):
        part = idx[c : c + 64]
        s = _row_scores(t, call, part)
        n, sk = s.shape
        nt = -(-sk // tile_n)
        pad = torch.full((n, nt * tile_n - sk), -math.inf, dtype=s.dtype, device=s.device)
        tmax = torch.cat([s, pad], 1).view(n, nt, tile_n).amax(-1)
        run = torch.cummax(tmax, 1).values  # the row max before each tile, had it never lagged
        lag = torch.where(torch.isfinite(run[:, :-1]), tmax[:, 1:] - run[:, :-1], torch.zeros_like(tmax[:, 1:]))
        lags.append(lag.clamp(min=0).amax(1) if nt > 1 else torch.zeros(n, dtype=s.dtype, device=s.device))
        maxs.append(torch.where(torch.isfinite(s), s.abs(), torch.zeros_like(s)).amax(1))
        if call.learnable_sink is not None:
            m = s.amax(1)
            sink = call.learnable_sink.double().to(s.device)[part[:, 2]]
            sinks.append(torch.where(torch.isfinite(m), sink - m, torch.zeros_like(m)))
    lag, smax = torch.cat(lags), torch.cat(maxs)
    found = {}
    p_big = torch.exp(lag) * offset > p_range
    if bool(p_big.any()):
        name, worst = str(p_dt).replace("torch.", ""), float(lag[p_big].min())
        ln = math.log(p_range / offset)
        found["p"] = (
            p_big,
            f"P = exp(lag) exceeds {name}'s {p_range:g} at lag {worst:.1f} nats (ln {p_range / offset:g} = {ln:.2f})",
        )
    if bool((smax > f32).any()):
        found["score"] = (smax > f32, f"a score reaches {float(smax.max()):.3g}, past float32's {f32:.3g}")
    # the sink joins the row sum, which is float32 (production's softmax.py folds it in after the
    # row loop, in the fp32 accumulator), not P's dtype
    if sinks and bool((big := torch.exp(sl := torch.cat(sinks)) > f32).any()):
        found["sink"] = (big, f"the sink term exp(sink - m) reaches exp({float(sl.max()):.1f}), past {f32:g}")
    ref = t.ref.double()
    omax = torch.where(torch.isfinite(ref), ref.abs(), torch.zeros_like(ref)).amax(-1)[idx[:, 0], idx[:, 1], idx[:, 2]]
    o_range = _RANGE.get(t.out.dtype, f32)
    if bool((omax > o_range).any()):
        name = str(t.out.dtype).replace("torch.", "")
        found["out"] = (omax > o_range, f"the output reaches {float(omax.max()):.3g}, past {name}'s {o_range:g}")
    return found


def _evenly(rows: torch.Tensor) -> torch.Tensor:
    """At most :data:`MAX_OVERFLOW_ROWS` of the (n, 3) row indices ``rows``, evenly spaced."""
    if len(rows) <= MAX_OVERFLOW_ROWS:
        return rows
    return rows[torch.linspace(0, len(rows) - 1, MAX_OVERFLOW_ROWS, device=rows.device).round().long()]


def overflow_cause(t: CaseTensors, tols: tuple) -> Cause | None:
    """Non-finite results where the reference is finite, in rows where an intermediate exceeds
    the range of the dtype it is likely held in (:func:`_intermediates`): the logit (float32),
    P = exp(lag) after a row max that rose between key tiles without a rescale (P's dtype), the
    sink term, the output.  Scored by the share of the violating elements those rows hold, times
    the share of the rows where the intermediate exceeds that are non-finite, and not named below
    :data:`OVERFLOW_PRECISION` of them: an overflow that the data predicts in rows the kernel got
    finite is refuted there (on the H200, Triton's
    tutorial left a second batch unwritten, holding NaN (most likely an earlier poisoned run's), on a case
    whose every row's max rises by 27.5 nats: "P overflows" held every NaN row, and the other
    batch's rows, with the same rise, were finite)."""
    bad = _bad_rows(t, tols)
    if not bool(bad.any()):
        return None
    every, fine = torch.nonzero(bad), torch.nonzero(~bad)
    idx, idx_fine = _evenly(every), _evenly(fine)
    scale = len(every) / len(idx)
    sampled = f" (of {len(idx):,} evenly spaced rows inspected)" if scale > 1 else ""
    tile_n = forward_tiles(case=t.case, numerics=t.numerics, kind=t.kind)[1]
    call = AttentionCall.from_kwargs(**t.inputs["kw"])
    found = _intermediates(t, call, idx, tile_n)
    # the same intermediates on the rows the kernel got finite, only where some exceed on the bad ones
    on_fine = _intermediates(t, call, idx_fine, tile_n) if found and len(idx_fine) else {}
    best = None
    for key, (m, detail) in found.items():
        rows = torch.zeros_like(bad)
        sel = idx[m.to(idx.device)]
        rows[sel[:, 0], sel[:, 1], sel[:, 2]] = True
        e, v = _explained_nonfinite(t, tols, rows)
        e = min(v, round(e * scale))
        # rows where it exceeds yet the result is finite, scaled to all finite rows
        contra = float(on_fine[key][0].sum()) * len(fine) / len(idx_fine) if key in on_fine else 0.0
        hit = float(m.sum()) * scale
        precision = hit / (hit + contra)
        score = e / v * precision
        if e and precision >= OVERFLOW_PRECISION and (best is None or score > best.score):
            held = "holds" if scale == 1 else "hold, scaled to all of them,"
            against = f"; it also exceeds in {round(contra):,} rows the kernel got finite" if contra else ""
            ev = (
                f"{len(every):,} rows are non-finite where the FP64 reference is finite; in "
                f"{int(m.sum()):,} of them{sampled} {detail.split(' (')[0]} (key tiles of {tile_n}), which {held} "
                f"{e:,} of the {v:,} violating elements ({e / v:.0%}){against}"
            )
            best = Cause("overflow", detail, ev, score)
    return best


def nan_leak_cause(t: CaseTensors, tols: tuple) -> Cause | None:
    """Non-finite results where the reference is finite, on rows whose visible keys and query
    are finite but whose masked keys hold NaN/inf: the mask let them through."""
    bad = _bad_rows(t, tols)
    if not bool(bad.any()):
        return None
    q, k, v = t.inputs["q"], t.inputs["k"], t.inputs["v"]
    B, sq, hq, _ = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    kbad = ~torch.isfinite(k.double()).all(-1) | ~torch.isfinite(v.double()).all(-1)  # (B, sk, hkv)
    if not bool(kbad.any()):
        return None
    kbad = kbad[:, :, torch.arange(hq, device=k.device) // (hq // hkv)].double()  # (B, sk, hq)
    call = AttentionCall.from_kwargs(**t.inputs["kw"])
    vis = call_visibility(batch=B, heads=hq, seqlen_q=sq, seqlen_k=sk, call=call, device=q.device).double()
    if vis.dim() == 2:
        seen = torch.einsum("ij,bjh->bih", vis, kbad)
        hidden = torch.einsum("ij,bjh->bih", 1 - vis, kbad)
    else:
        vis = vis.expand(B, hq, sq, sk)
        seen = torch.einsum("bhij,bjh->bih", vis, kbad)
        hidden = torch.einsum("bhij,bjh->bih", 1 - vis, kbad)
    qfin = torch.isfinite(q.double()).all(-1)
    leak = (hidden > 0) & (seen == 0) & qfin & bad
    if not bool(leak.any()):
        return None
    e, n = _explained_nonfinite(t, tols, leak)
    if not e:
        return None
    rows = torch.nonzero(leak.any(0).any(-1)).flatten().tolist()
    hb = torch.nonzero(leak)
    keys = torch.zeros(sk, dtype=torch.bool, device=k.device)
    for b in hb[:, 0].unique().tolist():
        keys |= kbad[b].any(-1) > 0
    if vis.dim() == 2:
        keys &= (1 - vis[leak.any(0).any(-1)]).amax(0) > 0
    nan = bool(torch.isnan(t.out.double()[leak]).any())
    what = "NaN" if nan else "inf"
    detail = f"{what} from masked keys {runs(torch.nonzero(keys).flatten().tolist())} reaches rows {runs(rows)}"
    ev = (
        f"{int(leak.sum()):,} (batch, row, head) rows are non-finite where the FP64 reference is finite while "
        f"their query and visible keys are finite and their masked keys hold NaN/inf: {e:,} of the {n:,} "
        f"violating elements ({e / n:.0%})"
    )
    return Cause("nan_leak", detail, ev, e / n)
