"""Candidate kernels for tests/test_compare.py, each the FA4 model (``fa4-model``) with one change:
``same`` none (bit-identical), ``last_bit`` one nonzero output element per head nudged by one ULP past
the model's rounding (margin lost where the bound is tight), ``lse_nan`` the LSE of row 0 made NaN (a new non-finite
value), ``no_causal`` the causal mask ignored (a seeded regression: its causal cases fail)."""

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


# each is the model's SM100 arithmetic: held to FA4's bound, as the model is (audits.kernels.fa4_arch)
for _fn in (same, last_bit, lse_nan, no_causal):
    _fn.fa4_audit_numerics = "sm100"
