"""A plain float32 attention with a hand-written FlashAttention-style backward, and the field's
backward bugs seeded into it (one per ``bug=``): the catalogue tests/test_backward_catalogue.py
shows FA's backward criterion against FP64 gradients catches each of :data:`BUGS` on a small
case; tests/test_backward_suite_catalogue.py runs ``fa4-audit run --backward`` on the smoke suite
for every bug of :data:`ALL_BUGS` (:data:`BUGS` and :data:`MORE_BUGS`).  Each bug has its kernel,
``bug_<name>``, a module-level function whose docstring is the bug's entry.

Like a tiled kernel that never loads the tiles of keys no query sees, each pass zeroes K and V of
the keys its own mask leaves unseen (so NaN/inf there never leak, as FA's semantics demand), and a
row whose scores hold a NaN gets a NaN LSE (not -inf) whose NaN the backward propagates (and a
row whose top score is +inf, the softmax inf/inf, a NaN P at every key it sees); fp8
inputs give a bf16 output (the audit's kernel contract) and no backward (NotImplementedError, as
production FA4 refuses it).  Every kernel takes ``deterministic`` (and, but for
``dq_nondeterministic``, honours it: the math is sequential).

Forward (float32 throughout, masks / softcap / learnable sink / GQA as numerics/reference.py):
``P = exp2((s - m) * log2 e) / den``, ``out`` cast to the input dtype, ``lse`` float32 natural log.
Backward (FA's recomputation, float32): ``D = rowsum(O * dO) - dLSE`` from the returned (input-dtype)
``O``, ``P = exp2((s - lse) * log2 e)`` with the same exp2 the LSE came from, ``dP = dO V^T``,
``dS = P (dP - D)``, times ``1 - tanh^2(r / cap)`` with a softcap, ``dQ = scale dS K``,
``dK = scale dS^T Q`` and ``dV = P^T dO`` summed over each kv head's query heads (GQA), and
``dsink = -sum_{b, i} P_sink D``.  Gradients are returned in the inputs' dtypes.
"""

from __future__ import annotations

import math

import torch

from fa4.ex2 import ex2_emulation
from numerics.reference import visible_mask

__all__ = ["ALL_BUGS", "BUGS", "MORE_BUGS", "attention", "clean"]

LOG2E = 1.4426950408889634

#: the seeded backward bugs, each with the field issue it reproduces
BUGS = {
    "dq_no_scale": (
        "dQ = dS K without the softmax scale: dQ too large by sqrt(d) (dQ ~5x too large at hd256 when "
        "the scale was lost / wrong, TransformerEngine #3216)"
    ),
    "dv_unaligned_cols": (
        "dV columns beyond the largest multiple of 32 of head_dim_v dropped (left zero): dV corrupted "
        "when head_dim_v is not aligned to the reduction width (flash-attention #2552)"
    ),
    "softcap_no_chain": (
        "softcap backward missing: dS not multiplied by the chain factor 1 - tanh^2(r / cap) (flash-attention #2402)"
    ),
    "gqa_one_head": (
        "GQA: dK and dV taken from the first query head of each group only, not summed over the group "
        "(the GQA reduction done over one head)"
    ),
    "no_causal_in_bwd": (
        "the recomputed P (and dS) ignore the causal mask: masked pairs get exp(s - lse) in the backward "
        "(the causal mask missing from the backward's recomputation)"
    ),
    "sink_grad_missing": "the learnable-sink gradient missing: dsink = 0 (flash-attention #2706)",
    "ds_other_exp2": (
        "dS from a P computed with a different exp2 (the degree-1 polynomial, fa4.ex2.ex2_emulation(x, 1)) "
        "than the one the forward's LSE came from: P no longer sums to 1 against that LSE"
    ),
}

#: more seeded backward bugs (kept apart from :data:`BUGS`, whose set tests/test_backward_catalogue.py
#: pins), audited through ``fa4-audit run --backward`` on the smoke suite
MORE_BUGS = {
    "sink_grad_wrong_sign": (
        "the learnable-sink gradient with the wrong sign: dsink = +sum P_sink D instead of -sum P_sink D "
        "(the sign of d lse / d sink lost; the learnable-sink gradient class of flash-attention #2706)"
    ),
    "window_left_leak": (
        "masked keys leaking gradient: the backward's recomputed P ignores the local window's left edge, so "
        "keys left of the window (some no query sees) get exp(s - lse) and non-zero dK / dV (the backward's "
        "n_block_min taken without the window)"
    ),
    "window_off_by_one_bwd": (
        "local-window edge off by one in the backward only: the backward's mask uses left + 1 (right + 1 "
        "without a left edge) while the forward's is right, so one key per row gets a spurious P"
    ),
    "ds_rounded_operands": (
        "dS = P (rn(dP) - rn(D)) with rn the rounding to the gradient dtype (bf16 / fp16): dP and D rounded "
        "before the cancelling subtraction instead of dS after it"
    ),
    "dk_bf16_accum": (
        "dK (and its GQA reduction) accumulated over query blocks of 64 rows in a bf16 accumulator instead of float32"
    ),
    "dq_row_tile_dropped": (
        "dQ's query rows from the second 64-row block on zero: their accumulator read back from where no block "
        "wrote (production's SM90 dq at head dim 8, H200 2026-12-05: dq_accum allocated at the head dim "
        "rounded to 32, written at the tile's padding to 16: fa4.code_paths.sm90_accum_wider)"
    ),
    "dq_nondeterministic": (
        "nondeterministic dQ under deterministic=True: dQ sums the key blocks (64 keys) in a random order "
        "drawn afresh on every backward call (atomics), although the kernel takes deterministic=True"
    ),
}
#: every seeded bug
ALL_BUGS = {**BUGS, **MORE_BUGS}

#: query rows per dK block (dk_bf16_accum) and keys per dQ block (dq_nondeterministic)
BLOCK_M = BLOCK_N = 64
#: the generator of dq_nondeterministic's block order: seeded from the OS, never reseeded (the
#: global torch generator is left alone)
_ORDER_RNG = torch.Generator()
_ORDER_RNG.seed()


def _logits(qf, kf, scale, softcap):
    """(r, t, s): the scaled scores r = scale q.k, tanh(r / cap) (None without softcap), and the
    logits s, float32 (b, hq, sq, sk); kf already expanded to the query heads."""
    r = torch.einsum("bihd,bjhd->bhij", qf, kf) * scale
    if softcap and softcap > 0:
        t = torch.tanh(r / softcap)
        return r, t, t * softcap
    return r, None, r


def _skip_unseen(kf, vf, vis):
    """K and V (b, sk, h, d) with the keys no query sees under ``vis`` zeroed: a tiled kernel
    never loads their tiles, so NaN / inf there cannot reach any sum."""
    unseen = ~vis.any(0)
    if not bool(unseen.any()):
        return kf, vf
    m = unseen.view(1, -1, 1, 1)
    return kf.masked_fill(m, 0.0), vf.masked_fill(m, 0.0)


def _backward_window(bug, window_size):
    """The window the backward masks with: the forward's, but for the window bugs."""
    left, right = window_size
    if bug == "window_left_leak" and left is not None:
        return (None, right)
    if bug == "window_off_by_one_bwd":
        if left is not None:
            return (left + 1, right)
        if right is not None:
            return (left, right + 1)
    return (left, right)


def _dq_key_blocks_shuffled(ds, kf):
    """dQ = dS K (unscaled) summed over key blocks of BLOCK_N in float32 in a random order
    drawn afresh on every call (dq_nondeterministic)."""
    sk = kf.shape[1]
    starts = list(range(0, sk, BLOCK_N))
    dq = None
    for i in torch.randperm(len(starts), generator=_ORDER_RNG).tolist():
        j0 = starts[i]
        part = torch.einsum("bhij,bjhd->bihd", ds[..., j0 : j0 + BLOCK_N], kf[:, j0 : j0 + BLOCK_N])
        dq = part if dq is None else dq + part
    return dq


def _dk_bf16_accumulated(ds, qf, scale, hk, g):
    """dK = scale dS^T Q summed over the query blocks of BLOCK_M rows and the group's query heads
    with a bf16 accumulator (dk_bf16_accum): (b, sk, hk, d) bf16."""
    b, hq, sq, sk = ds.shape
    acc = torch.zeros(b, sk, hk, qf.shape[-1], dtype=torch.bfloat16)
    for h in range(g):
        for i0 in range(0, sq, BLOCK_M):
            heads = torch.arange(hk) * g + h
            part = torch.einsum("bhij,bihd->bjhd", ds[:, heads, i0 : i0 + BLOCK_M], qf[:, i0 : i0 + BLOCK_M, heads])
            acc = (acc.float() + part * scale).to(torch.bfloat16)
    return acc


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sink, bug, scale, causal, window_size, softcap, deterministic):
        b, sq, hq, d = q.shape
        sk, hk = k.shape[1], k.shape[2]
        idx = torch.arange(hq) // (hq // hk)
        vis = visible_mask(sq, sk, causal=causal, window_size=window_size)
        kf, vf = _skip_unseen(k.float(), v.float(), vis)
        qf, kf, vf = q.float(), kf[:, :, idx], vf[:, :, idx]
        _, _, s = _logits(qf, kf, scale, softcap)
        s = s.masked_fill(~vis, -math.inf)
        m = s.amax(-1, keepdim=True)
        if sink is not None:
            m = torch.maximum(m, sink.float().view(1, hq, 1, 1))
        m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp2((s - m_safe) * LOG2E)
        den = p.sum(-1, keepdim=True)
        if sink is not None:
            den = den + torch.exp2((sink.float().view(1, hq, 1, 1) - m_safe) * LOG2E)
        safe = torch.where(den > 0, den, torch.ones_like(den))
        out_dtype = torch.bfloat16 if q.dtype.itemsize == 1 else q.dtype  # fp8 in, bf16 out
        out = torch.einsum("bhij,bjhc->bihc", p / safe, vf).to(out_dtype)
        lse = torch.where(den > 0, m_safe + torch.log(safe), torch.full_like(m, -math.inf))
        lse = torch.where(torch.isnan(den), den, lse).squeeze(-1)  # NaN rows keep their NaN
        ctx.save_for_backward(q, k, v, sink, out, lse)
        ctx.cfg = (bug, scale, causal, window_size, softcap, deterministic)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, sink, out, lse = ctx.saved_tensors
        if q.dtype.itemsize == 1:  # as production FA4, which refuses its fp8 backward
            raise NotImplementedError("no fp8 backward (as production FA4)")
        bug, scale, causal, window_size, softcap, _ = ctx.cfg  # sequential math: deterministic anyway
        b, sq, hq, d = q.shape
        sk, hk, dvd = k.shape[1], k.shape[2], v.shape[-1]
        g = hq // hk
        idx = torch.arange(hq) // g
        vis = visible_mask(
            sq, sk, causal=causal and bug != "no_causal_in_bwd", window_size=_backward_window(bug, window_size)
        )
        kf, vf = _skip_unseen(k.float(), v.float(), vis)
        qf, kf, vf = q.float(), kf[:, :, idx], vf[:, :, idx]
        do_dtype = torch.bfloat16 if q.dtype.itemsize == 1 else q.dtype  # the output's (and dO's) dtype
        do = torch.zeros(b, sq, hq, dvd) if dout is None else dout.float()
        dl = torch.zeros(b, hq, sq) if dlse is None else torch.where(torch.isfinite(lse), dlse.float(), 0.0)
        # D' = rowsum(O * dO) - dLSE, from the returned O (FA's preprocess)
        dprime = (out.float() * do).sum(-1).permute(0, 2, 1) - dl  # (b, hq, sq)
        _, t, s = _logits(qf, kf, scale, softcap)
        lse_safe = torch.where(lse == -math.inf, torch.zeros_like(lse), lse)[..., None]  # NaN stays NaN
        x = ((s - lse_safe) * LOG2E).masked_fill(~vis, -math.inf)
        p = torch.exp2(x)  # the forward's exp2
        # a row whose top score is +inf has the softmax inf/inf: NaN at every key it sees, as in
        # PyTorch's softmax and the FP64 gradient reference (numerics/grad_reference.py)
        p = torch.where((lse_safe == math.inf) & vis, math.nan, p)
        p_ds = ex2_emulation(x.contiguous(), 1).masked_fill(~vis, 0.0) if bug == "ds_other_exp2" else p
        dp = torch.einsum("bihc,bjhc->bhij", do, vf)
        if bug == "ds_rounded_operands":  # rn(dP) - rn(D) in the gradient dtype
            rn = lambda t: t.to(do_dtype).float()
            ds = p_ds * (rn(dp) - rn(dprime)[..., None])
        else:
            ds = p_ds * (dp - dprime[..., None])
        if t is not None and bug != "softcap_no_chain":
            ds = ds * (1 - t * t)
        ds = ds.masked_fill(~vis, 0.0)
        if bug == "dq_nondeterministic":
            dq = _dq_key_blocks_shuffled(ds, kf)
        else:
            dq = torch.einsum("bhij,bjhd->bihd", ds, kf)
        if bug != "dq_no_scale":
            dq = dq * scale
        if bug == "dq_row_tile_dropped":
            dq = dq.clone()
            dq[:, BLOCK_M:] = 0.0
        dk_h = torch.einsum("bhij,bihd->bjhd", ds, qf) * scale  # per query head (b, sk, hq, d)
        dv_h = torch.einsum("bhij,bihc->bjhc", p, do)
        if bug == "gqa_one_head":
            dk, dv = dk_h.view(b, sk, hk, g, d)[:, :, :, 0], dv_h.view(b, sk, hk, g, dvd)[:, :, :, 0]
        else:
            dk, dv = dk_h.view(b, sk, hk, g, d).sum(3), dv_h.view(b, sk, hk, g, dvd).sum(3)
        if bug == "dk_bf16_accum":
            dk = _dk_bf16_accumulated(ds, qf, scale, hk, g)
        if bug == "dv_unaligned_cols":
            dv = dv.clone()
            dv[..., (dvd // 32) * 32 :] = 0.0
        dsink = None
        if sink is not None:
            p_sink = torch.exp2((sink.float().view(1, hq, 1) - lse_safe.squeeze(-1)) * LOG2E)
            dsink = -(p_sink * dprime).sum(dim=(0, 2))
            if bug == "sink_grad_wrong_sign":
                dsink = -dsink
            if bug == "sink_grad_missing":
                dsink = torch.zeros_like(dsink)
            dsink = dsink.to(sink.dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsink, None, None, None, None, None, None


def attention(
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
    deterministic=False,
):
    """Float32 attention with the hand-written backward; ``bug`` one of :data:`ALL_BUGS` or None
    (the clean kernel).  q, k, v: (b, s, h, d) bf16 / fp16 / fp8; returns out (input dtype, bf16
    for fp8) and, with ``return_lse``, lse (b, hq, sq) float32; differentiable in q, k, v,
    learnable_sink and lse.  ``deterministic``: accepted; the backward is deterministic either way
    (but for the ``dq_nondeterministic`` bug, which ignores it)."""
    if bug is not None and bug not in ALL_BUGS:
        raise ValueError(f"unknown bug {bug!r}; one of {sorted(ALL_BUGS)}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    out, lse = _Attention.apply(
        q, k, v, learnable_sink, bug, scale, causal, tuple(window_size), float(softcap or 0.0), bool(deterministic)
    )
    return (out, lse) if return_lse else out


def clean(q, k, v, *, deterministic: bool = False, **kw):
    """The correct kernel (no seeded bug); deterministic whatever ``deterministic`` says."""
    return attention(q, k, v, deterministic=deterministic, **kw)


def _make(bug):
    def kernel(q, k, v, *, deterministic: bool = False, **kw):
        return attention(q, k, v, bug=bug, deterministic=deterministic, **kw)

    kernel.__name__ = kernel.__qualname__ = f"bug_{bug}"
    kernel.__doc__ = ALL_BUGS[bug]
    return kernel


# the bugged kernels, module-level: bug_dq_no_scale, ..., bug_dq_nondeterministic
for _bug in ALL_BUGS:
    globals()[f"bug_{_bug}"] = _make(_bug)


def audit(kernels: list[str], cases: list, opts, out_dir) -> dict[str, list[dict]]:
    """``fa4-audit run --backward`` (``opts``: a ``BackwardOptions``) on this module's kernels
    named in ``kernels`` (``clean``, ``bug_<name>``), sharing inputs and references on CPU: each
    kernel's records in suite order."""
    from pathlib import Path

    from audits.engine.options import RunOptions
    from audits.engine.run import run_suites

    spec = {k: f"{Path(__file__).resolve()}:{k}" for k in kernels}
    options = RunOptions(out=out_dir, label="smoke", isolate=False, backward=opts)
    recs = run_suites(list(spec.values()), cases, options)
    return {k: recs[s] for k, s in spec.items()}
