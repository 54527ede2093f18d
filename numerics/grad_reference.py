"""FP64 gradient references for the attention backward pass, and their exact certification.

Conventions are the forward reference's (numerics/reference.py: shapes, GQA head mapping,
bottom-right causal and windows, softcap, the learnable sink, empty rows).  ``do`` has the
output's shape (batch, seqlen_q, heads_q, dv); ``dlse`` (optional) the LSE's, (batch, heads_q,
seqlen_q).

Derivation (one batch, one query head h, one query row i; j runs over the keys visible to i):

* scores ``r_ij = scale * q_i.k_j``; logits ``s_ij = r_ij`` or, with a softcap,
  ``s_ij = cap * tanh(r_ij / cap)``, whose derivative is ``ds/dr = 1 - tanh^2(r/cap) =
  sech^2(r/cap)``;
* ``lse_i = log(sum_j exp(s_ij) + exp(sink_h))`` (the sink term only with a sink),
  ``P_ij = exp(s_ij - lse_i)``, ``P_sink,i = exp(sink_h - lse_i)``, ``out_i = sum_j P_ij v_j``;
* ``dP_ij/ds_ik = P_ij (delta_jk - P_ik)``, so for the loss ``L = sum dO.out + sum dlse.lse``:
  ``dL/ds_ik = sum_c dO_ic sum_j v_jc P_ij (delta_jk - P_ik) + dlse_i P_ik
  = P_ik (dP_ik - D_i + dlse_i)`` with ``dP_ik = dO_i.v_k`` and ``D_i = sum_j P_ij dP_ij =
  dO_i.out_i`` (FlashAttention's ``D = rowsum(dO * O)``, here from the FP64 ``out``).  Writing
  ``D'_i = D_i - dlse_i``: ``dS_ik = P_ik (dP_ik - D'_i)``, and ``dS_raw = dS * sech^2(r/cap)``
  with a softcap;
* ``dQ_i = scale sum_j dS_raw_ij k_j``, ``dK_j = scale sum_i dS_raw_ij q_i``, ``dV_j = sum_i
  P_ij dO_i``; under GQA kv head ``kh`` is read by query heads ``kh*g .. kh*g + g - 1``
  (``g = heads_q // heads_kv``), so its dK and dV sum over those heads too;
* the sink: ``d lse_i / d sink_h = P_sink,i`` and ``d P_ij / d sink_h = -P_ij P_sink,i``, hence
  ``d out_i / d sink_h = -P_sink,i out_i`` and ``dsink_h = sum_{batch, i} (dlse_i P_sink,i -
  P_sink,i dO_i.out_i) = -sum_{batch, i} P_sink,i D'_i``.

Mods (``numerics.mods``; the forward reference's module doc): with a score_mod the logit is
``s_ij = f(r_ij)`` (f the mod's ``fn`` at the scaled score r, in float64) and the chain factor
is ``f'(r_ij)``, computed by the mod's backward reference form ``grad(1, r)`` (the reference form
of production's ``score_mod_bwd``: ``grad(g, r) = g f'(r)``), so ``dS_raw = dS * f'(r)``; the
softcap flag is the special case ``f = cap tanh(r / cap)``, kept on its own (its factor as
``cosh**-2``, below) because its closed form is better conditioned than ``1 - tanh^2``.  A
mask_mod and block sparsity only change which pairs are visible, per batch and head:
``numerics.reference.call_visibility`` of each row chunk, (B|1, H|1, rows, seqlen_k), grouped
here as (B|1, hk|1, g|1, rows, seqlen_k).

Rows with no visible key and no sink have P = 0, out = 0, lse = -inf and contribute exactly zero to
every gradient (their dS row is empty); keys no query sees get exactly zero dK and dV.  With a sink
an empty row has P_sink = 1 and lse = sink: it adds ``dlse_i - dO_i.out_i = dlse_i`` to dsink.

Non-finite inputs: every gradient is the IEEE float64 evaluation of the closed form above in which
the sums over keys (for a query) and over queries (for a key) run over *visible* pairs only —
masked pairs are absent, never multiplied by zero (``0 * NaN`` would be NaN).  So a NaN or inf at a
masked position (a key no query of the row sees, a q or dO row that sees no key) reaches no
gradient; a NaN at a visible key makes its row's lse, P and D NaN, hence that row's dQ, the dK
and dV of every key the row sees, and dsink of its head.  NaN in ``dO_i`` or ``dlse_i`` of a row
with visible keys spreads the same way; in an empty row it reaches nothing, except dsink when a
sink is given (IEEE: ``D_i = 0 * NaN``).  :func:`_contract` implements the visible-only sums.

A visible score of +inf (e.g. -inf in K against a negative q) makes its row's softmax inf/inf,
indeterminate: lse = +inf and out, D, dQ and dS are NaN by IEEE, and P is NaN at every key the
row sees — not ``exp(s - lse) = 0`` at its finite keys, a value no kernel owes: PyTorch's softmax
gives NaN there, and production FA4 (4.0.0b36) reports the row's LSE as -inf (``softmax.py``
``Softmax.finalize``: row sum NaN from exp2(inf - inf)), which ``flash_bwd_preprocess.py``
``FlashAttentionBackwardPreprocess.kernel`` turns into ``lse_log2 = 0``, so its backward
(``flash_bwd_sm90.py`` ``mma_one_m_block``, P = exp2(S * scale_log2 - lse_log2)) adds the
unnormalised exp2(S * scale_log2) dO_i to the dV of each key the row sees.  So that row makes dV
NaN at those keys, as a NaN score does, and a kernel's value there is a semantics deviation.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import mpmath
import torch

from numerics.call import AttentionCall, effective_window
from numerics.reference import (
    apply_score_mod,
    call_visibility,
    fsum2,
    mod_logits_row,
    mp_softmax,
    score_mod_derivative,
)

__all__ = ["attention_grad_reference", "attention_lowprec_grads", "exact_grad_elements", "default_chunk_rows"]

#: bound on the (batch, heads_q, chunk, seqlen_k) float64 intermediates of one chunk, in bytes
CHUNK_BUDGET = 256 * 2**20
#: such tensors alive at once: the weights P (s and p in place), the softcap factor, dP (dS in
#: place), and one einsum operand copy
_LIVE = 4


#: more such tensors a score_mod holds at its peak: its derivative's ones, the mod's result and
#: its in-place copy (``_chunk_forward``)
_LIVE_MOD = 3


def default_chunk_rows(
    *, batch: int, heads_q: int, seqlen_k: int, budget: int = CHUNK_BUDGET, score_mod: bool = False
) -> int:
    """Query rows per chunk keeping ``_LIVE`` float64 tensors of (batch, heads_q, rows, seqlen_k)
    (``_LIVE + _LIVE_MOD`` with a score_mod) under ``budget`` bytes (at least one row).  Inputs
    with NaN or inf take a slower path in :func:`_contract` that holds a few more such tensors."""
    per_row = (_LIVE + (_LIVE_MOD if score_mod else 0)) * 8 * batch * heads_q * max(seqlen_k, 1)
    return max(1, budget // per_row)


def _visible_rows(
    r0: int,
    r1: int,
    seqlen_q: int,
    seqlen_k: int,
    *,
    causal: bool,
    window_size: tuple[int | None, int | None],
    device: torch.device | str,
) -> torch.Tensor:
    """Rows ``r0:r1`` of :func:`numerics.reference.visible_mask` (same rule, tested equal), built
    without the full (seqlen_q, seqlen_k) mask: at 64k x 64k that alone would be 4 GiB."""
    left, right = effective_window(causal=causal, window_size=window_size)
    i = torch.arange(r0, r1, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    diag = i + (seqlen_k - seqlen_q)
    m = torch.ones(r1 - r0, seqlen_k, dtype=torch.bool, device=device)
    if right is not None:
        m &= j <= diag + right
    if left is not None:
        m &= j >= diag - left
    return m


def _grouped(m: torch.Tensor, hk: int, g: int) -> torch.Tensor:
    """A (B|1, H|1, rows, sk) visibility as (B|1, hk|1, g|1, rows, sk): the heads grouped per kv
    head as the chunk's tensors are (query head h = kh * g + gi)."""
    bb, hh, r, sk = m.shape
    return m.view(bb, 1, 1, r, sk) if hh == 1 else m.view(bb, hk, g, r, sk)


def _chunk_visibility(r0: int, r1: int, dims: tuple, call: AttentionCall, *, device) -> torch.Tensor:
    """The visible pairs of query rows r0:r1: :func:`_visible_rows` (rows, sk) without a
    mask_mod or block sparsity; with them the intersection
    with ``numerics.mods.visibility`` of these rows only, grouped (:func:`_grouped`)."""
    b, sq, hq, sk, hk, g = dims
    if not call.has_mask_mods:
        return _visible_rows(r0, r1, sq, sk, causal=call.causal, window_size=call.window_size, device=device)
    rows = torch.arange(r0, r1, device=device)
    m = call_visibility(batch=b, heads=hq, seqlen_q=sq, seqlen_k=sk, call=call, rows=rows, device=device)
    return _grouped(m, hk, g)


def _contract(eq: str, w: torch.Tensor, vis: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``torch.einsum(eq, w, x)`` summing over visible pairs only, with IEEE semantics there.

    ``w`` is a (b, hk, g, i, j) weight that is exactly 0 wherever ``vis`` (broadcast to it) is
    False; ``x`` is any input whose entries are contracted with w's i or j.  A plain einsum turns
    ``0 * NaN`` / ``0 * inf`` at a masked pair into NaN; here x's non-finite entries are zeroed for
    the einsum and their effect at visible pairs is put back from exact counts (einsums of 0/1
    indicators, exact in float64): any ``NaN``, ``0 * inf`` or ``inf * 0`` term gives NaN; ``+inf``
    and ``-inf`` terms together give NaN; otherwise an infinite term gives its signed inf.  The
    finite part keeps the einsum's own rounding and overflow.  Finite inputs take the plain einsum
    (bitwise what numerics.reference computes)."""
    fw, fx = torch.isfinite(w), torch.isfinite(x)
    if bool(fw.all()) and bool(fx.all()):
        return torch.einsum(eq, w, x)
    out = torch.einsum(eq, torch.where(fw, w, 0.0), torch.where(fx, x, 0.0))
    visw = vis.expand_as(w)

    def any_(a: torch.Tensor, c: torch.Tensor) -> torch.Tensor:  # some visible pair with a and c
        return torch.einsum(eq, a.to(w.dtype), c.to(w.dtype)) > 0

    inf = math.inf
    xpos, xneg = fx & (x > 0), fx & (x < 0)
    # w is 0 at masked pairs, so w's own NaN / inf / sign indicators are visible-only already;
    # the ones reading x alone (NaN in x, 0 * inf) must be restricted to visible pairs.
    nan = (
        any_(visw, torch.isnan(x))
        | any_(torch.isnan(w), torch.ones_like(x))
        | any_(torch.isinf(w), x == 0)
        | any_(visw & (w == 0), torch.isinf(x))
        | torch.isnan(out)
    )
    pinf = any_(w > 0, x == inf) | any_(w < 0, x == -inf) | any_(w == inf, xpos) | any_(w == -inf, xneg) | (out == inf)
    ninf = any_(w > 0, x == -inf) | any_(w < 0, x == inf) | any_(w == inf, xneg) | any_(w == -inf, xpos) | (out == -inf)
    out = torch.where(pinf, inf, torch.where(ninf, -inf, out))
    return torch.where(nan | (pinf & ninf), math.nan, out)


def _check_shapes(q, k, v, do, learnable_sink, dlse) -> tuple[int, int, int, int, int, int, int]:
    b, sq, hq, d = q.shape
    sk, hk, dv = k.shape[1], k.shape[2], v.shape[-1]
    if hq % hk:
        raise ValueError(f"heads_q ({hq}) must be a multiple of heads_kv ({hk})")
    if tuple(do.shape) != (b, sq, hq, dv):
        raise ValueError(f"do must have the output's shape {(b, sq, hq, dv)}, got {tuple(do.shape)}")
    if learnable_sink is not None and tuple(learnable_sink.shape) != (hq,):
        raise ValueError(f"learnable_sink must have shape ({hq},), got {tuple(learnable_sink.shape)}")
    if dlse is not None and tuple(dlse.shape) != (b, hq, sq):
        raise ValueError(f"dlse must have the LSE's shape {(b, hq, sq)}, got {tuple(dlse.shape)}")
    return b, sq, hq, d, sk, hk, dv


def attention_grad_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    *,
    call: AttentionCall,
    dlse: torch.Tensor | None = None,
    chunk_rows: int | None = None,
    scales: bool = False,
) -> dict[str, torch.Tensor]:
    """FP64 gradients of attention from the exact inputs: ``{"dq", "dk", "dv", "out", "lse"}``
    plus ``"dsink"`` (heads_q,) with a sink, all float64 on q's device, by the closed form of
    the module doc.

    With ``scales``, also each gradient's *scale*, ``"dq_scale"``, ``"dk_scale"``, ``"dv_scale"``
    (and ``"dsink_scale"``), the gradient's shape: the same sums taken over the absolute values of
    their terms, with dS's two terms before they cancel, |dS|_ij = P_ij (|dP_ij| + |D'_i|) times
    the chain factor's magnitude (dq = scale * sum_j |dS|_ij |K_j|, dk = sum_i |dS|_ij |scale q_i|,
    dv = sum_i P_ij |dO_i|, dsink = sum_i P_sink,i |D'_i|).  Where one key makes dP - D' cancel
    exactly (dq = 0) the scale is not 0: the floor of FA's criterion (``numerics.metrics.fa_floor``).
    With a sink, also ``"dsink_out_rss"`` (heads_q,): the root sum of squares of dsink's terms
    through D_i = dO_i.out_i, sqrt(sum_{batch, i, c} (P_sink,i dO_ic out_ic)^2), the magnitude at
    which a kernel that forms D from its output rounded to the input dtype (FlashAttention's
    backward preprocessing) moves dsink (``audits.verdict.gate.DSINK_ROUNDED_OUT``).

    The forward part is numerics.reference.attention_reference's arithmetic (scale folded into q,
    ``P = exp(s - m) / denominator``, ``out = (p V) / denominator``), so ``out`` and ``lse`` agree
    with it to float64 rounding.  Two numerical choices: the softcap factor is computed as
    ``cosh(r/cap)**-2`` rather than ``1 - tanh^2``, which cancels catastrophically once tanh is
    near 1 (at r/cap = 5 it loses 4 digits); ``P`` is ``exp(s - m) / den`` rather than
    ``exp(s - lse)``, whose rounding of lse costs ``|lse| * 1e-16`` relative.

    Query rows are processed ``chunk_rows`` at a time (default :func:`default_chunk_rows`: the
    (b, heads_q, chunk, seqlen_k) float64 intermediates stay under ~256 MiB); dq, out and lse are
    per row, dk, dv and dsink are accumulated across chunks in float64.  Inputs are not modified.
    The mods (module doc) are evaluated per chunk too (their visibility with
    ``call_visibility(rows=...)``, the score_mod on the chunk's scores); without them the
    computation is the one before they existed.
    """
    learnable_sink, score_mod = call.learnable_sink, call.score_mod
    b, sq, hq, d, sk, hk, dv = _check_shapes(q, k, v, do, learnable_sink, dlse)
    call = call.bind_scalars()  # the call's runtime scalars (numerics.mods)
    if score_mod is not None and score_mod.grad is None:
        raise ValueError(f"score_mod {score_mod.name!r} has no grad (no score_mod_bwd): its backward is refused")
    g = hq // hk
    dev, f64 = q.device, torch.float64
    scale = call.scale(d)
    k64, v64 = k.to(dev, f64), v.to(dev, f64)
    sink = None if learnable_sink is None else learnable_sink.to(dev, f64).view(1, hk, g, 1, 1)
    res = {
        "dq": torch.empty(b, sq, hq, d, dtype=f64, device=dev),
        "dk": torch.zeros(b, sk, hk, d, dtype=f64, device=dev),
        "dv": torch.zeros(b, sk, hk, dv, dtype=f64, device=dev),
        "out": torch.empty(b, sq, hq, dv, dtype=f64, device=dev),
        "lse": torch.empty(b, hq, sq, dtype=f64, device=dev),
    }
    dsink = torch.zeros(hk, g, dtype=f64, device=dev)
    dims = (b, sq, hq, sk, hk, g)
    auto = default_chunk_rows(batch=b, heads_q=hq, seqlen_k=sk, score_mod=score_mod is not None)
    rows = auto if chunk_rows is None else int(chunk_rows)
    if rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {rows}")
    for r0 in range(0, sq, rows):
        r1 = min(sq, r0 + rows)
        c = r1 - r0
        vis = _chunk_visibility(r0, r1, dims, call, device=dev)
        # Heads are kept grouped, (b, hk, g, ...): the GQA sums of dK and dV over each kv head's g
        # query heads then happen inside the contractions, and k, v are never expanded.
        qs = (q[:, r0:r1].to(dev, f64) * scale).reshape(b, c, hk, g, d)  # a copy: inputs stay untouched
        dos = do[:, r0:r1].to(dev, f64).reshape(b, c, hk, g, dv)
        fw = _chunk_forward(qs, k64, v64, vis, sink=sink, call=call, r0=r0)
        # D'_i = dO_i.out_i - dlse_i
        dprime = (fw["out"] * dos).sum(dim=-1).permute(0, 2, 3, 1)  # (b, hk, g, c)
        if dlse is not None:
            dprime = dprime - dlse[:, :, r0:r1].to(dev, f64).reshape(b, hk, g, c)
        ds = _chunk_ds(fw, dos, v64, vis, dprime)
        if scales:
            _chunk_scales(res, fw, dos, v64, vis, dprime, k64, qs, (r0, r1, scale))
        res["dq"][:, r0:r1] = _contract("bhgij,bjhd->bihgd", ds, vis, k64).mul_(scale).reshape(b, c, hq, d)
        res["dk"] += _contract("bhgij,bihgd->bjhd", ds, vis, qs)  # qs carries the scale
        res["dv"] += _contract("bhgij,bihgc->bjhc", fw["p"], vis, dos)
        res["out"][:, r0:r1] = fw["out"].reshape(b, c, hq, dv)
        res["lse"][:, :, r0:r1] = fw["lse"].reshape(b, hq, c)
        if sink is not None:
            dsink -= ((fw["p_sink"] / fw["den"]).squeeze(-1) * dprime).sum(dim=(0, 3))
        del fw, ds
    if sink is not None:
        res["dsink"] = dsink.reshape(hq)
        if scales:
            res["dsink_scale"] = res["dsink_scale"].reshape(hq)
            res["dsink_out_rss"] = res["dsink_out_rss"].sqrt().reshape(hq)
    return res


def _chunk_scales(res: dict, fw: dict, dos, v64, vis, dprime, k64, qs, rows: tuple) -> None:
    """The gradients' scales (:func:`attention_grad_reference`, ``scales``) of one chunk of query
    rows ``rows`` = (r0, r1, softmax scale), into ``res``: dq's rows set, dk / dv / dsink summed."""
    r0, r1, scale = rows
    b, c, hk, g, _ = qs.shape
    if "dk_scale" not in res:
        res["dq_scale"] = torch.empty(b, res["dq"].shape[1], hk * g, qs.shape[-1], dtype=qs.dtype, device=qs.device)
        res["dk_scale"], res["dv_scale"] = torch.zeros_like(res["dk"]), torch.zeros_like(res["dv"])
        if fw["p_sink"] is not None:
            res["dsink_scale"] = torch.zeros(hk, g, dtype=qs.dtype, device=qs.device)
            res["dsink_out_rss"] = torch.zeros(hk, g, dtype=qs.dtype, device=qs.device)  # squares here
    dp = torch.einsum("bihgc,bjhc->bhgij", dos, v64).abs_()  # |dP|, masked pairs removed below
    ads = dp.add_(dprime.abs()[..., None]).mul_(fw["p"])
    if fw["fac"] is not None:
        ads.mul_(fw["fac"].abs())
    ads.masked_fill_(~vis, 0.0)
    res["dq_scale"][:, r0:r1] = (
        _contract("bhgij,bjhd->bihgd", ads, vis, k64.abs()).mul_(scale).reshape(b, c, hk * g, -1)
    )
    res["dk_scale"] += _contract("bhgij,bihgd->bjhd", ads, vis, qs.abs())
    res["dv_scale"] += _contract("bhgij,bihgc->bjhc", fw["p"], vis, dos.abs())
    if fw["p_sink"] is not None:
        w = (fw["p_sink"] / fw["den"]).squeeze(-1)  # P_sink,i (b, hk, g, c)
        res["dsink_scale"] += (w * dprime.abs()).sum(dim=(0, 3))
        terms = (fw["out"] * dos).permute(0, 2, 3, 1, 4) * w[..., None]  # P_sink,i dO_ic out_ic
        res["dsink_out_rss"] += terms.square_().sum(dim=(0, 3, 4))


def _chunk_forward(qs, k64, v64, vis, *, sink, call: AttentionCall, r0: int = 0) -> dict:
    """One chunk of query rows (from row ``r0``), forward: ``p`` (P, exactly 0 at masked pairs),
    ``den`` (the row denominators, 1 where 0), ``out``, ``lse``, ``fac`` (the chain factor of
    softcap or the score_mod, or None) and ``p_sink`` (the sink's unnormalised weight, or None);
    heads grouped (b, hk, g, ...)."""
    b, c, hk, g, _ = qs.shape
    masked = ~vis
    s = torch.einsum("bihgd,bjhd->bhgij", qs, k64)  # (b, hk, g, c, sk): r = scale * q.k
    fac = None
    softcap = call.softcap
    if softcap and softcap > 0:
        s.div_(softcap)
        fac = torch.cosh(s).pow_(-2)  # sech^2(r/cap); cosh = inf past 710 gives the limit 0
        s.tanh_().mul_(softcap)
    elif call.score_mod is not None:  # f'(r) at the pre-mod score, then f(r)
        sm, aux, rows = call.score_mod, call.aux_tensors, torch.arange(r0, r0 + c, device=s.device)
        flat = s.reshape(b, hk * g, c, s.shape[-1])  # (b, heads_q, rows, sk): the mods' head index
        fac = score_mod_derivative(flat, sm, aux, rows=rows).reshape(s.shape)
        s = apply_score_mod(flat, sm, aux, rows=rows).reshape(s.shape).clone()  # in place below
    s.masked_fill_(masked, -math.inf)
    m = s.amax(dim=-1, keepdim=True)  # NaN-propagating, as in the forward reference
    if sink is not None:
        m = torch.maximum(m, sink.expand(b, hk, g, c, 1))
    m_safe = torch.where(torch.isfinite(m), m, 0.0)
    p = s.sub_(m_safe).exp_()  # masked pairs: exp(-inf) = 0 exactly
    denom = p.sum(dim=-1, keepdim=True)
    p_sink = None
    if sink is not None:
        p_sink = torch.exp(sink - m_safe)
        denom = denom + p_sink
    den = torch.where(denom == 0, 1.0, denom)  # (b, hk, g, c, 1)
    out = _contract("bhgij,bjhc->bihgc", p, vis, v64).div_(den.permute(0, 3, 1, 2, 4))
    lse = (m_safe + torch.log(denom)).squeeze(-1)  # (b, hk, g, c)
    if sink is None:
        empty = ~vis.any(dim=-1)  # (c,), or (B|1, hk|1, g|1, c) with mods
        e_out = empty.view(1, c, 1, 1, 1) if empty.dim() == 1 else empty.permute(0, 3, 1, 2).unsqueeze(-1)
        out.masked_fill_(e_out, 0.0)
        lse.masked_fill_(empty, -math.inf)
    # P; the masked_fill keeps masked pairs at exactly 0 where den is NaN (0 / NaN = NaN).  A row
    # whose largest score is +inf has the indeterminate softmax inf/inf: its P is NaN at every
    # visible key, not exp(s - lse) = 0 at its finite ones (module doc, "Non-finite inputs")
    p = p.div_(den).masked_fill_((m == math.inf) & vis, math.nan).masked_fill_(masked, 0.0)
    return {"p": p, "den": den, "out": out, "lse": lse, "fac": fac, "p_sink": p_sink}


def _chunk_ds(fw: dict, dos, v64, vis, dprime) -> torch.Tensor:
    """dS = P (dP - D') (times the softcap factor), exactly 0 at masked pairs."""
    ds = torch.einsum("bihgc,bjhc->bhgij", dos, v64)  # dP = dO V^T; NaN at masked pairs is fine:
    ds.sub_(dprime[..., None]).mul_(fw["p"])  # ... the masked_fill below removes it
    if fw["fac"] is not None:
        ds.mul_(fw["fac"])
    return ds.masked_fill_(~vis, 0.0)  # the precondition of _contract; 0 * NaN would not be 0


@dataclass
class _Row:
    """One (batch, head_q, query) row of :func:`exact_grad_elements` in mpmath."""

    col: dict[int, int]  # visible key -> its position in p and ds (insertion order = key order)
    p: list  # P_ij
    ds: list  # dS_raw_ij = sech^2(r_ij/cap) P_ij (dP_ij - D'_i), without the scale
    p_sink: mpmath.mpf | None  # P_sink,i (None without a sink)
    dprime: mpmath.mpf  # D'_i = dO_i.out_i - dlse_i


def _exact_row(t: dict, vis_row: torch.Tensor, bi: int, h: int, i: int, scale, softcap: float) -> _Row | None:
    """The softmax and dS of one row, exactly as :func:`exact_grad_elements` explains; None when
    one of its visible inputs is not finite (the FP64 reference's IEEE business).  A score_mod
    (``t["score_mod"]``): f and f' in float64 at the rounded exact scores
    (``numerics.reference.mod_logits_row``)."""
    kh = h // t["g"]
    js = torch.nonzero(vis_row).flatten().tolist()
    qi, doi = t["q"][bi, i, h], t["do"][bi, i, h]
    kj, vj = t["k"][bi, js, kh], t["v"][bi, js, kh]
    sink = None if t["sink"] is None else t["sink"][h]
    dlse = 0.0 if t["dlse"] is None else t["dlse"][bi][h][i]
    ok = all(bool(torch.isfinite(x).all()) for x in (qi, doi, kj, vj))
    if not ok or not math.isfinite(dlse) or (sink is not None and not math.isfinite(sink)):
        return None
    logits, fac = [], []
    for row in (kj * qi).tolist():  # exact products of <= 26-bit numbers
        r = fsum2(row) * scale
        if softcap and softcap > 0:
            u = r / softcap
            logits.append(softcap * mpmath.tanh(u))
            fac.append(mpmath.sech(u) ** 2)
        else:
            logits.append(r)
    sm = t.get("score_mod")
    if sm is not None:
        where = dict(batch_idx=bi, head_idx=h, q_idx=i, keys=js, aux_tensors=t["aux_tensors"], device=t["device"])
        fac = [mpmath.mpf(x) for x in mod_logits_row(sm, logits, derivative=True, **where)]
        logits = [mpmath.mpf(x) for x in mod_logits_row(sm, logits, **where)]
    w = mp_softmax(logits, None if sink is None else mpmath.mpf(sink))
    if w is None:  # no visible key, no sink: P = 0, out = 0, nothing flows
        return _Row({}, [], [], None, mpmath.mpf(0))
    m, e, den = w
    p = [x / den for x in e]
    vcols = vj.T.tolist()  # (dv, n)
    out = [mpmath.fsum(pj * x for pj, x in zip(p, col)) for col in vcols]
    dprime = mpmath.fsum(o * x for o, x in zip(out, doi.tolist())) - mpmath.mpf(dlse)
    dp = [fsum2(row) for row in (vj * doi).tolist()]  # dP_ij = dO_i.v_j, exact products again
    ds = [pj * (dpj - dprime) for pj, dpj in zip(p, dp)]
    if fac:
        ds = [x * f for x, f in zip(ds, fac)]
    p_sink = None if sink is None else mpmath.exp(mpmath.mpf(sink) - m) / den
    return _Row({j: n for n, j in enumerate(js)}, p, ds, p_sink, dprime)


def _key_sums(row, t: dict, name: str, seen_by, bi: int, j: int, kh: int) -> list | None:
    """``sum_{h in kh's group} sum_{i sees j} w_hij x_hi`` per column, exactly (mpmath.fsum): for
    ``name`` "dk" w = dS_raw and x = q (the scale is applied by the caller), for "dv" w = P and
    x = dO; ``seen_by(bi, h, j)``: bool (seqlen_q,), the rows of head h that see key j.  None
    when a row that sees key j is not finite."""
    g = t["g"]
    x_all = t["q"] if name == "dk" else t["do"]
    terms: list[list] = [[] for _ in range(x_all.shape[-1])]
    for h in range(kh * g, (kh + 1) * g):
        for i in torch.nonzero(seen_by(bi, h, j)).flatten().tolist():
            r = row(bi, h, i)
            if r is None:
                return None
            w = r.ds[r.col[j]] if name == "dk" else r.p[r.col[j]]
            for c, xc in enumerate(x_all[bi, i, h].tolist()):
                terms[c].append(w * xc)
    return [mpmath.fsum(tc) for tc in terms]


def exact_grad_elements(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    *,
    dq_rows: Iterable[tuple[int, int, int]] = (),
    dk_rows: Iterable[tuple[int, int, int]] = (),
    dv_rows: Iterable[tuple[int, int, int]] = (),
    dsink_heads: Iterable[int] = (),
    call: AttentionCall,
    dlse: torch.Tensor | None = None,
    dps: int = 30,
) -> dict[str, dict]:
    """Sampled gradient elements of :func:`attention_grad_reference` in exact arithmetic:
    ``{"dq": {(b, i, h): [d mpf]}, "dk": {(b, j, kh): [d mpf]}, "dv": {(b, j, kh): [dv mpf]},
    "dsink": {h: mpf}}`` for the requested ``dq_rows`` (batch, query, head_q), ``dk_rows`` and
    ``dv_rows`` (batch, key, head_kv) and ``dsink_heads``; an element is None when a visible input
    it depends on is not finite (those are the IEEE rules of the module doc, FP64's business).

    Method, for inputs of at most 26 significant bits (fp8, fp16, bf16, float32; float64 is refused
    as in numerics.reference.exact_attention_rows) and ``sink``/``dlse`` any float:

    1. ``q_i.k_j`` and ``dP_ij = dO_i.v_j`` are sums of exact float64 products (<= 2 x 24 bits),
       summed by ``fsum2`` to 2**-106 relative.
    2. scale, tanh and sech^2 (softcap), ``exp(s - m)``, the normaliser, ``P``, ``P_sink`` and
       every product with an mpf are mpmath at ``dps`` digits (30: ~1e-31 per operation, the
       logit's ``|s| * 1e-31`` absolute error giving P a relative ``|s| * 1e-31``).
    3. every other sum (``out_i``, ``D_i``, the sums over keys and queries) is ``mpmath.fsum``,
       which adds mpf terms exactly (integer mantissas, terms below 2**-(2 prec) of the running
       sum aside) and rounds once.
    Each element is thus a short chain of operations each within ~1e-30 of its terms, so it is
    exact to ~1e-29 (for |logits| <= 100) of the sum of the absolute values of its defining sum
    (e.g. ``scale sum_j |dS_raw_ij k_jc|``); relative to the element itself that is ~1e-20 or
    better unless it cancels by more than 1e9.  The tests also check it against dps=60.

    Cost: one mpmath softmax per needed row — O(seqlen_k * (d + dv)) mpmath operations, ~1-5 ms at
    seqlen_k 64 — and rows are shared between elements.  A dQ row needs one row; a dK or dV row j
    of kv head kh needs every row of its g query heads that sees key j, and dsink_h every row of
    head h in every batch; keep those problems small (seqlen <= 64 runs in seconds).  mpmath's
    precision is restored afterwards, whatever happens.

    Mods: the visible pairs are the call's (``numerics.reference.call_visibility``, per batch and
    head); a score_mod's f and f' are the one inexact step, evaluated in float64 at the exact
    scores correctly rounded to float64 (``numerics.reference.mod_logits_row`` says why and
    what it costs: ~1e-16 relative, so the certification checks everything but f's own float64
    evaluation).
    """
    if any(t.dtype == torch.float64 for t in (q, k, v, do)):
        raise ValueError("exact_grad_elements needs inputs of <= 26 significant bits (fp8/fp16/bf16/float32)")
    learnable_sink = call.learnable_sink
    b, sq, hq, d, sk, hk, dv = _check_shapes(q, k, v, do, learnable_sink, dlse)
    call = call.bind_scalars()  # the call's runtime scalars (numerics.mods)
    g = hq // hk
    cpu = lambda x: None if x is None else x.detach().double().cpu()
    t = {"q": cpu(q), "k": cpu(k), "v": cpu(v), "do": cpu(do), "g": g}
    t["sink"] = None if learnable_sink is None else cpu(learnable_sink).tolist()
    t["dlse"] = None if dlse is None else cpu(dlse).tolist()
    t.update(score_mod=call.score_mod, aux_tensors=call.aux_tensors, device=q.device)
    dq_rows, dk_rows, dv_rows, dsink_heads = (list(x) for x in (dq_rows, dk_rows, dv_rows, dsink_heads))
    dims = (b, sq, hq, sk, hk, g)

    def vis(r0: int, r1: int) -> torch.Tensor:  # (B|1, H|1, rows, sk): per batch and head with mods
        if not call.has_mask_mods:
            win = dict(causal=call.causal, window_size=call.window_size)
            return _visible_rows(r0, r1, sq, sk, device="cpu", **win).view(1, 1, r1 - r0, sk)
        m = _chunk_visibility(r0, r1, dims, call, device=q.device).cpu()
        return m.reshape(m.shape[0], -1, r1 - r0, sk)

    def at(m: torch.Tensor, bi: int, h: int) -> torch.Tensor:
        return m[bi if m.shape[0] > 1 else 0, h if m.shape[1] > 1 else 0]

    old = mpmath.mp.dps
    try:
        mpmath.mp.dps = dps
        sm_scale = call.softmax_scale
        scale = mpmath.mpf(1) / mpmath.sqrt(d) if sm_scale is None else mpmath.mpf(float(sm_scale))
        cache: dict[tuple[int, int, int], _Row | None] = {}

        def row(bi: int, h: int, i: int) -> _Row | None:
            if (bi, h, i) not in cache:
                cache[bi, h, i] = _exact_row(t, at(vis(i, i + 1), bi, h)[0], bi, h, i, scale, call.softcap)
            return cache[bi, h, i]

        res: dict[str, dict] = {"dq": {}, "dk": {}, "dv": {}, "dsink": {}}
        for bi, i, h in dq_rows:
            r = row(bi, h, i)
            kr = t["k"][bi, :, h // g].tolist()
            res["dq"][bi, i, h] = (
                None
                if r is None
                else [scale * mpmath.fsum(x * kr[j][c] for j, x in zip(r.col, r.ds)) for c in range(d)]
            )
        col_vis = vis(0, sq) if (dk_rows or dv_rows) else None
        for name, keys in (("dk", dk_rows), ("dv", dv_rows)):
            for bi, j, kh in keys:
                sums = _key_sums(row, t, name, lambda bi, h, j: at(col_vis, bi, h)[:, j], bi, j, kh)
                if sums is not None and name == "dk":  # dK_j = scale sum dS_raw q
                    sums = [scale * x for x in sums]
                res[name][bi, j, kh] = sums
        for h in dsink_heads:
            if learnable_sink is None:
                raise ValueError("dsink_heads needs a learnable_sink")
            rs = [row(bi, h, i) for bi in range(b) for i in range(sq)]
            res["dsink"][h] = None if any(r is None for r in rs) else -mpmath.fsum(r.p_sink * r.dprime for r in rs)
        return res
    finally:
        mpmath.mp.dps = old


def attention_lowprec_grads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    *,
    call: AttentionCall,
) -> dict[str, torch.Tensor]:
    """The gradients PyTorch gets doing the same math in the input dtype — FlashAttention's
    ``attention_ref(upcast=False)`` differentiated by autograd, the ``pt`` of FA's backward
    criterion (``flash-attention/tests/cute/test_flash_attn.py``): ``{"dq", "dk", "dv"}`` (and
    ``"dsink"``) in the inputs' dtypes.  Scores ``(q * scale) k^T``, softcap ``cap *
    tanh(s / cap)`` or the score_mod's ``fn`` (in the input dtype, differentiated by autograd
    as flex_attention's eager reference is: the mod's own ``grad`` is the kernel's business),
    masked scores -inf (the flag masks and the mods' visibility), the sink as one more column,
    softmax by ``exp(s - max) / sum``, rows with no visible key giving 0."""
    b, sq, hq, d = q.shape
    sk, g = k.shape[1], hq // k.shape[2]
    call = call.bind_scalars()  # the call's runtime scalars (numerics.mods)
    softcap, score_mod, learnable_sink = call.softcap, call.score_mod, call.learnable_sink
    scale = call.scale(d)
    with torch.enable_grad():
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        sink = None if learnable_sink is None else learnable_sink.detach().clone().requires_grad_(True)
        qq, kk, vv = leaves[0], leaves[1].repeat_interleave(g, 2), leaves[2].repeat_interleave(g, 2)
        s = torch.einsum("bihd,bjhd->bhij", qq * scale, kk)
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        if score_mod is not None:
            s = apply_score_mod(s, score_mod, call.aux_tensors)
        vis = call_visibility(batch=b, heads=hq, seqlen_q=sq, seqlen_k=sk, call=call, device=q.device)
        s = s.masked_fill(~vis, -math.inf)
        if sink is not None:
            s = torch.cat([s, sink.to(s.dtype).view(1, hq, 1, 1).expand(b, hq, sq, 1)], dim=-1)
        m = s.detach().amax(-1, keepdim=True)
        e = torch.exp(s - torch.where(torch.isfinite(m), m, torch.zeros_like(m)))
        den = e.sum(-1, keepdim=True)
        p = e[..., :sk] / torch.where(den > 0, den, torch.ones_like(den))
        out = torch.einsum("bhij,bjhc->bihc", p, vv)
        grads = torch.autograd.grad(out, leaves + ([sink] if sink is not None else []), do.to(out.dtype))
    return dict(zip(("dq", "dk", "dv", "dsink"), (t.detach() for t in grads)))
