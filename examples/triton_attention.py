"""A restricted flash-attention forward in Triton, written for fa4-audit's worked example.

What it supports is declared (``attention.fa4_audit_domain``): fp16 only, head dims 64 and 128
(dv = d), seqlen_q == seqlen_k in multiples of 128, causal or not, GQA/MQA; no local window,
softcap or learnable sink, no backward.  ``fa4-audit run --kernel
examples/triton_attention.py:attention --suite release --device cuda`` builds the release suite
inside that domain (docs/runner.md, "Declared domains").

The numerics are the textbook online softmax (one program per 128 query rows of one head):
scores ``q·kᵀ`` from fp16 operands with float32 accumulation (``tl.dot``), taken to log2 units
by one multiplication with ``softmax_scale·log2(e)``, the running row maximum updated at every
key block (no lazy rescaling), ``P = exp2(s - m)`` rounded to fp16 before ``P·V`` (the MMA needs
both operands in one 16-bit type), the row sum kept in float32 from the unrounded P, the
division by it once at the end, and ``lse = (m + log2(l))·ln 2``.  The causal mask is an
exclusion (``tl.where`` to -inf), not an additive constant, so a NaN score beyond the diagonal
never enters the row maximum; a NaN or inf in V beyond the diagonal still reaches the rows of
its tile through ``0·NaN`` in ``P·V`` (the audit reports what that does).

Without a GPU the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``, CPU tensors):
slow, for tests only.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

BLOCK_M = 128  # query rows per program; the domain's seqlen multiple
BLOCK_N = 64  # keys per inner step


@triton.jit
def _forward(
    Q, K, V, Out, LSE,
    s_qb, s_qs, s_qh, s_qd, s_kb, s_ks, s_kh, s_kd, s_vb, s_vs, s_vh, s_vd, s_ob, s_os, s_oh, s_od,
    scale_log2, seqlen, heads, group,
    CAUSAL: tl.constexpr, HEAD_D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    m_block, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // heads, bh % heads
    hk = h // group  # GQA/MQA: query head h reads kv head h // group
    rows = m_block * BM + tl.arange(0, BM)
    cols = tl.arange(0, BN)
    dims = tl.arange(0, HEAD_D)
    q = tl.load(Q + b * s_qb + h * s_qh + rows[:, None] * s_qs + dims[None, :] * s_qd)
    m = tl.full([BM], float("-inf"), tl.float32)
    row_sum = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, HEAD_D], tl.float32)
    end = (m_block + 1) * BM if CAUSAL else seqlen  # blocks wholly above the diagonal are skipped
    for n0 in range(0, end, BN):
        keys = n0 + cols
        k = tl.load(K + b * s_kb + hk * s_kh + keys[None, :] * s_ks + dims[:, None] * s_kd)  # (HEAD_D, BN)
        s = tl.dot(q, k) * scale_log2  # float32 scores in log2 units
        if CAUSAL:
            s = tl.where(rows[:, None] >= keys[None, :], s, float("-inf"))  # exclusion, not -1e6 added
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)  # exp2(-inf) = 0 on the first block
        p = tl.exp2(s - m_new[:, None])
        row_sum = row_sum * alpha + tl.sum(p, 1)
        v = tl.load(V + b * s_vb + hk * s_vh + keys[:, None] * s_vs + dims[None, :] * s_vd)
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v)
        m = m_new
    out = acc / row_sum[:, None]
    tl.store(Out + b * s_ob + h * s_oh + rows[:, None] * s_os + dims[None, :] * s_od, out.to(tl.float16))
    tl.store(LSE + bh * seqlen + rows, (m + tl.log2(row_sum)) * 0.6931471805599453)


def attention(q, k, v, *, softmax_scale=None, causal=False, window_size=(None, None), softcap=0.0,
              learnable_sink=None, return_lse=False):  # fmt: skip
    """The audited-callable contract (fa4-audit's README) on this kernel's domain; anything
    outside it raises ``NotImplementedError`` (the audit's ``skipped``)."""
    batch, seqlen, heads, d = q.shape
    if tuple(window_size) != (None, None) or softcap or learnable_sink is not None:
        raise NotImplementedError("triton_attention: no local window, softcap or learnable sink")
    if q.dtype != torch.float16 or d not in (64, 128) or v.shape[-1] != d:
        raise NotImplementedError(f"triton_attention: fp16 with d = dv in (64, 128), got {q.dtype}, {d}, {v.shape[-1]}")
    if k.shape[1] != seqlen or seqlen % BLOCK_M:
        raise NotImplementedError(f"triton_attention: seqlen_q == seqlen_k, a multiple of {BLOCK_M}")
    out = torch.empty(batch, seqlen, heads, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, heads, seqlen, dtype=torch.float32, device=q.device)
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    grid = (seqlen // BLOCK_M, batch * heads)
    _forward[grid](
        q, k, v, out, lse, *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        scale * math.log2(math.e), seqlen, heads, heads // k.shape[2],
        CAUSAL=bool(causal), HEAD_D=d, BM=BLOCK_M, BN=BLOCK_N, num_warps=8 if d == 128 else 4,
    )  # fmt: skip
    return (out, lse) if return_lse else out


attention.fa4_audit_domain = {
    "dtypes": ["float16"],
    "head_dims": [[64, 64], [128, 128]],
    "seqlen_multiple": BLOCK_M,
    "equal_seqlens": True,
    "causal": True,
    "local": False,
    "softcap": False,
    "sink": False,
    "gqa": True,
    "backward": False,
    "deterministic": False,
}
