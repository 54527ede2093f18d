"""High-precision attention references: FP64 on the inputs' device, mpmath on sampled rows.

Conventions (docs/design.md; the audited-callable signature of ``flash_attn.cute.flash_attn_func``,
whose keywords the functions here take as one ``call: numerics.call.AttentionCall``):

* q: (batch, seqlen_q, heads_q, d); k: (batch, seqlen_k, heads_kv, d); v: (batch, seqlen_k,
  heads_kv, dv); heads_q a multiple of heads_kv (GQA/MQA: query head h reads kv head
  h // (heads_q // heads_kv)).
* scores ``s = softmax_scale * q.k`` (default scale 1/sqrt(d)); with ``softcap > 0`` the logit is
  ``softcap * tanh(s / softcap)``.
* Causal: key j visible to query i iff ``j <= i + seqlen_k - seqlen_q`` (aligned bottom-right).
  Local window (left, right): ``i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q +
  right``; None means unbounded on that side.
* learnable_sink: (heads_q,) logits in natural-log units, *not* multiplied by softmax_scale: one
  extra softmax column per head with no value vector (it enlarges the normaliser and the LSE).
* Mods (``numerics.mods``; the kernel contract's ``score_mod``, ``mask_mod``, ``aux_tensors``,
  ``block_sparse_tensors``): the logit is ``score_mod.fn(s, b, h, q_idx, kv_idx, aux_tensors)``
  evaluated in the reference's dtype (float64) at ``s = softmax_scale * q.k`` (production's
  order: the scale before the mod, ``softmax.py`` ``apply_score_mod_inner``); a key is visible
  where the flag masks (causal, window) *and* ``numerics.mods.visibility`` keep it (the audit's
  meaning of flags with a mask_mod is the intersection; production drops the flags,
  ``interface.py`` ``_resolve_causal_local_window``, which the audit surfaces).  The visibility
  is then per batch and head, (B|1, H|1, seqlen_q, seqlen_k).  ``aux_scalars`` (a tuple of Python
  ints / floats, or None) are handed to every form of the mods as the keyword ``aux_scalars=``
  only when the call has some (``numerics.mods.bind_aux_scalars``: production's shim), and read
  exactly (a float scalar's float32 rounding is the kernel's, which the bounds carry).  softcap and a score_mod are
  exclusive, as production asserts (``interface.py``).
* Rows with no visible key (and no sink): out = 0 and lse = -inf.  With a sink such a row has
  out = 0 and lse = sink.
* out: (batch, seqlen_q, heads_q, dv); lse: (batch, heads_q, seqlen_q), natural log.

The inputs are exactly representable in float64, so the FP64 reference is the exact
attention up to float64 rounding (relative 1e-16 per op, far below every kernel error audited);
:func:`mp_attention_rows` certifies that on sampled rows at ``dps`` decimal digits (pure mpmath,
seconds per row); :func:`exact_attention_rows` gives the same rows to ~1e-23 relative in
milliseconds (exact float64 products, correctly rounded ``math.fsum`` sums, mpmath for exp/log)
and is what the audit runner certifies with.
NaN and inf in the inputs propagate as IEEE arithmetic does: a NaN in a visible score makes that
row's output NaN; entries at masked positions never enter.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import mpmath
import torch

from numerics.call import AttentionCall, effective_window
from numerics.mods import index_grid, visibility

__all__ = [
    "visible_mask",
    "visible_key_range",
    "effective_window",
    "attention_reference",
    "attention_lowprec",
    "mp_attention_rows",
    "exact_attention_rows",
    "call_visibility",
    "apply_score_mod",
    "score_mod_derivative",
    "mod_logits_row",
]


def visible_key_range(
    seqlen_q: int,
    seqlen_k: int,
    *,
    causal: bool = False,
    window_size: tuple[int | None, int | None] = (None, None),
    rows: torch.Tensor | None = None,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(first, last), int64 per query row (``rows``: these row indices; default every row): the
    row's visible keys are first..last, cut to [0, seqlen_k); none when first > last."""
    left, right = effective_window(causal=causal, window_size=window_size)
    i = torch.arange(seqlen_q, device=device) if rows is None else torch.as_tensor(rows, device=device)
    diag = i.long() + (seqlen_k - seqlen_q)
    first = (diag - left).clamp(min=0) if left is not None else torch.zeros_like(diag)
    last = (diag + right).clamp(max=seqlen_k - 1) if right is not None else torch.full_like(diag, seqlen_k - 1)
    return first, last


def visible_mask(
    seqlen_q: int,
    seqlen_k: int,
    *,
    causal: bool = False,
    window_size: tuple[int | None, int | None] = (None, None),
    device: torch.device | str = "cpu",
    rows: torch.Tensor | None = None,
    keys: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bool (seqlen_q, seqlen_k): True where key j is visible to query i (module doc); with
    ``rows`` / ``keys`` (index tensors) only at those rows and keys (a figure samples a 32k x 32k
    mask: the whole one would be a gigabyte)."""
    first, last = visible_key_range(
        seqlen_q, seqlen_k, causal=causal, window_size=window_size, rows=rows, device=device
    )
    j = torch.arange(seqlen_k, device=device) if keys is None else torch.as_tensor(keys, device=device).long()
    return (j[None, :] >= first[:, None]) & (j[None, :] <= last[:, None])


def call_visibility(
    *,
    batch: int,
    heads: int,
    seqlen_q: int,
    seqlen_k: int,
    call: AttentionCall,
    rows: torch.Tensor | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """The keys a call keeps: the flag mask :func:`visible_mask` (``(rows, seqlen_k)``) when
    there is neither a mask_mod nor block sparsity; else its intersection with
    ``numerics.mods.visibility``, bool ``(B|1, H|1, rows, seqlen_k)`` (B, H: 1 where the mods do
    not depend on the batch / head).  ``rows``: these query rows only.  The call's runtime
    scalars are handed to the mask mod when there are any (``AttentionCall.bind_scalars``)."""
    call = call.bind_scalars()
    flags = visible_mask(seqlen_q, seqlen_k, causal=call.causal, window_size=call.window_size, device=device, rows=rows)
    mods = visibility(
        batch=batch,
        heads=heads,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        mask_mod=call.mask_mod,
        block_sparse=call.block_sparse_tensors,
        aux=call.aux_tensors,
        rows=rows,
        device=device,
    )
    if mods is None:
        return flags
    return flags.view(1, 1, *flags.shape) & mods.view(*((1,) * (4 - mods.dim())), *mods.shape[-4:])


def _grid(s: torch.Tensor, rows):
    """The index tensors of a (b, h, rows, keys) score tensor (``numerics.mods.index_grid``)."""
    b, h, i, j = s.shape
    return index_grid(b, h, i, j, rows=rows, device=s.device)


def apply_score_mod(s: torch.Tensor, score_mod, aux_tensors, *, rows: torch.Tensor | None = None) -> torch.Tensor:
    """``score_mod.fn`` on a (batch, heads_q, rows, seqlen_k) score tensor in its dtype (a new
    tensor of s's shape and dtype); ``rows``: the query indices of dim 2 (default 0..)."""
    f = score_mod.fn(s, *_grid(s, rows), aux_tensors)
    return f.to(s.dtype).expand(s.shape)


def score_mod_derivative(s: torch.Tensor, score_mod, aux_tensors, *, rows: torch.Tensor | None = None) -> torch.Tensor:
    """f'(s) per element, as the mod's backward reference form computes it: ``score_mod.grad``
    with an upstream gradient of ones (the chain rule's factor; ``grad(g, s) = g f'(s)``).  A
    mod without ``grad`` has no backward: refused, as ``numerics.mods.ScoreMod`` says."""
    if score_mod.grad is None:
        raise ValueError(f"score_mod {score_mod.name!r} has no grad (no score_mod_bwd): its backward is refused")
    return score_mod.grad(torch.ones_like(s), s, *_grid(s, rows), aux_tensors).to(s.dtype).expand(s.shape)


def mod_logits_row(
    score_mod,
    scores: list,
    *,
    batch_idx: int,
    head_idx: int,
    q_idx: int,
    keys: list,
    aux_tensors,
    device="cpu",
    derivative: bool = False,
) -> list[float]:
    """One row of a score_mod for the exact rows (:func:`exact_attention_rows`,
    ``numerics.grad_reference.exact_grad_elements``): ``fn`` (or, with ``derivative``, f' by
    ``grad(1, s)``) evaluated in float64 at each exact score correctly rounded to float64
    (``float(mpf)`` rounds to nearest).  Why float64 and not mpmath: a mod's reference form is a
    torch function (index tensors, aux reads), which mpmath cannot run; so with a score_mod the
    exact rows certify everything *but* f's own float64 evaluation, which differs from f at
    the exact score by at most ``|f'| 2**-53 |s|`` (the rounding of s) plus f's float64
    rounding, a few units of 2**-53 |f| for the library mods (one add; tanh and one multiply and
    divide) — relative ~1e-15, orders below the kernels' errors and five below the
    certification threshold (``audits/verdict/thresholds.toml``: ``mpmath_max_abs = 1e-10``)."""
    if not keys:
        return []
    dev = torch.device(device)
    s = torch.tensor([float(x) for x in scores], dtype=torch.float64, device=dev).view(1, 1, 1, -1)
    b = torch.tensor([batch_idx], device=dev).view(-1, 1, 1, 1)
    h = torch.tensor([head_idx], device=dev).view(1, -1, 1, 1)
    qi = torch.tensor([q_idx], device=dev).view(1, 1, -1, 1)
    kv = torch.as_tensor(keys, device=dev).long().view(1, 1, 1, -1)
    if derivative:
        if score_mod.grad is None:
            raise ValueError(f"score_mod {score_mod.name!r} has no grad (no score_mod_bwd): its backward is refused")
        out = score_mod.grad(torch.ones_like(s), s, b, h, qi, kv, aux_tensors)
    else:
        out = score_mod.fn(s, b, h, qi, kv, aux_tensors)
    return out.to(torch.float64).expand(s.shape).reshape(-1).cpu().tolist()


def _expand_kv(t: torch.Tensor, heads_q: int) -> torch.Tensor:
    hk = t.shape[2]
    if heads_q % hk:
        raise ValueError(f"heads_q ({heads_q}) must be a multiple of heads_kv ({hk})")
    return t.repeat_interleave(heads_q // hk, dim=2)


def _masked_matmul(w: torch.Tensor, vis: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """sum_j w_ij v_jc over *visible* j only, with IEEE semantics for non-finite v at visible
    positions (w * inf = inf, 0 * inf = NaN, inf - inf = NaN) and none at masked ones — a plain
    einsum would turn 0 * inf at a masked key into NaN.  w: (b, h, i, j); vis: (i, j), (h, i, j)
    or (B|1, H|1, i, j) (mods); v: (b, j, h, c); returns (b, i, h, c)."""
    fin = torch.isfinite(v)
    out = torch.einsum("bhij,bjhc->bihc", w, torch.where(fin, v, torch.zeros_like(v)))
    if bool(fin.all()):
        return out
    visf = vis.to(w.dtype).reshape((1,) * (4 - vis.dim()) + tuple(vis.shape)).expand_as(w)
    pos = visf * (w > 0)
    zero = visf * (w == 0)
    cnt = lambda a, m: torch.einsum("bhij,bjhc->bihc", a, m.to(w.dtype))
    n_nan = cnt(visf, torch.isnan(v)) + cnt(zero, torch.isinf(v))
    n_pinf, n_ninf = cnt(pos, v == math.inf), cnt(pos, v == -math.inf)
    out = torch.where(n_pinf > 0, torch.full_like(out, math.inf), out)
    out = torch.where(n_ninf > 0, torch.full_like(out, -math.inf), out)
    return torch.where((n_nan > 0) | ((n_pinf > 0) & (n_ninf > 0)), torch.full_like(out, math.nan), out)


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    call: AttentionCall,
    return_lse: bool = False,
    return_scale: bool = False,
    dtype: torch.dtype = torch.float64,
    key_mask: torch.Tensor | None = None,
):
    """Attention computed in ``dtype`` (float64) from the exact inputs; ``out`` (and ``lse``)
    in ``dtype``.  The audited callable's conventions (module doc), its keywords as ``call``.
    ``return_scale``: also the output's *scale* sum_j P_ij |V_jc| (``out``'s shape, last in the
    returned tuple): the same weights applied to |V| in one more matmul of this pass, the
    magnitude FA's criterion floors its allowance at (``numerics.metrics.fa_floor``).
    ``key_mask``: bool (heads_q, seqlen_q, seqlen_k), the keys each row may see besides the
    masks (a split-KV split's share: ``numerics.tiles.split_key_masks``).  The mods (module
    doc) cost nothing when absent: the path without them is the one before they existed."""
    call = call.bind_scalars()
    softcap, score_mod, learnable_sink = call.softcap, call.score_mod, call.learnable_sink
    b, sq, hq, d = q.shape
    sk = k.shape[1]
    scale = call.scale(d)
    q64, k64, v64 = q.to(dtype), _expand_kv(k, hq).to(dtype), _expand_kv(v, hq).to(dtype)
    # In place from here on: at seqlen 8k the (b, h, i, j) score tensor is GiBs, and its
    # elementwise passes, not the two matmuls, set the time (benchmarks/reference_flops.py; on
    # the H200 torch's fused logsumexp + softmax took 4.44 ms against 3.46 ms for these passes
    # at b1 h8 4096^2 d128).
    s = torch.einsum("bihd,bjhd->bhij", q64 * scale, k64)  # scale folded into q: b*i*h*d products, not b*h*i*j
    if softcap and softcap > 0:
        s.div_(softcap).tanh_().mul_(softcap)
    if score_mod is not None:
        s = apply_score_mod(s, score_mod, call.aux_tensors).clone()  # a fresh tensor: the passes below are in place
    vis = call_visibility(batch=b, heads=hq, seqlen_q=sq, seqlen_k=sk, call=call, device=q.device)
    if key_mask is not None:
        vis = (vis.view(1, sq, sk) if vis.dim() == 2 else vis) & key_mask.to(q.device)
    if not bool(vis.all()):
        s.masked_fill_(~vis, -math.inf)
    m = s.amax(dim=-1, keepdim=True)  # NaN-propagating, like the math
    if learnable_sink is not None:
        sink = learnable_sink.to(dtype).view(1, hq, 1, 1).expand(b, hq, sq, 1)
        m = torch.maximum(m, sink)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = s.sub_(m_safe).exp_()
    denom = p.sum(dim=-1, keepdim=True)
    if learnable_sink is not None:
        denom = denom + torch.exp(sink - m_safe)
    den = torch.where(denom == 0, torch.ones_like(denom), denom)  # (b, h, i, 1)
    # |V| before P is normalised in place below (low precision); float64 normalises after P.V
    scale_sum = _masked_matmul(p, vis, v64.abs()) if return_scale else None
    if dtype == torch.float64:  # normalise after P.V: dv divisions per row instead of seqlen_k
        out = _masked_matmul(p, vis, v64).div_(den.permute(0, 2, 1, 3))
    else:  # low precision (attention_lowprec): FA's reference normalises P before P.V
        out = _masked_matmul(p.div_(den), vis, v64)
    if scale_sum is not None:
        scale_sum.div_(den.permute(0, 2, 1, 3))
    lse = (m_safe + torch.log(denom)).squeeze(-1)
    if learnable_sink is None:
        empty = ~vis.any(dim=-1)  # (sq,), (hq, sq) or, with mods, (B|1, H|1, sq)
        e3 = empty.view((1,) * (3 - empty.dim()) + tuple(empty.shape))  # (1|B, 1|H, sq)
        e_out = e3.permute(0, 2, 1).unsqueeze(-1)
        out = out.masked_fill(e_out, 0.0)
        lse = lse.masked_fill(e3, -math.inf)
        if scale_sum is not None:
            scale_sum = scale_sum.masked_fill(e_out, 0.0)
    res = (out, lse) if return_lse else (out,)
    return res + (scale_sum,) if return_scale else (res if return_lse else out)


def attention_lowprec(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, call: AttentionCall) -> torch.Tensor:
    """The same math done in the input dtype by PyTorch (fp8 inputs: in bfloat16), the
    ``out_lowprec`` of FA's test criterion (``numerics.metrics.fa_criterion``)."""
    dt = torch.bfloat16 if q.dtype.itemsize == 1 else q.dtype
    return attention_reference(q, k, v, call=call, dtype=dt)


def _row_visibility(q, k, call: AttentionCall):
    """``vis(batch, head_q, query) -> bool (seqlen_k,)`` on the CPU for the exact rows: the whole
    flag mask once without mods (as before them), one row of :func:`call_visibility` per call
    with them (a row's mods visibility is per batch and head)."""
    b, sq, hq, _ = q.shape
    sk = k.shape[1]
    if not call.has_mask_mods:
        flags = visible_mask(sq, sk, causal=call.causal, window_size=call.window_size)
        return lambda bi, h, i: flags[i]

    def one(bi: int, h: int, i: int) -> torch.Tensor:
        m = call_visibility(
            batch=b, heads=hq, seqlen_q=sq, seqlen_k=sk, call=call, rows=torch.tensor([i]), device=q.device
        )
        return m[bi if m.shape[0] > 1 else 0, h if m.shape[1] > 1 else 0, 0].cpu()

    return one


def mp_softmax(logits: list, sink) -> tuple | None:
    """(m, [exp(s_j - m)], normaliser) of one row in mpmath: m the max over the visible logits
    and the sink (natural-log units), the normaliser including the sink's exp(sink - m); None
    for a row with neither a visible key nor a sink (out 0, lse -inf by convention).  Public:
    ``numerics.grad_reference``'s exact gradient rows start from the same weights."""
    every = logits + ([sink] if sink is not None else [])
    if not every:
        return None
    m = max(every)
    e = [mpmath.exp(s - m) for s in logits]
    return m, e, mpmath.fsum(e + ([mpmath.exp(sink - m)] if sink is not None else []))


def mp_attention_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rows: Iterable[tuple[int, int, int]],
    *,
    call: AttentionCall,
    dps: int = 50,
) -> list[tuple[list[mpmath.mpf], mpmath.mpf]]:
    """Output rows and LSE in mpmath at ``dps`` digits, for (batch, head_q, query) triples:
    ``[(out_row, lse), ...]``.  Used to certify the FP64 reference on samples (slow: pure
    Python).  mpmath's working precision is restored afterwards, whatever happens.  A
    score_mod is evaluated in float64 at the exact score rounded to float64
    (:func:`mod_logits_row` says why and what that costs)."""
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    call = call.bind_scalars()
    softcap, score_mod, learnable_sink = call.softcap, call.score_mod, call.learnable_sink
    scale = mpmath.mpf(1) / mpmath.sqrt(d) if call.softmax_scale is None else mpmath.mpf(float(call.softmax_scale))
    row_vis = _row_visibility(q, k, call)
    qd, kd, vd = q.double().cpu(), k.double().cpu(), v.double().cpu()
    old = mpmath.mp.dps
    try:
        mpmath.mp.dps = dps
        res = []
        for bi, h, i in rows:
            kh = h // (hq // hk)
            qi = [mpmath.mpf(float(x)) for x in qd[bi, i, h]]
            logits = []
            vis = row_vis(bi, h, i)
            for j in range(sk):
                if not vis[j]:
                    continue
                s = mpmath.fsum(a * mpmath.mpf(float(c)) for a, c in zip(qi, kd[bi, j, kh])) * scale
                if softcap and softcap > 0:
                    s = softcap * mpmath.tanh(s / softcap)
                logits.append((j, s))
            if score_mod is not None:
                f = mod_logits_row(
                    score_mod,
                    [s for _, s in logits],
                    batch_idx=bi,
                    head_idx=h,
                    q_idx=i,
                    keys=[j for j, _ in logits],
                    aux_tensors=call.aux_tensors,
                    device=q.device,
                )
                logits = [(j, mpmath.mpf(x)) for (j, _), x in zip(logits, f)]
            dv = v.shape[-1]
            w = mp_softmax(
                [s for _, s in logits], None if learnable_sink is None else mpmath.mpf(float(learnable_sink[h]))
            )
            if w is None:
                res.append(([mpmath.mpf(0)] * dv, mpmath.mpf("-inf")))
                continue
            m, e, den = w
            out = [
                mpmath.fsum(ej * mpmath.mpf(float(vd[bi, j, kh, c])) for ej, (j, _) in zip(e, logits)) / den
                for c in range(dv)
            ]
            res.append((out, m + mpmath.log(den)))
        return res
    finally:
        mpmath.mp.dps = old


#: pieces of <= 26 bits that each softmax weight is cut into (module doc of exact_attention_rows)
_PIECES, _PIECE_BITS = 3, 26


def fsum2(terms: list[float]) -> mpmath.mpf:
    """The exact sum of float64 ``terms`` to 2**-106 relative: ``math.fsum`` is correctly rounded
    (Shewchuk), so hi = fsum(t) and lo = fsum(t + [-hi]) = round(S - hi) give S = hi + lo +
    delta with |delta| <= 2**-53 |S - hi| <= 2**-106 |S|.  Public: ``numerics.grad_reference``
    sums its exact products with it."""
    hi = math.fsum(terms)
    return mpmath.mpf(hi) + mpmath.mpf(math.fsum(terms + [-hi]))


def _split(e: mpmath.mpf) -> list[float]:
    """e (>= 0) as _PIECES float64 numbers of <= 26 significant bits each, summing to e up to a
    relative 2**-(26 * _PIECES): each piece times a <= 26-bit input value is exact in float64."""
    man, exp = int(e.man), int(e.exp)  # e = man * 2**exp exactly
    if man == 0:
        return [0.0] * _PIECES
    shift = man.bit_length() - _PIECES * _PIECE_BITS  # align the top bit to the first piece
    man = man >> shift if shift > 0 else man << -shift
    exp += shift
    mask = (1 << _PIECE_BITS) - 1
    return [
        math.ldexp(float((man >> (_PIECE_BITS * (_PIECES - 1 - i))) & mask), exp + _PIECE_BITS * (_PIECES - 1 - i))
        for i in range(_PIECES)
    ]


def _exact_logits(qi: torch.Tensor, kj: torch.Tensor, scale, softcap: float) -> list:
    """Steps 1-2 of :func:`exact_attention_rows`: the row's logits in mpmath (scaled, softcapped)."""
    logits = []
    for row in (kj * qi).tolist():  # exact products (step 1)
        s = fsum2(row) * scale
        logits.append(softcap * mpmath.tanh(s / softcap) if softcap and softcap > 0 else s)
    return logits


def _exact_weighted_sum(e: list, vj: torch.Tensor, den, dv: int) -> list:
    """Step 3 of :func:`exact_attention_rows`: ``sum_j e_j v_jc / den`` for every column c."""
    pieces = torch.tensor([_split(x) for x in e], dtype=torch.float64)  # (j, 3)
    terms = (pieces[:, :, None] * vj[:, None, :]).reshape(-1, dv).T.tolist()  # (c, 3j), exact
    return [fsum2(t) / den for t in terms]


def _exact_row(q, k, v, row_vis, row: tuple[int, int, int], scale, call: AttentionCall):
    """One (batch, head_q, query) row of :func:`exact_attention_rows` (current mpmath precision)."""
    bi, h, i = row
    hq, hk = q.shape[2], k.shape[2]
    kh = h // (hq // hk)
    js = torch.nonzero(row_vis(bi, h, i)).flatten().to(k.device)
    qi = q[bi, i, h].double().cpu()
    kj = k[bi, js, kh].double().cpu()
    vj = v[bi, js, kh].double().cpu()
    sink = None if call.learnable_sink is None else float(call.learnable_sink[h])
    if not (torch.isfinite(qi).all() and torch.isfinite(kj).all() and torch.isfinite(vj).all()) or (
        sink is not None and not math.isfinite(sink)
    ):
        return None
    logits = _exact_logits(qi, kj, scale, call.softcap)
    if call.score_mod is not None:  # f in float64 at the rounded exact score (mod_logits_row)
        f = mod_logits_row(
            call.score_mod,
            logits,
            batch_idx=bi,
            head_idx=h,
            q_idx=i,
            keys=js.tolist(),
            aux_tensors=call.aux_tensors,
            device=q.device,
        )
        logits = [mpmath.mpf(x) for x in f]
    dv = v.shape[-1]
    w = mp_softmax(logits, None if sink is None else mpmath.mpf(sink))
    if w is None:
        return [mpmath.mpf(0)] * dv, mpmath.mpf("-inf")
    m, e, den = w
    if not logits:
        return [mpmath.mpf(0)] * dv, m + mpmath.log(den)
    return _exact_weighted_sum(e, vj, den, dv), m + mpmath.log(den)


def exact_attention_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rows: Iterable[tuple[int, int, int]],
    *,
    call: AttentionCall,
    dps: int = 30,
) -> list[tuple[list[mpmath.mpf], mpmath.mpf] | None]:
    """:func:`mp_attention_rows` to ~2**-78 relative in milliseconds per row; ``None`` for a row
    whose visible inputs are not all finite (IEEE semantics are the FP64 reference's business).

    Why it is exact enough, step by step (inputs of at most 26 significant bits: fp8, fp16,
    bf16, float32; float64 inputs are refused):

    1. ``q_d * k_d`` is exact in float64 (<= 2 * 24 significant bits; exponent range 2**-298 ..
       2**256, inside float64's).  The logit ``sum_d q_d k_d`` is then :func:`fsum2` of exact
       terms: relative error <= 2**-106.
    2. scale, softcap's tanh, the max, ``e_j = exp(s_j - m)``, the normaliser and the LSE are
       mpmath at ``dps`` digits (30 digits: ~2**-99 per operation).
    3. ``sum_j e_j v_jc``: e_j in (0, 1] is cut into three <= 26-bit pieces (:func:`_split`;
       truncation <= 2**-78 e_j), so every ``piece * v_jc`` is an exact float64 product (bar
       underflow below 2**-1022, an absolute error under seqlen_k * 2**-1074) and the sum is
       :func:`fsum2` again.
    The result therefore differs from the exact attention by a relative ~2**-78 (3e-24) of the
    row's largest |v| — ten orders below the FP64 reference's own error.  Tests check it
    against :func:`mp_attention_rows` at 50 digits.

    Mods.  The visible keys are the call's (:func:`call_visibility`, row by row).  A score_mod's
    logit ``f(s)`` is the one step not exact: f is evaluated in float64 at the exact score
    correctly rounded to float64 (:func:`mod_logits_row`: a reference form is a torch function
    mpmath cannot run), so each logit carries f's float64 evaluation error, ~1e-16 relative
    for the library mods, and the certification compares the FP64 reference against this
    "f in float64" attention: it checks the softmax, the sums and the masks exactly, and f only
    to float64.  The choice is sound for the audit because both sides then agree on f to
    ~1e-16 |f| while the threshold they are held to is orders larger; a mod whose float64
    evaluation is itself inaccurate (a catastrophic cancellation inside f) would pass here
    unnoticed, and its own documentation must say so.
    """
    if q.dtype == torch.float64 or k.dtype == torch.float64 or v.dtype == torch.float64:
        raise ValueError(
            "exact_attention_rows needs inputs of <= 26 significant bits (fp8/fp16/bf16/float32), got float64; "
            "use mp_attention_rows"
        )
    d = q.shape[-1]
    call = call.bind_scalars()
    row_vis = _row_visibility(q, k, call)
    old = mpmath.mp.dps
    try:
        mpmath.mp.dps = dps
        scale = mpmath.mpf(1) / mpmath.sqrt(d) if call.softmax_scale is None else mpmath.mpf(float(call.softmax_scale))
        return [_exact_row(q, k, v, row_vis, row, scale, call) for row in rows]
    finally:
        mpmath.mp.dps = old
