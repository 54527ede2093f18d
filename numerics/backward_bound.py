r"""Per-element error bound of the FA4 backward pass: ``backward_error_bound(q, k, v, do, out, lse, nm)``.

Bounds |dq - exact|, |dk - exact|, |dv - exact| (and |dsink - exact|) for the computation
``fa4.model_bwd`` describes with the numerics record ``nm`` (read: ``nm.ds_dtype``, and whether
SM100's head-dim-256 dQ kernel applies; the backward takes the hardware exp2 on both archs and
its bound does not depend on the tiles or the summation order), evaluated from the exact
inputs and FP64 intermediates.  ``out`` and ``lse`` are what the forward returned (out in the
input dtype, lse float32): the bound is *conditional* on them, their errors against the FP64
forward (``|out - o|``, ``|lse - lse_exact|``) enter as measured inputs.  Every float32 sum is
bounded for *any* order and any grouping into MMA tiles, atomics and GQA head adds, so the bound
covers nondeterministic dQ.

Notation, one batch and query head (indices b, h dropped), query row i, key j, column c:
``u = 2**-24``; ``gamma(m) = m u / (1 - m u)``; exact FP64 quantities from the exact inputs and
the FP64 reference (``numerics.grad_reference``): logits ``s_ij``, ``lse_i``, ``P_ij =
exp(s_ij - lse_i)``, ``o_i``, ``dP_ij = dO_i.v_j``, ``D'_i = dO_i.o_i - dlse_i``, ``x_ij = dP_ij
- D'_i``, ``dS_ij = P_ij x_ij`` (times ``f'(r_ij)`` with a softcap, ``1 - tanh^2(r_ij / cap)``, or
a score_mod f).  Hatted
quantities are the kernel's.  ``dl_i = |lse^_i - lse_i|`` is measured (0 where both are -inf).
Absolute terms ``2**-126`` per product / add cover flush-to-zero of float32 subnormals.

1. Recomputed P.  ``P^ = ex2(fma(S^, sl2, -lse_log2))``, ``lse_log2 = fl(lse^ fl(log2 e))``.
   (b) Score, as ``numerics.forward_bound`` step 1 (its ``step1_score``): ``|S^ sl2 - s log2 e|
   <= e_score + |base| |sl2 - ideal|`` (log2 units; softcap: its fp32 FMUL, div.rn, MUFU.TANH
   with ``MUFU["tanh_abs"]``, FMUL).  (a) ``|lse_log2 - lse log2 e| <= dl log2 e + |lse^|
   (|fl(log2 e) - log2 e| + u fl(log2 e))``.  Their sum is E1; (c) the FFMA rounds once:
   ``E = E1 + u (|log2 P| + E1)``, and MUFU.EX2 has relative error ``EX2_REL``:
   ``|P^ - P| <= eP = P (2**E (1 + EX2_REL) - 1) + alpha``, ``alpha = 2**-126`` where
   ``log2 P + E < -125`` (flushed), else 0.  (d) The cast to the input dtype (RN, no overflow as
   P^ <= ~1): ``|P~ - P| <= eP~ = eP + u_in (P + eP) + sub_in / 2`` (half the smallest
   subnormal).  Masked pairs: P^ = P~ = 0 exactly (exp2(-inf)).
2. D.  The products fp32(O^) fp32(dO) are exact (16-bit operands) up to flushing, the rowsum of dv
   terms in any order: ``D^ - D = delta + r`` with the measured, signed ``delta = sum_c (O^ - o)
   dO`` and ``|r| <= gamma(dv) sum_c |O^| |dO| + dv 2**-126``; ``D'^ = fl(D^ - dlse)`` adds
   ``u (|D'| + |delta| + |r|)`` to r_D; elementwise ``eD = |delta| + r_D``.
3. dP = dO V^T, float32 MMA of dv exact products: ``edP = gamma(dv) sum_c |dO| |v| + dv 2**-126``.
4. dS.  ``x^ = fl(dP^ - D'^)``: ``ex = edP + eD + u (|x| + edP + eD)`` — the absolute errors
   scale with |dP| + |D| (steps 2-3), never with the cancelling |dP - D|.  ``dS^ = fl(P^ x^)``:
   ``edS = eP (|x| + ex) + P ex + u (P + eP)(|x| + ex) + 2**-126``.
   Score mods (softcap included, as ``numerics.forward_bound.softcap_score_mod``: production's
   ``create_softcap_scoremod_bwd``).  ``flash_bwd_sm90.py`` ``mma_one_m_block`` keeps the
   pre-mod S (``acc_S_pre``), and after ``dS = P (dP - D)`` calls ``score_mod_bwd(dS, S_pre *
   scale)`` (``softmax.py`` ``apply_score_mod_bwd_inner``): ``dS_pre^ = grad^(g^, s^)`` with
   ``g^`` the float32 dS_post (exact ``g = dS``, error ``e_g = edS`` above) and ``s^ =
   fl(fl32(q.k) scale32)`` within ``e_pre`` of the pre-mod score s (the forward's step 1).
   Exactly ``dS_pre = g f'(s)``, and
   ``grad^(g^, s^) - g f'(s) = [grad^(g^, s^) - g^ f'(s^)] + g^ [f'(s^) - f'(s)] + (g^ - g) f'(s)``,
   so ``edS_pre = grad_error(|g| + e_g, s^) + (|g| + e_g) curvature(I) e_pre + e_g |f'(s)| +
   2**-126`` (mean value theorem for f' on ``I = [s - e_pre, s + e_pre]``; grad_error, which
   must be nondecreasing in |g|, at I's ends as in the forward; 2**-126 for a flushed result),
   and dS <- g f'(s), with ``f'`` from the mod's ``grad(1, s)`` in float64.  A grad_error or
   curvature hook that is None makes the dS error +inf wherever the mod applies.  Softcap's
   hooks (``numerics.forward_bound.softcap_grad_error``, ``softcap_curvature``): ``t^`` MUFU.TANH
   of the float32 quotient, ``f^ = 1 - t^ t^`` (FFMA or FMUL+FSUB), ``fl(g f^)``; ``|f''| =
   (2/cap) |tanh sech^2|``, at most ``4 / (3 sqrt(3) cap)``.
   Cast to ds_dtype (``nm.ds_dtype`` or the input dtype): ``edS~ = edS + u_ds (|dS| + edS) +
   sub_ds / 2`` (inf where |dS| + edS may exceed the format's max).
5. dV_j = sum over the query rows and GQA heads seeing j of ``P~ dO`` (exact products), float32,
   any order and grouping: with ``n_j`` the number of (head, row) pairs that see key j (the
   others add exact zeros, which do not round), ``e = sum |eP~| |dO| + gamma(n_j) sum (P + eP~)
   |dO| + 2 n_j 2**-126``; output cast ``e + u_out (|dV| + e) + sub_out / 2``.
6. dK = scale (dS~^T Q), dQ = scale (dS~ K) likewise (gamma over n_j for dK, the visible keys n_i
   for dQ), with the scale's FMUL on the accumulator ``a^``: ``|fl(a^ scale32) - a scale| <=
   scale32 e + |scale32 - scale| |a| + u scale32 (|a| + e)``, then the output cast.  SM100's
   head-dim-256 dQ kernel scales dS in float32 *before* its cast instead: one more rounding per
   term, ``u sum (|dS| + edS~)|k|`` in accumulator units, and the cast's subnormal floor taken at
   the scaled size, ``sub_ds / (2 scale32) sum_visible |k|``, are added to e before the same
   scaled() (which then over-counts the accumulator's own FMUL: conservative).
7. dsink_h = -sum_{b,i} P_sink D'.  ``P_sink^ = ex2(fl(fl(sink - lse^) fl(log2 e)))``, exponent
   error ``E_s = (dl + u |y|(1+u)) fl(log2 e) + (|y| + dl) |fl(log2 e) - log2 e| + u |y| (1+u)
   fl(log2 e)``, ``y = sink - lse^``; ``eP_s`` as in step 1.  The FFMA chain and butterflies
   sum N = b sq exact products (any order): ``|sum P_s delta| + sum eP_s (|D'| + eD) + P_s r_D
   + gamma(N) sum (P_s + eP_s)(|D'| + eD) + 2 N 2**-126``, then the cast to the sink's dtype.

Mask mods and block sparsity change only the visible pairs, per batch and head
(``numerics.reference.call_visibility`` of each row chunk); the counts n_i, n_j of steps 5-6 are
then per (batch, row, head) and per (batch, key, kv head).  docs/mods.md "Bounds with mods" gives the
whole derivation with mods.

Rows with no visible key contribute exact zeros (dQ bound 0; keys no query sees: dK, dV bound 0)
unless inputs are non-finite.  Any NaN in the bound's evaluation (non-finite inputs reaching it,
conservatively including masked positions) is reported as inf.

Rigour.  Steps 1-7 are rigorous first-order-free bounds (every product of error terms is kept),
under the same assumptions as ``numerics.forward_bound``: the MMAs' internal sums behave as
round-to-nearest float32 sums of exact products in some order (Higham's gamma bound; a
truncating tensor-core adder would need 2u), the MUFU constants ``MUFU`` (H200 exhaustive
measurement; Blackwell not re-measured), and ``softcap`` representable in float32 (as the
forward bound assumes).  The bound is evaluated in float64, whose own roundings (relative
~1e-16 on terms of relative size >= 2**-24) are not accounted for; ``P = exp(s - lse)`` uses the
FP64 reference LSE (its float64 error ~|lse| 1e-16, against the u |lse^| term kept in step 1a).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from numerics.call import AttentionCall
from numerics.forward_bound import (
    MUFU,
    TINY32,
    dot_products,
    gamma,
    hook_at_ends,
    mod_score,
    softcap_score_mod,
    step1_score,
)
from numerics.forward_bound import UNIT_ROUNDOFF as _U
from numerics.fp import format_of
from numerics.fp import to_f32 as _f32
from numerics.grad_reference import attention_grad_reference
from numerics.mods import index_grid
from numerics.reference import call_visibility, score_mod_derivative, visible_mask

__all__ = ["backward_error_bound"]

_TINY = 2.0**-126
#: a call without softcap or score_mod: step1_score's plain branch (the score_mod branch is _p_ds's own)
_PLAIN = AttentionCall()


def _nan_to_inf(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isnan(x), torch.full_like(x, math.inf), x)


def _ex2_err(p, log2p, e, mask):
    """|P^ - P| for P^ = ex2(t) with |t - log2 P| <= e: relative MUFU.EX2 plus flushing (steps 1c, 7)."""
    rel = p * (torch.exp2(e) * (1 + MUFU["ex2_rel"]) - 1)
    flush = torch.where(log2p + e < -125, torch.full_like(p, _TINY), torch.zeros_like(p))
    return torch.where(mask, rel + flush, torch.zeros_like(p))


def _cast(e, exact_abs, fmt):
    return e + fmt.unit_roundoff * (exact_abs + e) + fmt.smallest_subnormal / 2


def _finish(e, n, shape_perm):
    """NaN -> inf; zero where nothing was summed (n == 0) and the bound is finite."""
    e = _nan_to_inf(e)
    e = torch.where((n == 0) & torch.isfinite(e), torch.zeros_like(e), e)
    return e.permute(*shape_perm).contiguous()


#: float64 bytes of (batch, heads_q, rows, seqlen_k) intermediates one row chunk may hold; about
#: 16 such tensors are alive at once
CHUNK_BUDGET = 2**31
_LIVE = 16


@dataclass(frozen=True)
class _Consts:
    """Scalars of one bound evaluation: scale (exact and as the kernel's float32), softcap,
    log2 e (both), the input and dS formats, the GQA group size; the call (its scalars bound)
    and its ``score_mod`` (the softcap flag as ``numerics.forward_bound.softcap_score_mod``,
    production's own form of it) with ``aux`` (its aux tensors)."""

    scale: float
    scale32: float
    softcap: float
    l2e: float
    l2e32: float
    fmt_in: object
    fmt_ds: object
    g: int
    call: AttentionCall
    score_mod: object = None
    aux: object = None

    @classmethod
    def of(cls, q, k, v, nm, call: AttentionCall) -> _Consts:
        d = q.shape[-1]
        scale = call.scale(d)
        l2e = math.log2(math.e)
        fmt_ds = format_of(getattr(nm, "ds_dtype", None) or q.dtype)
        cap = call.softcap
        sm = softcap_score_mod(cap) if cap > 0 else call.score_mod
        return cls(
            scale,
            _f32(scale),
            cap,
            l2e,
            _f32(l2e),
            format_of(q.dtype),
            fmt_ds,
            q.shape[2] // k.shape[2],
            call,
            sm,
            call.aux_tensors,
        )

    def scaled(self, e_acc, exact):
        """Step 6: the FMUL by the float32 scale on an accumulator with error ``e_acc``, then the
        output cast; ``exact``: the exact gradient."""
        exact_abs = exact.double().abs()
        a_abs = exact_abs / self.scale
        e = self.scale32 * e_acc + abs(self.scale32 - self.scale) * a_abs + _U * self.scale32 * (a_abs + e_acc)
        return _cast(e, exact_abs, self.fmt_in)


def _row_terms(q, do, out, lse, dlse, reference, c: _Consts) -> dict:
    """Per (batch, head, row): step 1a's LSE terms and step 2's D' with its error parts."""
    lse_ex, lse_k = reference["lse"].double(), lse.double()  # (b, h, i)
    dl = (lse_k - lse_ex).abs()
    dl = torch.where(lse_k == lse_ex, torch.zeros_like(dl), _nan_to_inf(dl))
    lse_k_abs = torch.where(torch.isinf(lse_k) & (lse_k < 0), torch.zeros_like(lse_k), lse_k.abs())
    o_ex, out64, do64 = reference["out"].double(), out.double(), do.double()
    dvd = do.shape[-1]
    delta = ((out64 - o_ex) * do64).sum(-1).permute(0, 2, 1)  # signed, measured
    r_d = (gamma(dvd) * (out64.abs() * do64.abs()).sum(-1) + dvd * _TINY).permute(0, 2, 1)
    dprime = (o_ex * do64).sum(-1).permute(0, 2, 1)
    if dlse is not None:
        dprime = dprime - dlse.double()
    r_d = r_d + _U * (dprime.abs() + delta.abs() + r_d)  # rounding part of D'^ - D' (delta excluded)
    e_lse = (dl * c.l2e + lse_k_abs * (abs(c.l2e32 - c.l2e) + _U * c.l2e32) * (1 + _U)).unsqueeze(-1)
    return {
        "lse_ex": lse_ex,
        "lse_k": lse_k,
        "dl": dl,
        "e_lse": e_lse,
        "delta": delta,
        "r_d": r_d,
        "dprime": dprime,
        "e_d": delta.abs() + r_d,
    }


def _p_ds(qc, k, v, doc, vis, rw: dict, c: _Consts, rows: torch.Tensor):
    """Steps 1 and 3-4 on a chunk of query rows (indices ``rows``): (P, its cast error eP~,
    |dS|, its cast error eDS~), each (b, h, rows, sk)."""
    zero = torch.zeros((), dtype=torch.float64, device=qc.device)
    dot, e_dot, v64 = dot_products(qc, k, v)
    if c.score_mod is None:
        _sl2, d_sl2, base, e_score = step1_score(dot, e_dot, c.scale, c.scale32, c.l2e, call=_PLAIN)
        s_nat = dot * c.scale
    else:  # step1_score's score_mod branch, keeping e_pre for step 4's f'
        s_pre, e_pre, s_nat, e_post = mod_score(dot, e_dot, c.scale, c.scale32, c.score_mod, c.aux, rows=rows)
        d_sl2, base, e_score = abs(c.l2e32 - c.l2e), s_nat, e_post * c.l2e32
    log2p = torch.where(vis, (s_nat - rw["lse_ex"].unsqueeze(-1)) * c.l2e, -math.inf)
    p = torch.where(vis, torch.exp2(log2p), zero)
    e1 = e_score + base.abs() * d_sl2 + rw["e_lse"]
    e_exp = torch.where(vis, e1 + _U * (log2p.abs() + e1), zero)
    ep = _ex2_err(p, log2p, e_exp, vis)
    ep_t = torch.where(vis, ep + c.fmt_in.unit_roundoff * (p + ep) + c.fmt_in.smallest_subnormal / 2, zero)
    do64 = doc.double()
    dvd = do64.shape[-1]
    dp = torch.einsum("bihc,bjhc->bhij", do64, v64)
    e_dp = gamma(dvd) * torch.einsum("bihc,bjhc->bhij", do64.abs(), v64.abs()) + dvd * _TINY
    x = dp - rw["dprime"].unsqueeze(-1)
    ex = e_dp + rw["e_d"].unsqueeze(-1)
    ex = ex + _U * (x.abs() + ex)
    ds = torch.where(vis, p * x, zero)
    e_ds = ep * (x.abs() + ex) + p * ex + _U * (p + ep) * (x.abs() + ex) + _TINY
    if c.score_mod is not None:
        ds, e_ds = _mod_chain(ds, e_ds, s_pre, e_pre, c, rows)
        ds = torch.where(vis, ds, zero)  # f' may be non-finite at masked pairs: 0 * inf is not 0
    e_ds = torch.where(vis, e_ds, zero)
    e_ds_t = torch.where(vis, _cast(e_ds, ds.abs(), c.fmt_ds), zero)
    e_ds_t = torch.where(ds.abs() + e_ds > c.fmt_ds.max, torch.full_like(e_ds_t, math.inf), e_ds_t)
    return p, ep_t, ds.abs(), e_ds_t


def _mod_chain(ds, e_ds, s_pre, e_pre, c: _Consts, rows):
    """Step 4, score_mod: ``(dS_pre, its error)`` from ``dS_post`` = ``ds`` (error ``e_ds``)
    through ``score_mod_bwd`` at the kernel's float32 pre-mod score ``s^`` (within ``e_pre`` of
    s): ``|grad^(g^, s^) - g f'(s)| <= grad_error(|g| + e_g, s^) + (|g| + e_g) curvature e_pre +
    e_g |f'(s)| + 2**-126`` (module doc, step 4).  A hook that is None gives +inf."""
    sm = c.score_mod
    fprime = score_mod_derivative(s_pre, sm, c.aux, rows=rows)
    if sm.grad_error is None or sm.curvature is None:
        return ds * fprime, torch.full_like(ds, math.inf)
    b, h, i, j = s_pre.shape
    idx = (*index_grid(b, h, i, j, rows=rows, device=s_pre.device), c.aux)
    lo, hi = s_pre - e_pre, s_pre + e_pre
    g_hi = ds.abs() + e_ds
    moved = torch.where(e_pre > 0, g_hi * sm.curvature(lo, hi, *idx).to(ds.dtype) * e_pre, torch.zeros_like(ds))
    own = hook_at_ends(lambda s, *ix: sm.grad_error(g_hi, s, *ix), lo, hi, *idx).to(ds.dtype)
    return ds * fprime, own + moved + e_ds * fprime.abs() + TINY32


def _mod_chunk_vis(q, k, c: _Consts, rows, acc: dict) -> torch.Tensor:
    """With a mask_mod or block sparsity: the visibility of query rows ``rows``,
    (B|1, H|1, rows, sk) (``numerics.reference.call_visibility``), counted into ``acc["n_q"]``
    (keys per (batch, row, head)) and ``acc["n_key"]`` ((row) pairs per (batch, key, head))."""
    b, sq, hq, _ = q.shape
    sk, r = k.shape[1], rows.numel()
    vis = call_visibility(batch=b, heads=hq, seqlen_q=sq, seqlen_k=sk, call=c.call, rows=rows, device=q.device)
    vis_f = vis.expand(b, hq, r, sk).to(torch.float64)
    acc["n_q"][:, rows] = vis_f.sum(-1).permute(0, 2, 1).unsqueeze(-1)  # (b, rows, hq, 1)
    acc["n_key"] += vis_f.sum(-2).permute(0, 2, 1).unsqueeze(-1)
    return vis


def _accumulate(q, k, v, do, reference, rw: dict, c: _Consts, nm) -> dict:
    """Steps 1-6's sums over query-row chunks (``CHUNK_BUDGET``): dV's and dK's two error sums
    per key, accumulated over the chunks, and dQ's accumulator error per row.  Without a
    mask_mod or block sparsity the visibility is the flag mask, one (sq, sk) tensor as before
    mods; with them it is computed per chunk, (B|1, H|1, rows, sk), as are the counts."""
    b, sq, hq, d = q.shape
    sk = k.shape[1]
    dev = q.device
    k64 = k.double().repeat_interleave(c.g, dim=2)
    ak = k64.abs()
    f64 = dict(dtype=torch.float64, device=dev)
    acc = {
        n: torch.zeros(b, sk, hq, w, **f64) for n, w in (("v1", v.shape[-1]), ("v2", v.shape[-1]), ("k1", d), ("k2", d))
    }
    acc["q"] = torch.zeros(b, sq, hq, d, **f64)
    masks = c.call.has_mask_mods
    if not masks:
        vis_all = visible_mask(sq, sk, causal=c.call.causal, window_size=c.call.window_size, device=dev)
        n_q = vis_all.sum(-1).to(torch.float64).view(1, sq, 1, 1)  # keys per row (dQ)
        acc["n_key"] = (vis_all.sum(-2).to(torch.float64) * c.g).view(1, sk, 1, 1)  # (head, row) pairs per key
    else:
        n_q = torch.zeros(b, sq, hq, 1, **f64)
        acc["n_key"] = torch.zeros(b, sk, hq, 1, **f64)  # per query head here; per kv head after the loop
    acc["n_q"] = n_q
    live = _LIVE + (8 if c.score_mod is not None else 0)  # the score_mod's interval, f', hooks
    step = max(1, CHUNK_BUDGET // (live * 8 * b * hq * max(sk, 1)))
    hd256 = _dq_scales_ds(nm, d, v.shape[-1])
    for i0 in range(0, sq, step):
        i1 = min(sq, i0 + step)
        rows = torch.arange(i0, i1, device=dev)
        rwc = {n: rw[n][:, :, i0:i1] for n in ("lse_ex", "e_lse", "dprime", "e_d")}  # (b, h, rows[, 1])
        if not masks:
            vis = vis_all[i0:i1].view(1, 1, i1 - i0, sk)
        else:
            vis = _mod_chunk_vis(q, k, c, rows, acc)
        nq = n_q[:, i0:i1]
        p, ep_t, ads, e_ds_t = _p_ds(q[:, i0:i1], k, v, do[:, i0:i1], vis, rwc, c, rows)
        ado, aq = do[:, i0:i1].double().abs(), q[:, i0:i1].double().abs()
        acc["v1"] += torch.einsum("bhij,bihc->bjhc", ep_t, ado)
        acc["v2"] += torch.einsum("bhij,bihc->bjhc", p + ep_t, ado)
        acc["k1"] += torch.einsum("bhij,bihd->bjhd", e_ds_t, aq)
        acc["k2"] += torch.einsum("bhij,bihd->bjhd", ads + e_ds_t, aq)
        t2 = torch.einsum("bhij,bjhd->bihd", ads + e_ds_t, ak)
        e_q = torch.einsum("bhij,bjhd->bihd", e_ds_t, ak) + gamma(nq) * t2 + 2 * nq * _TINY
        if hd256:  # one more rounding per term, the cast's floor at the scaled size (module doc, step 6)
            if vis.shape[0] == 1 and vis.shape[1] == 1:
                vis_k = torch.einsum("xyij,bjhd->bihd", vis.to(torch.float64), ak)
            else:
                vis_k = torch.einsum("bhij,bjhd->bihd", vis.expand(b, hq, i1 - i0, sk).to(torch.float64), ak)
            e_q = e_q + _U * t2 + c.fmt_ds.smallest_subnormal / 2 / c.scale32 * vis_k
        acc["q"][:, i0:i1] = e_q
    if masks:  # (b, sk, hq, 1) -> (b, sk, hk, 1): the (head, row) pairs of each kv head's query heads
        acc["n_key"] = acc["n_key"].view(b, sk, hq // c.g, c.g, 1).sum(3)
    return acc


def _dsink_bound(learnable_sink, lse, reference, rw: dict, c: _Consts, n_t: int) -> torch.Tensor:
    """Step 7: the dsink bound per head from the per-row terms."""
    hq = learnable_sink.shape[0]
    sink = learnable_sink.double().view(1, hq, 1)
    lse_k, lse_ex, dl = rw["lse_k"], rw["lse_ex"], rw["dl"]
    y = sink - lse_k
    y_abs = y.abs()
    ea = dl + _U * y_abs * (1 + _U)
    e_s = ea * c.l2e32 + (y_abs + dl) * abs(c.l2e32 - c.l2e) + _U * y_abs * (1 + _U) * c.l2e32
    log2ps = (sink - lse_ex) * c.l2e
    ps = torch.exp2(log2ps)
    eps = _ex2_err(ps, log2ps, e_s, torch.ones_like(ps, dtype=torch.bool))
    eps = torch.where(torch.isfinite(lse_k), eps, torch.full_like(eps, math.inf))
    adp, e_d = rw["dprime"].abs(), rw["e_d"]
    e_sink = (
        (ps * rw["delta"]).sum((0, 2)).abs()
        + (eps * (adp + e_d) + ps * rw["r_d"]).sum((0, 2))
        + gamma(n_t) * ((ps + eps) * (adp + e_d)).sum((0, 2))
    )
    e_sink = e_sink + 2 * n_t * _TINY
    return _nan_to_inf(_cast(e_sink, reference["dsink"].double().abs(), format_of(learnable_sink.dtype)))


def _dq_scales_ds(nm, d: int, dv: int) -> bool:
    """SM100's dedicated head-dim-256 dQ kernel: dS multiplied by the scale in float32 before its
    cast, no scale on the accumulator (``fa4.model_bwd``, "Head dim 256 on SM100")."""
    dedicated = not getattr(nm, "bwd_hd256_generic", False)
    return getattr(nm, "arch", None) == "sm100" and (d, dv) == (256, 256) and dedicated


def backward_error_bound(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    nm,
    *,
    call: AttentionCall,
    dlse: torch.Tensor | None = None,
    reference: dict | None = None,
) -> dict:
    """Float64 bounds ``{"dq", "dk", "dv", "dsink"}`` on |grad - exact| elementwise (module doc),
    shaped like the gradients (dsink None without a sink).  ``out``, ``lse``: the forward's
    returned output and float32 LSE; ``reference``: the dict of
    ``numerics.grad_reference.attention_grad_reference`` for these inputs (computed if None).
    ``call``: the call's keywords, its mods included (module doc, "Mods")."""
    call = call.bind_scalars()  # the call's runtime scalars (numerics.mods)
    learnable_sink = call.learnable_sink
    if reference is None:
        reference = attention_grad_reference(q, k, v, do, call=call, dlse=dlse)
    c = _Consts.of(q, k, v, nm, call)
    rows = _row_terms(q, do, out, lse, dlse, reference, c)
    acc = _accumulate(q, k, v, do, reference, rows, c, nm)
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    n_key = acc["n_key"]

    def group(t):  # (b, sk, hq, c) -> (b, sk, hk, c), summing each kv head's g query heads
        return t.view(b, sk, hk, c.g, t.shape[-1]).sum(3)

    # step 5: dV
    e_v = group(acc["v1"]) + gamma(n_key) * group(acc["v2"]) + 2 * n_key * _TINY
    dv_b = _finish(_cast(e_v, reference["dv"].double().abs(), c.fmt_in), n_key, (0, 1, 2, 3))
    # step 6: dK, dQ
    e_k = c.scaled(group(acc["k1"]) + gamma(n_key) * group(acc["k2"]) + 2 * n_key * _TINY, reference["dk"])
    dk_b = _finish(e_k, n_key, (0, 1, 2, 3))
    dq_b = _finish(c.scaled(acc["q"], reference["dq"]), acc["n_q"], (0, 1, 2, 3))
    dsink_b = None if learnable_sink is None else _dsink_bound(learnable_sink, lse, reference, rows, c, b * sq)
    return {"dq": dq_b, "dk": dk_b, "dv": dv_b, "dsink": dsink_b}
