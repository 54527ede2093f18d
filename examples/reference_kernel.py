"""A plain float32 attention that honours the whole audited-callable contract (README.md, "Audit
your kernel"): GQA/MQA, bottom-right causal masks and local windows, softcap, a learnable sink,
rows with no visible key (out 0, lse -inf), NaN/inf at masked keys that never leak, fp8 inputs
giving a bfloat16 output, the LSE, and the mods (docs/mods.md): a score_mod through its reference
form (``numerics.mods.ScoreMod.fn``, here in float32 on the scaled score), a mask_mod and block
sparsity through ``numerics.mods.visibility``, intersected with the flags' mask, the runtime
``aux_scalars`` handed to the mods as production does (``numerics.mods.bind_aux_scalars``).  It declares the
four mod kinds (``fa4_audit_domain``), so the smoke suite's mod cases are run on it.  It holds
the whole (batch, heads, seqlen_q, seqlen_k) score matrix: fine for the smoke suite, not for very
long sequences.

    fa4-audit run --kernel examples/reference_kernel.py:attention --suite smoke
"""

import math

import torch

from numerics.mods import bind_aux_scalars, index_grid, visibility


def attention(q, k, v, *, softmax_scale=None, causal=False, window_size=(None, None), softcap=0.0,
              learnable_sink=None, return_lse=False, score_mod=None, mask_mod=None, aux_tensors=None,
              block_sparse_tensors=None, aux_scalars=None):  # fmt: skip
    score_mod, mask_mod, block_sparse_tensors = bind_aux_scalars(  # runtime scalars, if any, to the mods
        aux_scalars, score_mod=score_mod, mask_mod=mask_mod, block_sparse=block_sparse_tensors)  # fmt: skip
    b, sq, hq, d = q.shape
    sk, g = k.shape[1], hq // k.shape[2]  # GQA/MQA: query head h reads kv head h // g
    qf, kf, vf = q.float(), k.float().repeat_interleave(g, 2), v.float().repeat_interleave(g, 2)
    s = torch.einsum("bihd,bjhd->bhij", qf, kf) * (d**-0.5 if softmax_scale is None else softmax_scale)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if score_mod is not None:  # its reference form, on the scaled score
        s = score_mod.fn(s, *index_grid(b, hq, sq, sk, device=q.device), aux_tensors).expand_as(s)
    diag = torch.arange(sq, device=q.device)[:, None] + (sk - sq)  # bottom-right aligned
    j = torch.arange(sk, device=q.device)[None, :]
    left, right = window_size  # None: unbounded on that side; causal caps the right side at 0
    right = (0 if right is None else min(right, 0)) if causal else right
    n = sq + sk  # farther than any key
    vis = (j >= diag - (n if left is None else left)) & (j <= diag + (n if right is None else right))
    kept = visibility(batch=b, heads=hq, seqlen_q=sq, seqlen_k=sk, mask_mod=mask_mod, aux=aux_tensors,
                      block_sparse=block_sparse_tensors, device=q.device)  # fmt: skip
    vis = vis if kept is None else vis & kept  # kept by the flags and the mods
    s = s.masked_fill(~vis, -math.inf)  # masked keys never enter, NaN scores there included
    m = s.amax(-1, keepdim=True)
    sink = None if learnable_sink is None else learnable_sink.float().view(1, hq, 1, 1)
    m = m if sink is None else torch.maximum(m, sink)
    m = torch.where(torch.isfinite(m), m, 0.0)  # rows with no visible key: out 0, lse -inf
    p = torch.exp(s - m)
    den = p.sum(-1, keepdim=True) + (0.0 if sink is None else torch.exp(sink - m))
    bad = ~torch.isfinite(vf)  # NaN/inf in V reach only the rows that see their key
    o = torch.einsum("bhij,bjhc->bhic", p, vf.masked_fill(bad, 0.0))
    for jj in bad.any(-1).any(-1).any(0).nonzero().flatten().tolist():
        pv = p[..., jj, None] * vf[:, jj, :, None, :]  # IEEE products: 0 * inf = NaN at a visible key
        o = o + torch.where(vis[..., jj, None] & bad[:, jj, :, None, :], pv, 0.0)
    out = (o / torch.where(den == 0, 1.0, den)).transpose(1, 2)
    out = out.to(torch.bfloat16 if q.dtype.itemsize == 1 else q.dtype)  # fp8 inputs give bf16
    lse = (m + torch.log(den)).squeeze(-1)  # (batch, heads_q, seqlen_q), natural log
    return (out, lse) if return_lse else out


attention.fa4_audit_domain = {"mods": ["score_mod", "mask_mod", "block_sparse", "aux_scalars"]}
