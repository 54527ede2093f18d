"""Candidate kernels for tests/test_compare.py, each the FA4 model (``fa4-model``) with one change:
``same`` none (bit-identical), ``last_bit`` one nonzero output element per head nudged by one ULP past
the model's rounding (margin lost where the bound is tight), ``lse_nan`` the LSE of row 0 made NaN (a new non-finite
value), ``no_causal`` the causal mask ignored (a seeded regression: its causal cases fail),
``jitter_dq`` a nondeterministic backward: dQ moved by 1 ULP on different elements at each backward
call, as atomics make production's SM90 dQ differ from run to run."""

import torch

from audits.kernels import get_kernel

_model = get_kernel("fa4-model")


def same(q, k, v, **kw):
    return _model(q, k, v, **kw)


def last_bit(q, k, v, *, return_lse=False, **kw):
    out, lse = _model(q, k, v, return_lse=True, **kw)
    bits = out.view(torch.int16 if out.element_size() == 2 else torch.int32).clone()
    # the next representable value away from zero (any sign): 1 ULP; an exact 0 (a row that sees
    # no key) stays 0, as any correct kernel keeps it
    bits[:, -1, :, 0] += (out[:, -1, :, 0] != 0).to(bits.dtype)
    out = bits.view(out.dtype)
    return (out, lse) if return_lse else out


def lse_nan(q, k, v, *, return_lse=False, **kw):
    out, lse = _model(q, k, v, return_lse=True, **kw)
    lse = lse.clone()
    lse[:, :, 0] = float("nan")
    return (out, lse) if return_lse else out


def no_causal(q, k, v, *, causal=False, **kw):
    return _model(q, k, v, causal=False, **kw)


class _JitterDQ(torch.autograd.Function):
    """The identity on q whose backward moves about 1 in 64 nonzero elements of dQ one representable
    value away from zero, chosen by a generator seeded from a call counter: deterministic from one
    test run to the next, different between two backward runs on one graph."""

    calls = 0

    @staticmethod
    def forward(ctx, q):
        return q.view_as(q)

    @staticmethod
    def backward(ctx, g):
        _JitterDQ.calls += 1
        pick = torch.rand(g.shape, generator=torch.Generator().manual_seed(_JitterDQ.calls)) < 1 / 64
        bits = g.view(torch.int16 if g.element_size() == 2 else torch.int32).clone()
        bits += (pick.to(g.device) & (g != 0)).to(bits.dtype)
        return bits.view(g.dtype)


def jitter_dq(q, k, v, **kw):
    return _model(_JitterDQ.apply(q), k, v, **kw)


# each is the model's SM100 arithmetic: held to FA4's bound, as the model is (audits.kernels.fa4_arch)
for _fn in (same, last_bit, lse_nan, no_causal, jitter_dq):
    _fn.fa4_audit_numerics = "sm100"


#: forward calls so far, per flaky kernel
_calls = {"first": 0, "second": 0}


def _flaky(which: str, moved_on: int, q, k, v, *, return_lse=False, **kw):
    """The model, one output element moved by one ULP on the calls whose count is ``moved_on``
    modulo 2 (counted per kernel ``which``)."""
    out, lse = _model(q, k, v, return_lse=True, **kw)
    _calls[which] += 1
    if _calls[which] % 2 == moved_on:
        bits = out.view(torch.int16 if out.element_size() == 2 else torch.int32).clone()
        bits[0, 0, 0, 0] += 1
        out = bits.view(out.dtype)
    return (out, lse) if return_lse else out


def flaky_first(q, k, v, **kw):
    """The model whose every first forward call of two moves one output element by one ULP: it
    differs from the model in the call compared, and from itself in the second call
    (``--time-calls``), so the difference is its own run-to-run variation, not a change."""
    return _flaky("first", 1, q, k, v, **kw)


def flaky_forward(q, k, v, **kw):
    """The model whose every second forward call moves one output element by one ULP: a forward
    that differs from itself (``--time-calls`` says so by the second call's bits)."""
    return _flaky("second", 0, q, k, v, **kw)
