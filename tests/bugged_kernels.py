"""Kernels with seeded bugs, and helpers, for the runner tests (issue 5's catalogue starts here)."""

import torch

from fa4.model import attention


def exact(q, k, v, *, return_lse=False, **kw):
    """An exact kernel: the FP64 reference rounded to the output dtype."""
    from numerics.reference import attention_reference

    out, lse = attention_reference(q, k, v, return_lse=True, **kw)
    dt = torch.bfloat16 if q.dtype.itemsize == 1 else q.dtype
    out = out.to(dt)
    return (out, lse.float()) if return_lse else out


def no_causal_mask(q, k, v, *, causal=False, **kw):
    """Bug: ignores causal masking."""
    return attention(q, k, v, causal=False, **kw)


def wrong_lse(q, k, v, *, return_lse=False, **kw):
    """Bug: LSE in log2 units instead of natural log."""
    out, lse = attention(q, k, v, return_lse=True, **kw)
    return (out, lse / 0.6931471805599453) if return_lse else out


def wrong_shape(q, k, v, **kw):
    """Bug: returns (b, h, s, d) instead of (b, s, h, d)."""
    out = attention(q, k, v, **kw)
    out = out[0] if isinstance(out, tuple) else out
    return out.transpose(1, 2).contiguous()


def raises(q, k, v, **kw):
    raise RuntimeError("illegal memory access (simulated)")
