"""A plain float32 attention with a hand-written FlashAttention-style backward, and the field's
backward bugs seeded into it (one per ``bug=``): the catalogue tests/test_backward_catalogue.py
shows FA's backward criterion against FP64 gradients catches each one.

Forward (float32 throughout, masks / softcap / learnable sink / GQA as numerics/reference.py):
``P = exp2((s - m) * log2 e) / den``, ``out`` cast to the input dtype, ``lse`` float32 natural log.
Backward (FA's recomputation, float32): ``D = rowsum(O * dO) - dLSE`` from the returned (input-dtype)
``O``, ``P = exp2((s - lse) * log2 e)`` with the same exp2 the LSE came from, ``dP = dO V^T``,
``dS = P (dP - D)``, times ``1 - tanh^2(r / cap)`` with a softcap, ``dQ = scale dS K``,
``dK = scale dS^T Q`` and ``dV = P^T dO`` summed over each kv head's query heads (GQA), and
``dsink = -sum_{b, i} P_sink D``.  Gradients are returned in the inputs' dtypes.
"""

from __future__ import annotations

import math

import torch

from fa4.ex2 import ex2_emulation
from numerics.reference import visible_mask

__all__ = ["BUGS", "attention", "clean"]

LOG2E = 1.4426950408889634

#: the seeded backward bugs, each with the field issue it reproduces
BUGS = {
    "dq_no_scale": (
        "dQ = dS K without the softmax scale: dQ too large by sqrt(d) (dQ ~5x too large at hd256 when "
        "the scale was lost / wrong, TransformerEngine #3216)"
    ),
    "dv_unaligned_cols": (
        "dV columns beyond the largest multiple of 32 of head_dim_v dropped (left zero): dV corrupted "
        "when head_dim_v is not aligned to the reduction width (flash-attention #2552)"
    ),
    "softcap_no_chain": (
        "softcap backward missing: dS not multiplied by the chain factor 1 - tanh^2(r / cap) (flash-attention #2402)"
    ),
    "gqa_one_head": (
        "GQA: dK and dV taken from the first query head of each group only, not summed over the group "
        "(the GQA reduction done over one head)"
    ),
    "no_causal_in_bwd": (
        "the recomputed P (and dS) ignore the causal mask: masked pairs get exp(s - lse) in the backward "
        "(the causal mask missing from the backward's recomputation)"
    ),
    "sink_grad_missing": "the learnable-sink gradient missing: dsink = 0 (flash-attention #2706)",
    "ds_other_exp2": (
        "dS from a P computed with a different exp2 (the degree-1 polynomial, fa4.ex2.ex2_emulation(x, 1)) "
        "than the one the forward's LSE came from: P no longer sums to 1 against that LSE"
    ),
}


def _logits(qf, kf, scale, softcap):
    """(r, t, s): the scaled scores r = scale q.k, tanh(r / cap) (None without softcap), and the
    logits s, float32 (b, hq, sq, sk); kf already expanded to the query heads."""
    r = torch.einsum("bihd,bjhd->bhij", qf, kf) * scale
    if softcap and softcap > 0:
        t = torch.tanh(r / softcap)
        return r, t, t * softcap
    return r, None, r


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sink, bug, scale, causal, window_size, softcap):
        b, sq, hq, d = q.shape
        sk, hk = k.shape[1], k.shape[2]
        idx = torch.arange(hq) // (hq // hk)
        qf, kf, vf = q.float(), k.float()[:, :, idx], v.float()[:, :, idx]
        _, _, s = _logits(qf, kf, scale, softcap)
        vis = visible_mask(sq, sk, causal=causal, window_size=window_size)
        s = s.masked_fill(~vis, -math.inf)
        m = s.amax(-1, keepdim=True)
        if sink is not None:
            m = torch.maximum(m, sink.float().view(1, hq, 1, 1))
        m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp2((s - m_safe) * LOG2E)
        den = p.sum(-1, keepdim=True)
        if sink is not None:
            den = den + torch.exp2((sink.float().view(1, hq, 1, 1) - m_safe) * LOG2E)
        safe = torch.where(den > 0, den, torch.ones_like(den))
        out = torch.einsum("bhij,bjhc->bihc", p / safe, vf).to(q.dtype)
        lse = torch.where(den > 0, m_safe + torch.log(safe), torch.full_like(m, -math.inf)).squeeze(-1)
        ctx.save_for_backward(q, k, v, sink, out, lse)
        ctx.cfg = (bug, scale, causal, window_size, softcap)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, sink, out, lse = ctx.saved_tensors
        bug, scale, causal, window_size, softcap = ctx.cfg
        b, sq, hq, d = q.shape
        sk, hk, dvd = k.shape[1], k.shape[2], v.shape[-1]
        g = hq // hk
        idx = torch.arange(hq) // g
        qf, kf, vf = q.float(), k.float()[:, :, idx], v.float()[:, :, idx]
        do = torch.zeros(b, sq, hq, dvd) if dout is None else dout.float()
        dl = torch.zeros(b, hq, sq) if dlse is None else torch.where(torch.isfinite(lse), dlse.float(), 0.0)
        # D' = rowsum(O * dO) - dLSE, from the returned O (FA's preprocess)
        dprime = (out.float() * do).sum(-1).permute(0, 2, 1) - dl  # (b, hq, sq)
        _, t, s = _logits(qf, kf, scale, softcap)
        vis = visible_mask(sq, sk, causal=causal and bug != "no_causal_in_bwd", window_size=window_size)
        lse_safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None]
        x = ((s - lse_safe) * LOG2E).masked_fill(~vis, -math.inf)
        p = torch.exp2(x)  # the forward's exp2
        p_ds = ex2_emulation(x.contiguous(), 1).masked_fill(~vis, 0.0) if bug == "ds_other_exp2" else p
        dp = torch.einsum("bihc,bjhc->bhij", do, vf)
        ds = p_ds * (dp - dprime[..., None])
        if t is not None and bug != "softcap_no_chain":
            ds = ds * (1 - t * t)
        ds = ds.masked_fill(~vis, 0.0)
        dq = torch.einsum("bhij,bjhd->bihd", ds, kf)
        if bug != "dq_no_scale":
            dq = dq * scale
        dk_h = torch.einsum("bhij,bihd->bjhd", ds, qf) * scale  # per query head (b, sk, hq, d)
        dv_h = torch.einsum("bhij,bihc->bjhc", p, do)
        if bug == "gqa_one_head":
            dk, dv = dk_h.view(b, sk, hk, g, d)[:, :, :, 0], dv_h.view(b, sk, hk, g, dvd)[:, :, :, 0]
        else:
            dk, dv = dk_h.view(b, sk, hk, g, d).sum(3), dv_h.view(b, sk, hk, g, dvd).sum(3)
        if bug == "dv_unaligned_cols":
            dv = dv.clone()
            dv[..., (dvd // 32) * 32 :] = 0.0
        dsink = None
        if sink is not None:
            p_sink = torch.exp2((sink.float().view(1, hq, 1) - lse_safe.squeeze(-1)) * LOG2E)
            dsink = -(p_sink * dprime).sum(dim=(0, 2))
            if bug == "sink_grad_missing":
                dsink = torch.zeros_like(dsink)
            dsink = dsink.to(sink.dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsink, None, None, None, None, None


def attention(
    q,
    k,
    v,
    *,
    bug=None,
    softmax_scale=None,
    causal=False,
    window_size=(None, None),
    softcap=0.0,
    learnable_sink=None,
    return_lse=False,
):
    """Float32 attention with the hand-written backward; ``bug`` one of :data:`BUGS` or None
    (the clean kernel).  q, k, v: (b, s, h, d) bf16 / fp16; returns out (input dtype) and, with
    ``return_lse``, lse (b, hq, sq) float32; differentiable in q, k, v, learnable_sink and lse."""
    if bug is not None and bug not in BUGS:
        raise ValueError(f"unknown bug {bug!r}; one of {sorted(BUGS)}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    out, lse = _Attention.apply(q, k, v, learnable_sink, bug, scale, causal, tuple(window_size), float(softcap or 0.0))
    return (out, lse) if return_lse else out


def clean(q, k, v, **kw):
    """The correct kernel (no seeded bug)."""
    return attention(q, k, v, **kw)


def _make(bug):
    def kernel(q, k, v, **kw):
        return attention(q, k, v, bug=bug, **kw)

    kernel.__name__ = f"bug_{bug}"
    kernel.__doc__ = BUGS[bug]
    return kernel


for _bug in BUGS:
    globals()[f"bug_{_bug}"] = _make(_bug)
