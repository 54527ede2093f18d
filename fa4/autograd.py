"""``fa4.model.attention`` under autograd, as production's ``interface.FlashAttnFunc``: the
forward is the forward model (``fa4.forward_loop.attention_forward``), the backward production's
backward kernels modelled (``fa4.model_bwd.attention_backward``), both reading one numerics
record and the same mods.
"""

from __future__ import annotations

import torch

from fa4.forward_loop import attention_forward
from fa4.knobs import FA4Numerics
from fa4.model_bwd import attention_backward

__all__ = ["differentiable"]


def differentiable(q, k, v, sink, numerics, kw: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of ``attention`` through :class:`_AttentionFn` (numerics resolved here, as
    ``attention`` does, so that the backward sees the same record; ``kw`` carries the mods to both
    directions, as ``interface.FlashAttnFunc`` saves them on ``ctx``)."""
    nm = numerics
    if nm is None:
        nm = FA4Numerics.for_call(
            "sm100",
            q,
            k,
            v,
            causal=kw["causal"],
            window_size=kw["window_size"],
            mask_mod=kw.get("mask_mod"),
            block_sparse_tensors=kw.get("block_sparse_tensors"),
        )
    return _AttentionFn.apply(q, k, v, sink, nm, kw)


class _AttentionFn(torch.autograd.Function):
    """``attention`` under autograd, as ``interface.FlashAttnFunc``: the forward is the forward
    model (bit for bit: ``attention``'s own forward, grad mode being off in here); the backward is
    ``fa4.model_bwd.attention_backward`` on the saved inputs, the returned (rounded) out and the
    float32 LSE, dO (zeros when out gets no gradient) and dLSE when the LSE output gets one."""

    @staticmethod
    def forward(ctx, q, k, v, sink, nm, kw):
        out, lse = attention_forward(q, k, v, learnable_sink=sink, numerics=nm, **kw)
        ctx.save_for_backward(q, k, v, sink, out, lse)
        ctx.nm, ctx.kw = nm, kw
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, sink, out, lse = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout
        dq, dk, dv, dsink = attention_backward(
            q, k, v, out, lse, dout, dlse=dlse, learnable_sink=sink, numerics=ctx.nm, **ctx.kw
        )
        return dq, dk, dv, dsink, None, None
