"""Audited callables for CLI tests: the model standing in for production, and a broken one."""

import dataclasses

from fa4.model import FA4Numerics, attention


def sm90_model(q, k, v, *, causal=False, window_size=(None, None), return_lse=False, **kw):
    local = not causal and any(w is not None for w in window_size)
    nm = FA4Numerics.sm90(q.dtype, q.shape[-1], causal=causal, local=local)
    return attention(q, k, v, causal=causal, window_size=window_size, return_lse=return_lse, numerics=nm, **kw)


def sm90_model_poly_exp2(q, k, v, *, causal=False, window_size=(None, None), return_lse=False, **kw):
    """Differs from the SM90 path: every exp2 through the degree-1 polynomial."""
    local = not causal and any(w is not None for w in window_size)
    nm = dataclasses.replace(FA4Numerics.sm90(q.dtype, q.shape[-1], causal=causal, local=local), exp2="emulated", poly_degree=1)
    return attention(q, k, v, causal=causal, window_size=window_size, return_lse=return_lse, numerics=nm, **kw)
