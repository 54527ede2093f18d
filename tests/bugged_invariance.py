"""Kernels for the invariance audit (tests/test_invariance.py): a plain float32 kernel, and two
copies of it with a seeded invariance bug each.  All three are correct to float32 accuracy; only
their bits depend on what they should not."""

import math

import torch


def _rowdot(a, b):
    """sum(a * b) over the last axis, elementwise products then one reduction per element."""
    return (a * b).sum(-1)


def _plain(q, k, v, *, softmax_scale=None, causal=False, window_size=(None, None), softcap=0.0,
           learnable_sink=None, return_lse=False, chunk=None, exp=torch.exp):  # fmt: skip
    """The README's reference kernel without the non-finite-V handling, its row sum taken in
    chunks of ``chunk`` keys (None: one sum) and its exponential ``exp``."""
    _, sq, hq, d = q.shape
    sk, g = k.shape[1], hq // k.shape[2]
    qf, kf, vf = q.float(), k.float().repeat_interleave(g, 2), v.float().repeat_interleave(g, 2)
    # products summed along the contiguous last axis, not a matmul: CPU BLAS blocks by the row
    # count, so a matmul alone is not decode-invariant (docs/invariance.md)
    s = _rowdot(qf.transpose(1, 2)[:, :, :, None], kf.transpose(1, 2)[:, :, None])
    s = s * (d**-0.5 if softmax_scale is None else softmax_scale)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    diag = torch.arange(sq)[:, None] + (sk - sq)
    j = torch.arange(sk)[None, :]
    left, right = window_size
    right = (0 if right is None else min(right, 0)) if causal else right
    n = sq + sk
    vis = (j >= diag - (n if left is None else left)) & (j <= diag + (n if right is None else right))
    s = s.masked_fill(~vis, -math.inf)
    m = s.amax(-1, keepdim=True)
    sink = None if learnable_sink is None else learnable_sink.float().view(1, hq, 1, 1)
    m = m if sink is None else torch.maximum(m, sink)
    m = torch.where(torch.isfinite(m), m, 0.0)
    p = exp(s - m)
    if chunk is None:
        den = p.sum(-1, keepdim=True)
    else:  # partial sums of `chunk` keys, added in order: another rounding order
        den = torch.zeros_like(p[..., :1])
        for j0 in range(0, sk, chunk):
            den = den + p[..., j0 : j0 + chunk].sum(-1, keepdim=True)
    den = den + (0.0 if sink is None else torch.exp(sink - m))
    o = _rowdot(p[:, :, :, None], vf.permute(0, 2, 3, 1)[:, :, None])
    out = (o / torch.where(den == 0, 1.0, den)).transpose(1, 2)
    out = out.to(torch.bfloat16 if q.dtype.itemsize == 1 else q.dtype)
    lse = (m + torch.log(den)).squeeze(-1)
    return (out, lse) if return_lse else out


def plain(q, k, v, **kw):
    """Correct: nothing depends on the batch or on seqlen_q."""
    return _plain(q, k, v, **kw)


def batch_chunked_sum(q, k, v, **kw):
    """Bug (a): the row sum's chunk size depends on the batch size (16 keys per sequence of
    the batch), so a sequence's LSE and output bits change with the batch it sits in."""
    return _plain(q, k, v, chunk=16 * q.shape[0], **kw)


def _exp_via_exp2(x):
    return torch.exp2(x * math.log2(math.e))


def decode_exp2(q, k, v, **kw):
    """Bug (b): the decode path (seqlen_q <= 4) takes exp through exp2(x * log2 e), the prefill
    path exp(x): the last rows alone round differently from the same rows of the prefill."""
    return _plain(q, k, v, exp=_exp_via_exp2 if q.shape[1] <= 4 else torch.exp, **kw)


def refuses(q, k, v, **kw):
    """Declines every configuration: every property skipped, nothing compared."""
    raise NotImplementedError("this kernel runs nothing")
