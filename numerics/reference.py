"""High-precision attention references: FP64 on the inputs' device, mpmath on sampled rows.

Conventions (DESIGN.md; the audited-callable signature of ``flash_attn.cute.flash_attn_func``):

* q: (batch, seqlen_q, heads_q, d); k: (batch, seqlen_k, heads_kv, d); v: (batch, seqlen_k,
  heads_kv, dv); heads_q a multiple of heads_kv (GQA/MQA: query head h reads kv head
  h // (heads_q // heads_kv)).
* scores ``s = softmax_scale * q.k`` (default scale 1/sqrt(d)); with ``softcap > 0`` the logit is
  ``softcap * tanh(s / softcap)``.
* Causal: key j visible to query i iff ``j <= i + seqlen_k - seqlen_q`` (aligned bottom-right).
  Local window (left, right): ``i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q +
  right``; None means unbounded on that side.
* learnable_sink: (heads_q,) logits in natural-log units, *not* multiplied by softmax_scale: one
  extra softmax column per head with no value vector (it enlarges the normaliser and the LSE).
* Rows with no visible key (and no sink): out = 0 and lse = -inf.  With a sink such a row has
  out = 0 and lse = sink.
* out: (batch, seqlen_q, heads_q, dv); lse: (batch, heads_q, seqlen_q), natural log.

The inputs are exactly representable in float64, so the FP64 reference is the exact
attention up to float64 rounding (relative 1e-16 per op, far below every kernel error audited);
:func:`mp_attention_rows` certifies that on sampled rows at ``dps`` decimal digits.
NaN and inf in the inputs propagate as IEEE arithmetic does: a NaN in a visible score makes that
row's output NaN; entries at masked positions never enter.
"""

from __future__ import annotations

import math
from typing import Iterable

import mpmath
import torch

__all__ = ["visible_mask", "attention_reference", "attention_lowprec", "mp_attention_rows"]


def visible_mask(
    seqlen_q: int,
    seqlen_k: int,
    *,
    causal: bool = False,
    window_size: tuple[int | None, int | None] = (None, None),
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Bool (seqlen_q, seqlen_k): True where key j is visible to query i (module doc)."""
    left, right = window_size
    if causal:
        right = 0 if right is None else min(right, 0)
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    diag = i + (seqlen_k - seqlen_q)
    m = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if right is not None:
        m &= j <= diag + right
    if left is not None:
        m &= j >= diag - left
    return m


def _expand_kv(t: torch.Tensor, heads_q: int) -> torch.Tensor:
    hk = t.shape[2]
    if heads_q % hk:
        raise ValueError(f"heads_q ({heads_q}) must be a multiple of heads_kv ({hk})")
    return t.repeat_interleave(heads_q // hk, dim=2)


def _masked_matmul(w: torch.Tensor, vis: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """sum_j w_ij v_jc over *visible* j only, with IEEE semantics for non-finite v at visible
    positions (w * inf = inf, 0 * inf = NaN, inf - inf = NaN) and none at masked ones — a plain
    einsum would turn 0 * inf at a masked key into NaN.  w: (b, h, i, j); vis: (i, j);
    v: (b, j, h, c); returns (b, i, h, c)."""
    fin = torch.isfinite(v)
    out = torch.einsum("bhij,bjhc->bihc", w, torch.where(fin, v, torch.zeros_like(v)))
    if bool(fin.all()):
        return out
    visf = vis.to(w.dtype).view(1, 1, *vis.shape).expand_as(w)
    pos = visf * (w > 0)
    zero = visf * (w == 0)
    cnt = lambda a, m: torch.einsum("bhij,bjhc->bihc", a, m.to(w.dtype))  # noqa: E731
    n_nan = cnt(visf, torch.isnan(v)) + cnt(zero, torch.isinf(v))
    n_pinf, n_ninf = cnt(pos, v == math.inf), cnt(pos, v == -math.inf)
    out = torch.where(n_pinf > 0, torch.full_like(out, math.inf), out)
    out = torch.where(n_ninf > 0, torch.full_like(out, -math.inf), out)
    return torch.where((n_nan > 0) | ((n_pinf > 0) & (n_ninf > 0)), torch.full_like(out, math.nan), out)


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int | None, int | None] = (None, None),
    softcap: float = 0.0,
    learnable_sink: torch.Tensor | None = None,
    return_lse: bool = False,
    dtype: torch.dtype = torch.float64,
):
    """Attention computed in ``dtype`` (float64) from the exact inputs; ``out`` (and ``lse``)
    in ``dtype``.  Same signature and conventions as the audited callables (module doc)."""
    b, sq, hq, d = q.shape
    sk = k.shape[1]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    q64, k64, v64 = q.to(dtype), _expand_kv(k, hq).to(dtype), _expand_kv(v, hq).to(dtype)
    s = torch.einsum("bihd,bjhd->bhij", q64, k64) * scale
    if softcap and softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    vis = visible_mask(sq, sk, causal=causal, window_size=window_size, device=q.device)
    s = s.masked_fill(~vis, -math.inf)
    m = s.amax(dim=-1, keepdim=True)  # NaN-propagating, like the math
    if learnable_sink is not None:
        sink = learnable_sink.to(dtype).view(1, hq, 1, 1).expand(b, hq, sq, 1)
        m = torch.maximum(m, sink)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m_safe)
    denom = p.sum(dim=-1, keepdim=True)
    if learnable_sink is not None:
        denom = denom + torch.exp(sink - m_safe)
    w = p / torch.where(denom == 0, torch.ones_like(denom), denom)
    out = _masked_matmul(w, vis, v64)
    lse = (m_safe + torch.log(denom)).squeeze(-1)
    if learnable_sink is None:
        empty = ~vis.any(dim=-1)  # (sq,)
        out = out.masked_fill(empty.view(1, sq, 1, 1), 0.0)
        lse = lse.masked_fill(empty.view(1, 1, sq), -math.inf)
    return (out, lse) if return_lse else out


def attention_lowprec(q, k, v, **kw) -> torch.Tensor:
    """The same math done in the input dtype by PyTorch (fp8 inputs: in bfloat16), the
    ``out_lowprec`` of FA's test criterion (``numerics.metrics.fa_criterion``)."""
    dt = torch.bfloat16 if q.dtype.itemsize == 1 else q.dtype
    return attention_reference(q, k, v, dtype=dt, **kw)


def mp_attention_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rows: Iterable[tuple[int, int, int]],
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int | None, int | None] = (None, None),
    softcap: float = 0.0,
    learnable_sink: torch.Tensor | None = None,
    dps: int = 50,
) -> list[tuple[list[mpmath.mpf], mpmath.mpf]]:
    """Output rows and LSE in mpmath at ``dps`` digits, for (batch, head_q, query) triples:
    ``[(out_row, lse), ...]``.  Used to certify the FP64 reference on samples (slow: pure
    Python).  mpmath's working precision is restored afterwards, whatever happens."""
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = mpmath.mpf(1) / mpmath.sqrt(d) if softmax_scale is None else mpmath.mpf(float(softmax_scale))
    vis = visible_mask(sq, sk, causal=causal, window_size=window_size)
    qd, kd, vd = q.double().cpu(), k.double().cpu(), v.double().cpu()
    old = mpmath.mp.dps
    try:
        mpmath.mp.dps = dps
        res = []
        for bi, h, i in rows:
            kh = h // (hq // hk)
            qi = [mpmath.mpf(float(x)) for x in qd[bi, i, h]]
            logits = []
            for j in range(sk):
                if not vis[i, j]:
                    continue
                s = mpmath.fsum(a * mpmath.mpf(float(c)) for a, c in zip(qi, kd[bi, j, kh])) * scale
                if softcap and softcap > 0:
                    s = softcap * mpmath.tanh(s / softcap)
                logits.append((j, s))
            all_l = [s for _, s in logits]
            if learnable_sink is not None:
                all_l.append(mpmath.mpf(float(learnable_sink[h])))
            dv = v.shape[-1]
            if not all_l:
                res.append(([mpmath.mpf(0)] * dv, mpmath.mpf("-inf")))
                continue
            m = max(all_l)
            den = mpmath.fsum(mpmath.exp(s - m) for s in all_l)
            out = [
                mpmath.fsum(mpmath.exp(s - m) * mpmath.mpf(float(vd[bi, j, kh, c])) for j, s in logits) / den
                for c in range(dv)
            ]
            res.append((out, m + mpmath.log(den)))
        return res
    finally:
        mpmath.mp.dps = old
