"""Seeded feature bugs (issue 33 item 6): kernels that get one feature of the call wrong and are
otherwise exact, so that a suite passes one only when none of its cases makes that feature
matter.  Each wraps the FP64 reference (``numerics.reference.attention_reference``) rounded to
the output dtype, so a failing case fails by the bug alone; ``FEATURE_BUGS`` maps a bug to what
it breaks (its docstring) and :data:`AXIS` to the case feature it lives on
(``audits.suites.signal.FEATURES``): the smoke suite must fail each one on a case of that feature
(``tests/test_feature_bugs.py``).

The other catalogues seed bugs into a blockwise kernel's arithmetic (``tests.bugged_kernels``:
rescaling, flush, saturation, accumulation), the varlen entry's bookkeeping
(``tests.bugged_varlen``) and the mods' backward (``tests.bugged_mods``); these are the call's
features taken wrongly, each a mistake an integration makes once and a subnormal- or NaN-input
case never shows."""

from __future__ import annotations

import math

import torch

from numerics.call import AttentionCall
from numerics.reference import attention_reference

#: every mod kind, so that smoke's mod cases reach these kernels (``audits.suites.domain``)
_DOMAIN = {"mods": ["score_mod", "mask_mod", "block_sparse", "aux_scalars"]}


def _exact(q, k, v, *, out_dtype=None, return_lse=False, **kw):
    out, lse = attention_reference(q, k, v, call=AttentionCall.from_kwargs(**kw), return_lse=True)
    dt = out_dtype or (torch.bfloat16 if q.dtype.itemsize == 1 else q.dtype)
    out = out.to(dt).to(torch.bfloat16 if q.dtype.itemsize == 1 else q.dtype)
    return (out, lse.float()) if return_lse else out


def _kernel(fn):
    fn.fa4_audit_domain = _DOMAIN
    return fn


@_kernel
def exact(q, k, v, **kw):
    """The FP64 reference rounded to the output dtype: the catalogue's correct kernel."""
    return _exact(q, k, v, **kw)


@_kernel
def bug_scale_dv(q, k, v, *, softmax_scale=None, **kw):
    """scale: scores scaled by 1/sqrt(dv) instead of 1/sqrt(d) (the same where d == dv)."""
    return _exact(q, k, v, softmax_scale=1 / math.sqrt(v.shape[-1]), **kw)


@_kernel
def bug_scale_padded(q, k, v, *, softmax_scale=None, **kw):
    """scale: 1/sqrt of the head dim padded to a multiple of 32 (d 72 -> 96, d 96 -> 96: the
    same where d is a multiple of 32)."""
    return _exact(q, k, v, softmax_scale=1 / math.sqrt(-(-q.shape[-1] // 32) * 32), **kw)


@_kernel
def bug_softcap_ignored(q, k, v, *, softcap=0.0, **kw):
    """softcap: ignored (the raw scores go to the softmax)."""
    return _exact(q, k, v, **kw)


@_kernel
def bug_sink_ignored(q, k, v, *, learnable_sink=None, **kw):
    """learnable sink: ignored (neither in the normaliser nor in the LSE)."""
    return _exact(q, k, v, **kw)


@_kernel
def bug_causal_ignored(q, k, v, *, causal=False, **kw):
    """causal: ignored (every key visible)."""
    return _exact(q, k, v, **kw)


@_kernel
def bug_window_ignored(q, k, v, *, window_size=(None, None), **kw):
    """local window: ignored (every key visible)."""
    return _exact(q, k, v, **kw)


@_kernel
def bug_window_left_off_by_one(q, k, v, *, window_size=(None, None), **kw):
    """local window: its left edge one key too far (left + 1)."""
    left, right = window_size
    return _exact(q, k, v, window_size=(None if left is None else left + 1, right), **kw)


@_kernel
def bug_gqa_modulo(q, k, v, **kw):
    """GQA: query head h reads KV head h % heads_kv instead of h // (heads_q / heads_kv)."""
    hq, hk = q.shape[2], k.shape[2]
    idx = torch.arange(hq) % hk
    return _exact(q, k[:, :, idx], v[:, :, idx], **kw)


@_kernel
def bug_score_mod_ignored(q, k, v, *, score_mod=None, **kw):
    """score_mod: ignored."""
    return _exact(q, k, v, **kw)


@_kernel
def bug_mask_mod_ignored(q, k, v, *, mask_mod=None, block_sparse_tensors=None, **kw):
    """mask_mod: ignored, and with it the block sparsity built from it (every key visible)."""
    return _exact(q, k, v, **kw)


@_kernel
def bug_aux_scalars_ignored(q, k, v, *, aux_scalars=None, **kw):
    """aux_scalars: the runtime scalars ignored, each read as 1 (a temperature of 1)."""
    return _exact(q, k, v, aux_scalars=None if aux_scalars is None else tuple(1.0 for _ in aux_scalars), **kw)


@_kernel
def bug_fp16_out_as_bf16(q, k, v, **kw):
    """dtype (fp16): the output rounded to bfloat16 first (an fp16 output computed as bf16)."""
    return _exact(q, k, v, out_dtype=torch.bfloat16 if q.dtype == torch.float16 else None, **kw)


@_kernel
def bug_bf16_out_as_fp16(q, k, v, **kw):
    """dtype (bf16): the output rounded to float16 first (fp16's range: |x| > 65504 is inf, below
    2**-14 subnormal)."""
    return _exact(q, k, v, out_dtype=torch.float16 if q.dtype == torch.bfloat16 else None, **kw)


def _through(dtype, other):
    """A kernel whose inputs of ``dtype`` pass through the fp8 format ``other`` first."""

    def kernel(q, k, v, **kw):
        if q.dtype == dtype:
            q, k, v = (t.float().to(other).float().to(dtype) for t in (q, k, v))
        return _exact(q, k, v, **kw)

    return _kernel(kernel)


bug_e4m3_as_e5m2 = _through(torch.float8_e4m3fn, torch.float8_e5m2)
bug_e4m3_as_e5m2.__doc__ = "dtype (fp8 e4m3): inputs read through e5m2 (2 mantissa bits instead of 3)"
bug_e5m2_as_e4m3 = _through(torch.float8_e5m2, torch.float8_e4m3fn)
bug_e5m2_as_e4m3.__doc__ = "dtype (fp8 e5m2): inputs read through e4m3 (its range: |x| > 448 is NaN)"


FEATURE_BUGS = {n[len("bug_") :]: f.__doc__ for n, f in dict(globals()).items() if n.startswith("bug_")}

#: bug -> the feature (``audits.suites.signal.FEATURES``) of the case that must fail it
AXIS = {
    "scale_dv": "head_dims",
    "scale_padded": "head_dims",
    "softcap_ignored": "softcap",
    "sink_ignored": "sink",
    "causal_ignored": "mask=causal",
    "window_ignored": "mask=local",
    "window_left_off_by_one": "mask=local",
    "gqa_modulo": "gqa",
    "score_mod_ignored": "score_mod",
    "mask_mod_ignored": "mask_mod",
    "aux_scalars_ignored": "aux_scalars",
    "fp16_out_as_bf16": "dtype=float16",
    "bf16_out_as_fp16": "dtype=bfloat16",
    "e4m3_as_e5m2": "dtype=float8_e4m3fn",
    "e5m2_as_e4m3": "dtype=float8_e5m2",
}
