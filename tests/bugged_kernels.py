"""Kernels with seeded bugs, and helpers, for the runner tests.  ``BUGS`` is the catalogue: one
seeded bug per feature axis, each of which the smoke suite must fail (tests/test_catalogue.py)."""

import math

import torch

from fa4.model import attention
from numerics.call import AttentionCall


def exact(q, k, v, *, return_lse=False, **kw):
    """An exact kernel: the FP64 reference rounded to the output dtype."""
    from numerics.reference import attention_reference

    out, lse = attention_reference(q, k, v, call=AttentionCall.from_kwargs(**kw), return_lse=True)
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


# ---------------------------------------------------------------------------------------------
# A plain blockwise online-softmax kernel (float32, 128-key tiles) and the bugs seeded into it.
# ---------------------------------------------------------------------------------------------

BUGS = {
    "no_causal": "masking: ignores the causal mask",
    "window_off_by_one": "masking: the local window's right edge one key too far",
    "gqa_tile": "GQA mapping: query head h reads kv head h % heads_kv instead of h // group",
    "no_o_rescale": "rescaling: O is not rescaled when the running max grows",
    "stale_sum": "rescaling: the row sum is not rescaled when the running max grows",
    "flush_p": "flush: P below 2**-10 is dropped from the numerator",
    "saturate_p": "saturation: P scaled by 2**17 before its fp16 cast overflows",
    "nan_leak": "NaN handling: an additive -inf mask lets NaN at masked keys through",
    "lse_log2": "LSE: returned in log2 units",
    "layout": "layout: reads non-contiguous inputs as if they were contiguous",
    "bf16_accum": "accumulation precision: O accumulated in bfloat16",
    "sink_ignored": "learnable sink: ignored (neither in the normaliser nor in the LSE)",
    "softcap_no_div": (
        "softcap: the logit is softcap * tanh(s) instead of softcap * tanh(s / softcap) — the same "
        "only where tanh saturates (|s| >> softcap), so logits near the cap are wrong"
    ),
    "fp16_lagging_max": (
        "range (fp16): lazy rescaling's threshold of 16 compared with the max's lag in natural-log "
        "units (scale where scale_log2 belongs): the row max lags by up to 16 nats = 23 log2 units "
        "and P = e**lag exceeds fp16's 65504 (e**11.09): inf in the fp16 P once the max drifts"
    ),
    "fp8_p_saturates": (
        "range (fp8 e4m3): lazy rescaling with threshold 4 (log2) on top of the fp8 path's max_offset "
        "8: P = 2**(lag + 8) reaches 2**12 and saturates at e4m3's 448 while the row sum keeps the "
        "float32 P (flash-attention #2716)"
    ),
    "e5m2_p_saturates": (
        "range (fp8 e5m2): lazy rescaling with threshold 20 (log2) on top of the fp8 path's max_offset "
        "8: P = 2**(lag + 8) reaches 2**28 and saturates at e5m2's 57344 (2**15.8) while the row sum "
        "keeps the float32 P (e5m2's coarse logits rise in steps of up to 6 log2 units, so a smaller "
        "threshold rarely lags past 7.8)"
    ),
}

#: lazy rescaling of the seeded range bugs: (lag threshold, in natural-log units; max_offset, log2)
_LAZY = {
    "fp16_lagging_max": (16.0, 0),
    "fp8_p_saturates": (4.0 * math.log(2), 8),
    "e5m2_p_saturates": (20.0 * math.log(2), 8),
}
#: the fp8 range bugs: the input dtype whose P saturates (other dtypes run the correct kernel)
_SATURATES = {"fp8_p_saturates": torch.float8_e4m3fn, "e5m2_p_saturates": torch.float8_e5m2}


def _online(
    q,
    k,
    v,
    *,
    bug=None,
    softmax_scale=None,
    causal=False,
    window_size=(None, None),
    softcap=0.0,
    learnable_sink=None,
    return_lse=False,
):
    from numerics.reference import visible_mask

    if bug == "layout":
        q, k, v = (
            torch.as_strided(t, t.shape, torch.empty(t.shape).stride()) if not t.is_contiguous() else t
            for t in (q, k, v)
        )
    b, sq, hq, d = q.shape
    sk, hk, dv = k.shape[1], k.shape[2], v.shape[-1]
    scale = 1 / math.sqrt(d) if softmax_scale is None else softmax_scale
    idx = torch.arange(hq) % hk if bug == "gqa_tile" else torch.arange(hq) // (hq // hk)
    kf, vf = k.float()[:, :, idx], v.float()[:, :, idx]
    qf = q.float()
    w = tuple(window_size)
    if bug == "window_off_by_one" and w[1] is not None:
        w = (w[0], w[1] + 1)
    vis = visible_mask(sq, sk, causal=causal and bug != "no_causal", window_size=w)
    acc_dt = torch.bfloat16 if bug == "bf16_accum" else torch.float32
    # lazy rescaling (the seeded range bugs only): the row max may lag by `lag` before O and the
    # sum are rescaled; P carries a factor 2**offset (O and the sum alike: it cancels in O / sum)
    lag, offset = _LAZY.get(bug, (0.0, 0))
    if bug in _SATURATES and q.dtype != _SATURATES[bug]:
        lag, offset = 0.0, 0  # the bug of one fp8 dtype's path
    m = torch.full((b, hq, sq, 1), -math.inf)
    lsum = torch.zeros(b, hq, sq, 1)
    o = torch.zeros(b, hq, sq, dv, dtype=acc_dt)
    for j0 in range(0, sk, 128):
        j1 = min(j0 + 128, sk)
        s = torch.einsum("bihd,bjhd->bhij", qf, kf[:, j0:j1]) * scale
        if softcap:
            s = softcap * torch.tanh(s if bug == "softcap_no_div" else s / softcap)
        mk = vis[:, j0:j1]
        if bug != "nan_leak" and not bool(mk.any()):
            continue  # a tile no query sees is skipped, as FA's block ranges do
        s = s + torch.where(mk, 0.0, -math.inf) if bug == "nan_leak" else s.masked_fill(~mk, -math.inf)
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        if lag:
            m_new = torch.where(torch.isfinite(m) & (m_new - m <= lag), m, m_new)
        m_safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        alpha = torch.exp(m - m_safe)
        p = torch.exp(s - m_safe) * 2.0**offset
        pn = torch.where(p < 2.0**-10, 0.0, p) if bug == "flush_p" else p
        if bug == "saturate_p":
            pn = (pn * 2.0**17).to(torch.float16).float() / 2.0**17
        elif bug in _SATURATES and q.dtype == _SATURATES[bug]:
            fmax = torch.finfo(q.dtype).max  # cvt.rn.satfinite: clamp to the largest finite value
            pn = pn.clamp(max=fmax).to(q.dtype).float()
        else:
            pn = pn.to(q.dtype if q.dtype.itemsize == 2 else torch.bfloat16).float()
        lsum = (lsum if bug == "stale_sum" else lsum * alpha) + p.sum(-1, keepdim=True)
        pv = torch.einsum("bhij,bjhd->bhid", pn, vf[:, j0:j1])
        o = ((o.float() if bug == "no_o_rescale" else o.float() * alpha) + pv).to(acc_dt)
        m = m_new
    if learnable_sink is not None and bug != "sink_ignored":
        sink = learnable_sink.float().view(1, hq, 1, 1)
        m2 = torch.maximum(m, sink)
        m2s = torch.where(torch.isfinite(m2), m2, torch.zeros_like(m2))
        lsum = lsum * torch.exp(m - m2s) + torch.exp(sink - m2s) * 2.0**offset
        o = (o.float() * torch.exp(m - m2s)).to(acc_dt)
        m = m2
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    bad = lsum == 0
    out = (o.float() / torch.where(bad, 1.0, lsum)).to(q.dtype if q.dtype.itemsize == 2 else torch.bfloat16)
    lse = torch.where(bad, -math.inf, m_safe + torch.log(lsum) - offset * math.log(2)).squeeze(-1)
    if bug == "lse_log2":
        lse = lse / math.log(2)
    out = out.transpose(1, 2).contiguous()
    return (out, lse) if return_lse else out


def online(q, k, v, **kw):
    """The correct blockwise kernel."""
    return _online(q, k, v, **kw)


def _make(bug):
    def kernel(q, k, v, **kw):
        return _online(q, k, v, bug=bug, **kw)

    kernel.__doc__ = BUGS[bug]
    return kernel


for _bug in BUGS:
    globals()[f"bug_{_bug}"] = _make(_bug)


def crashes_on_fp16(q, k, v, **kw):
    """Kills its process on fp16 inputs (a stand-in for a segfault / illegal address)."""
    import os

    if q.dtype == torch.float16:
        os._exit(134)
    return online(q, k, v, **kw)
