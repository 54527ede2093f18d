"""Kernels for the invariance audit (tests/test_invariance.py).

Fixed-length: a plain float32 kernel and two copies of it with a seeded invariance bug each
((a) a batch-dependent reduction, (b) a decode path with another exp).  Varlen (the varlen
contract): the FA4 model's varlen entry (``fa4.varlen.varlen_attention``) with fixed numerics,
and five copies with a bug each ((c) a split-KV combine dropping a partial LSE, (d) a KV tile
chosen by the batch, (e) tiles following the pages, (f) a decode path with another exp2, (g) a
KV tile chosen by pack_gqa).  All
are correct to their format's accuracy (but (c)'s LSE); only their bits depend on what they
should not."""

import math

import torch

from fa4.varlen import combine as _combine


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


# ---- varlen kernels (the varlen contract, fa4.varlen): the model with one seeded bug each ------


def _base_numerics(q, k, v, kw):
    """The SM100 numerics ``fa4.varlen.varlen_attention`` gives the sequences of a packed call
    at these head dims (no 2-CTA on packed queries): each kernel below changes one knob of it."""
    from fa4.model import FA4Numerics

    causal = bool(kw.get("causal"))
    local = not causal and any(w is not None for w in kw.get("window_size", (None, None)))
    return FA4Numerics.sm100(
        q.dtype, q.shape[-1], causal, local, seqlen_q=kw["max_seqlen_q"], qhead_per_kvhead=q.shape[-2] // k.shape[-2],
        head_dim_v=v.shape[-1], use_2cta=False,
    )  # fmt: skip


def _varlen(fn):
    """Mark ``fn`` as a varlen kernel implementing SM100 numerics (held to its forward bound)."""
    fn.fa4_audit_contract = "varlen"
    fn.fa4_audit_numerics = "sm100"
    return fn


@_varlen
def varlen_plain(q, k, v, **kw):
    """Correct: the model with the base numerics, whatever the call."""
    from fa4.varlen import varlen_attention

    return varlen_attention(q, k, v, numerics=_base_numerics(q, k, v, kw), **kw)


def _combine_drops_last_lse(o_partial, lse_partial, out_dtype):
    """Split-KV combine whose LSE leaves out the last split's partial LSE (its max and sum run
    over the splits before it); the output is combined correctly."""
    out, _ = _combine(o_partial, lse_partial, out_dtype)
    _, lse = _combine(o_partial[:-1], lse_partial[:-1], out_dtype)
    return out, lse


@_varlen
def split_drops_lse(q, k, v, **kw):
    """Bug (c): the split-KV combine drops the last split's partial LSE, so a row whose keys
    span several splits gets an LSE short of that split's mass.  Caught by ``split`` (beyond the
    forward bound); with num_splits 1 nothing changes."""
    from unittest import mock

    import fa4.varlen

    with mock.patch.object(fa4.varlen, "combine", _combine_drops_last_lse):
        return varlen_plain(q, k, v, **kw)


@_varlen
def batch_tile(q, k, v, **kw):
    """Bug (d): a latency heuristic picks a 64-key KV tile for a lone sequence and 128 keys for
    a batch: a sequence's rescaling points and row-sum order follow the batch composition."""
    import dataclasses

    from fa4.varlen import varlen_attention

    n = kw["cu_seqlens_q"].numel() - 1
    nm = dataclasses.replace(_base_numerics(q, k, v, kw), tile_n=64 if n == 1 else 128)
    return varlen_attention(q, k, v, numerics=nm, **kw)


@_varlen
def paged_tiles(q, k, v, **kw):
    """Bug (e): the paged path processes KV a page at a time (tile_n = page_size): the tile
    boundaries, so the rescaling and the row-sum order, follow the page size."""
    import dataclasses

    from fa4.varlen import varlen_attention

    nm = _base_numerics(q, k, v, kw)
    if kw.get("page_table") is not None:
        nm = dataclasses.replace(nm, tile_n=k.shape[1])
    return varlen_attention(q, k, v, numerics=nm, **kw)


@_varlen
def decode_exp2_varlen(q, k, v, **kw):
    """Bug (f): the decode path (max_seqlen_q <= 4) takes the hardware exp2 on every column, the
    prefill the polynomial on the interleaved ones: decode rows round differently."""
    import dataclasses

    from fa4.varlen import varlen_attention

    nm = _base_numerics(q, k, v, kw)
    if kw["max_seqlen_q"] <= 4:
        nm = dataclasses.replace(nm, exp2="hardware")
    return varlen_attention(q, k, v, numerics=nm, **kw)


@_varlen
def pack_gqa_tiles(q, k, v, **kw):
    """Bug (g): with pack_gqa on, KV is processed in 64-key tiles (a smaller tile for the larger
    packed M): a row's rounding depends on whether its heads were packed."""
    import dataclasses

    from fa4.varlen import varlen_attention

    nm = _base_numerics(q, k, v, kw)
    if kw.get("pack_gqa", q.shape[-2] > k.shape[-2]):
        nm = dataclasses.replace(nm, tile_n=64)
    return varlen_attention(q, k, v, numerics=nm, **kw)


@_varlen
def refuses_splits(q, k, v, **kw):
    """Correct, but declines split-KV (as production's SM90 path does) and pages of 48 keys."""
    if kw.get("num_splits", 1) > 1:
        raise NotImplementedError("SplitKV not supported here")
    if kw.get("page_table") is not None and k.shape[1] == 48:
        raise NotImplementedError("page size 48 not supported here")
    return varlen_plain(q, k, v, **kw)
