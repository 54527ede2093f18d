"""Audited callables for CLI tests: the SM90 model with a broken exp2, kernels without an LSE or
any supported configuration, and for ``--backward``: one without autograd, one with a wrong dQ."""

import dataclasses

import torch

from fa4.model import FA4Numerics, attention


def sm90_model_poly_exp2(q, k, v, *, causal=False, window_size=(None, None), return_lse=False, **kw):
    """Differs from the SM90 path: every exp2 through the degree-1 polynomial."""
    nm = dataclasses.replace(
        FA4Numerics.for_inputs("sm90", q, k, v, causal, window_size), exp2="emulated", poly_degree=1
    )
    return attention(q, k, v, causal=causal, window_size=window_size, return_lse=return_lse, numerics=nm, **kw)


def no_lse(q, k, v, *, return_lse=False, **kw):
    """Correct outputs, but ignores ``return_lse``: the LSE is never returned."""
    from tests.bugged_kernels import exact

    return exact(q, k, v, **kw)


def refuses_everything(q, k, v, **kw):
    """Raises NotImplementedError for every configuration: nothing can be audited."""
    raise NotImplementedError("this kernel supports no configuration")


def forward_only(q, k, v, *, return_lse=False, **kw):
    """The FA4 model's forward with the autograd graph cut: no backward to audit."""
    with torch.no_grad():
        return attention(q, k, v, return_lse=return_lse, **kw)


def dq_doubled(q, k, v, *, return_lse=False, **kw):
    """The FA4 model whose dQ comes back twice too large (its forward is exact)."""
    out, lse = _DoubleDq.apply(q, k, v, kw)
    return (out, lse) if return_lse else out


class _DoubleDq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, kw):
        ctx.save_for_backward(q, k, v)
        ctx.kw = kw
        with torch.no_grad():
            return attention(q, k, v, return_lse=True, **kw)

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v = (t.detach().requires_grad_() for t in ctx.saved_tensors)
        with torch.enable_grad():
            out = attention(q, k, v, **ctx.kw)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
        return dq * 2, dk, dv, None


def says_its_gpu(q, k, v, **kw):
    """Refuses every case, naming the GPU its process was pinned to (run --jobs --gpus)."""
    import os

    raise NotImplementedError(f"pinned to CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}")
