"""A restricted kernel, as third-party kernels are: fp16 only, seqlen_q == seqlen_k in multiples
of 128, head dims 64 and 128, causal or not, GQA; no window, softcap or sink (its domain is
declared, ``fa4_audit_domain``).  ``attention`` is correct (PyTorch's SDPA math on float32, the
LSE beside it); ``batch_offset`` carries the seeded batch bug of issue 24: the K/V rows of batch
index b are read from flat row b * (seqlen - 1) instead of b * seqlen (a batch stride one row
short, as a hand-written kernel's pointer arithmetic may have it), so every batch index >= 1
attends over the previous sequence's last rows.  A sequence computed alone (batch 1) is right;
inside a batch it is not: ``fa4-audit invariance --require batch`` catches it (tests/
test_invariance_domain.py), as ``run`` does against the FP64 reference.  CPU-friendly."""

import math

import torch
import torch.nn.functional as F

DOMAIN = {
    "dtypes": ["float16"], "head_dims": [[64, 64], [128, 128]], "seqlen_multiple": 128, "equal_seqlens": True,
    "max_seqlen": 4096, "causal": True, "local": False, "softcap": False, "sink": False, "gqa": True,
}  # fmt: skip


def _check(q, k, window_size, softcap, learnable_sink) -> None:
    """NotImplementedError outside :data:`DOMAIN` (the audit never calls it there; a direct
    caller learns why)."""
    s, d = q.shape[1], q.shape[-1]
    if q.dtype != torch.float16 or s != k.shape[1] or s % 128 or d not in (64, 128):
        raise NotImplementedError(
            f"fp16, seqlen_q == seqlen_k a multiple of 128, d 64 or 128 only; got {q.dtype}, {s}x{k.shape[1]}, d {d}"
        )
    if window_size != (None, None) or softcap or learnable_sink is not None:
        raise NotImplementedError("no local window, softcap or learnable sink")


def _attention(q, k, v, *, softmax_scale, causal, return_lse):
    """Correct attention of equal-length fp16 q, k, v (batch, seqlen, heads, d): SDPA's math in
    float32 for the output, the log-sum-exp of the same scaled scores for the LSE."""
    hq, d = q.shape[2], q.shape[-1]
    g = hq // k.shape[2]
    scale = 1 / math.sqrt(d) if softmax_scale is None else softmax_scale
    qf, kf, vf = (x.float().transpose(1, 2) for x in (q, k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)))
    out = F.scaled_dot_product_attention(qf, kf, vf, is_causal=causal, scale=scale)
    out = out.transpose(1, 2).half()
    if not return_lse:
        return out
    scores = (qf @ kf.transpose(-1, -2)) * scale
    if causal:  # equal lengths: key j visible to query i iff j <= i
        s = q.shape[1]
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1), -math.inf)
    return out, torch.logsumexp(scores, dim=-1)


def attention(q, k, v, *, softmax_scale=None, causal=False, window_size=(None, None), softcap=0.0,
              learnable_sink=None, return_lse=False):  # fmt: skip
    """Correct: nothing depends on the batch."""
    _check(q, k, tuple(window_size), softcap, learnable_sink)
    return _attention(q, k, v, softmax_scale=softmax_scale, causal=causal, return_lse=return_lse)


def _shifted(x: torch.Tensor) -> torch.Tensor:
    """``x`` (batch, seqlen, heads, d) as the buggy kernel reads it: batch b's rows from flat row
    b * (seqlen - 1) of the batch's rows laid end to end."""
    b, s = x.shape[:2]
    flat = x.reshape(b * s, *x.shape[2:])
    return torch.stack([flat[i * (s - 1) : i * (s - 1) + s] for i in range(b)])


def batch_offset(q, k, v, *, softmax_scale=None, causal=False, window_size=(None, None), softcap=0.0,
                 learnable_sink=None, return_lse=False):  # fmt: skip
    """Bug: a batch stride one row short on K and V (:func:`_shifted`): batch index 0 is right,
    every batch index >= 1 reads one row per index of the previous sequence."""
    _check(q, k, tuple(window_size), softcap, learnable_sink)
    return _attention(q, _shifted(k), _shifted(v), softmax_scale=softmax_scale, causal=causal, return_lse=return_lse)


attention.fa4_audit_domain = DOMAIN
batch_offset.fa4_audit_domain = DOMAIN
