"""The catalogue of *localizable* bugs (issue 25, item 4): kernels each correct but for one seeded
bug whose failures sit on one axis of the error tensors, so that a case's diagnosis
(``case["diagnosis"]``, ``audits.verdict.diagnosis``) must name that axis and its values.
tests/test_localize_catalogue.py runs ``fa4-audit run`` on each with a small case file and checks
the diagnosis; the correct twins must get none.

:data:`LOCALIZABLE` maps each bugged kernel's name to ``(what it breaks, where its diagnosis must
point)``; each kernel's docstring says the same.

Tiles.  The diagnosis places rows and keys in the production tile grid of the case: for a kernel
without FA4's numerics (these), the SM90 forward tile (``fa4.code_paths.sm90_fwd_tile``) and
the SM90 backward tile (``sm90_bwd_tile``).  The tiled kernels here use the same tiles, so that
"row tile 1" of the diagnosis is the kernel's own row tile 1: at head dim 128 the forward tile is
128 x 128, at head dim 64 192 x 128 (rows x keys); the backward tile at head dim <= 64 128 x 128.

Kernels:

* fixed-length forward, on :func:`tests.bugged_kernels._online` (the plain online-softmax kernel,
  128-key blocks) with its inputs rearranged: :func:`batch_offset`, :func:`gqa_last_group`;
* fixed-length forward, on :func:`tiled` (an online-softmax kernel over the SM90 row and key
  tiles, per row tile the key blocks FA's block ranges give it): :func:`last_key_tile_dropped`,
  :func:`diagonal_tile_twice`;
* backward, on :func:`tests.bugged_backward.clean` (float32 attention, FA-style hand-written
  backward) with one gradient corrupted on its way out: :func:`bwd_last_key_tile_dropped`,
  :func:`dq_unaligned_dim`;
* varlen (the serving entry's contract, ``docs/varlen.md``): :func:`varlen_split_dropped` on
  :func:`split_varlen` (a float32 split-KV kernel with its combine), :func:`varlen_first_tile_shifted`
  on the model's varlen entry (``tests.bugged_varlen.clean``).
"""

from __future__ import annotations

import math

import torch

from fa4.code_paths import sm90_bwd_tile, sm90_fwd_tile
from numerics.reference import visible_mask
from numerics.tiles import block_ranges
from tests import bugged_backward, bugged_varlen
from tests.bugged_kernels import _online

#: kernel name -> (the bug, where the diagnosis must point)
LOCALIZABLE = {
    "batch_offset": (
        "batch offset: batch b >= 1 reads K and V of batch b - 1 (the batch stride applied one batch short)",
        "out/lse: batch [1, ..., batch - 1]; batch 0 within bound",
    ),
    "gqa_last_group": (
        "GQA head mapping: the query heads of the last group (h // group == heads_kv - 1) read kv head "
        "(heads_kv - 1 + 1) % heads_kv = 0 instead of heads_kv - 1",
        "out/lse: head = the last group's query heads, kv_head [heads_kv - 1]",
    ),
    "last_key_tile_dropped": (
        "the last partial key tile dropped: with seqlen_k % tile_n != 0 the key block past the last full "
        "tile is never loaded (the block count taken as seqlen_k // tile_n)",
        "out/lse: the rows that see keys of that tile (causal: the rows from seqlen_q - seqlen_k + "
        "tile_n * (seqlen_k // tile_n) on)",
    ),
    "diagonal_tile_twice": (
        "the diagonal tile counted twice in the causal forward: the unmasked loop starts at the diagonal "
        "block instead of the one before it, so a row tile with more than one key block accumulates its "
        "diagonal block twice (row tile 0 of seqlen_q == seqlen_k, tile_m <= tile_n sees only its diagonal "
        "block, and doubling the only block cancels in the softmax)",
        "out/lse: row_tile [1, ...]; row tile 0 within bound",
    ),
    "bwd_last_key_tile_dropped": (
        "backward: the dK/dV grid over key tiles is seqlen_k // tile_n, so with seqlen_k % tile_n != 0 the "
        "last partial key tile's dK and dV are never written (left zero); dQ comes from its own pass and is "
        "right",
        "dk/dv: col_tile [last], col [tile_n * (seqlen_k // tile_n), ...], mask_region ['last partial key "
        "tile']; out, lse and dq clean",
    ),
    "dq_unaligned_dim": (
        "dQ at a head-dim class: for head dims not a multiple of 32 the dQ columns past the last multiple of "
        "32 are accumulated twice (the tail chunk's atomic add issued twice); dK, dV and every other head dim "
        "right",
        "dq only: dim [32 * (d // 32), ..., d - 1]; dk and dv clean",
    ),
    "varlen_split_dropped": (
        "split-KV: the last split's partial dropped in the combine (the combine loops over num_splits - 1 partials)",
        "out/lse: the rows that see keys of the last split (causal: the rows from that split's first key on)",
    ),
    "varlen_first_tile_shifted": (
        "varlen: the first row tile of every sequence i >= 1 loads its queries at the previous sequence's "
        "offset (cu_seqlens_q[i - 1] instead of cu_seqlens_q[i]); later tiles are right",
        "out/lse: batch (sequence) [1, ...], row_tile [0], row [0, ..., tile_m - 1]",
    ),
}


# ---------------------------------------------------------------------------------------------
# Fixed-length forward on the plain online-softmax kernel
# ---------------------------------------------------------------------------------------------


def batch_offset(q, k, v, **kw):
    """Batch offset: batch b >= 1 reads K and V of batch b - 1 (the batch stride applied one batch
    short).  Diagnosis: out/lse in batch [1, ..., batch - 1]; batch 0 within bound."""
    b = q.shape[0]
    src = torch.clamp(torch.arange(b) - 1, min=0)
    return _online(q, k[src], v[src], **kw)


def _gqa_heads(hq: int, hk: int, *, last_group_shifted: bool) -> torch.Tensor:
    """The kv head each query head reads (h // group); the bug shifts the last group's by one."""
    idx = torch.arange(hq) // (hq // hk)
    if last_group_shifted and hk >= 2 and hq > hk:
        idx = torch.where(idx == hk - 1, (idx + 1) % hk, idx)
    return idx


def gqa_last_group(q, k, v, **kw):
    """GQA head mapping: the query heads of the last group (h // group == heads_kv - 1) read kv
    head (heads_kv - 1 + 1) % heads_kv = 0 instead of heads_kv - 1 (only when heads_q > heads_kv
    >= 2).  Diagnosis: out/lse in the last group's query heads, kv_head [heads_kv - 1]."""
    idx = _gqa_heads(q.shape[2], k.shape[2], last_group_shifted=True)
    return _online(q, k[:, :, idx], v[:, :, idx], **kw)  # expanded to MHA: _online maps head h to h


def gqa_correct(q, k, v, **kw):
    """The correct twin of :func:`gqa_last_group`: the same expansion to the query heads, h // group."""
    idx = _gqa_heads(q.shape[2], k.shape[2], last_group_shifted=False)
    return _online(q, k[:, :, idx], v[:, :, idx], **kw)


def online(q, k, v, **kw):
    """The correct plain online-softmax kernel (``tests.bugged_kernels._online`` without a bug)."""
    return _online(q, k, v, **kw)


#: the share of output elements :func:`scattered_noise` corrupts
NOISE_SHARE = 0.02


def scattered_noise(q, k, v, *, return_lse=False, **kw):
    """Not a localizable bug: a control.  The correct kernel's output with 2 % of its elements,
    drawn uniformly (a fixed seed), moved by 1.0 — far past any bound, spread over every axis.  It
    fails, and its diagnosis must name no axis (no false pattern on noise); the LSE is right."""
    out, lse = _online(q, k, v, return_lse=True, **kw)
    gen = torch.Generator().manual_seed(0)
    hit = torch.rand(out.shape, generator=gen) < NOISE_SHARE
    out = (out.float() + hit.float()).to(out.dtype)
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------------
# Fixed-length forward over the SM90 tiles
# ---------------------------------------------------------------------------------------------


def _tiled(
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
    """Online softmax in float32 over the SM90 tiles of the call (``sm90_fwd_tile``): each row
    tile visits the key blocks ``numerics.tiles.block_ranges`` gives it, P rounded to the input
    dtype (bf16 for fp8) before P V, as FA does.  ``bug``: None, ``"last_key_tile"`` or
    ``"diagonal_twice"`` (see :data:`LOCALIZABLE`)."""
    b, sq, hq, d = q.shape
    sk, hk, dv = k.shape[1], k.shape[2], v.shape[-1]
    w = tuple(window_size)
    local = not causal and any(x is not None for x in w)
    tm, tn = sm90_fwd_tile(d=d, dv=dv, causal=causal, local=local)
    scale = 1 / math.sqrt(d) if softmax_scale is None else softmax_scale
    idx = torch.arange(hq) // (hq // hk)
    qf, kf, vf = q.float(), k.float()[:, :, idx], v.float()[:, :, idx]
    vis = visible_mask(sq, sk, causal=causal, window_size=w)
    n_min, n_max, _ = block_ranges(sq, sk, tm, tn, causal, w, q.device)
    n_min, n_max = n_min[0], n_max[0]  # per query row: its tile's [n_min, n_max)
    p_dt = q.dtype if q.dtype.itemsize == 2 else torch.bfloat16
    m = torch.full((b, hq, sq, 1), -math.inf)
    lsum = torch.zeros(b, hq, sq, 1)
    o = torch.zeros(b, hq, sq, dv)
    n_blocks = sk // tn if bug == "last_key_tile" else -(-sk // tn)
    for j in range(n_blocks):
        j0, j1 = j * tn, min((j + 1) * tn, sk)
        in_range = (n_min <= j) & (j < n_max)  # (sq,): the row's tile visits block j
        if not bool(in_range.any()):
            continue
        s = torch.einsum("bihd,bjhd->bhij", qf, kf[:, j0:j1]) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        mk = vis[:, j0:j1] & in_range[:, None]
        s = s.masked_fill(~mk, -math.inf)
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        m_safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        alpha = torch.exp(m - m_safe)
        p = torch.exp(s - m_safe)
        if bug == "diagonal_twice" and causal:
            # the diagonal block (n_max - 1) of a tile with more than one block, accumulated twice
            twice = (j == n_max - 1) & (n_max - n_min > 1)
            p = p * torch.where(twice, 2.0, 1.0).view(1, 1, sq, 1)
        lsum = lsum * alpha + p.sum(-1, keepdim=True)
        o = o * alpha + torch.einsum("bhij,bjhd->bhid", p.to(p_dt).float(), vf[:, j0:j1])
        m = m_new
    if learnable_sink is not None:
        sink = learnable_sink.float().view(1, hq, 1, 1)
        m2 = torch.maximum(m, sink)
        m2s = torch.where(torch.isfinite(m2), m2, torch.zeros_like(m2))
        lsum = lsum * torch.exp(m - m2s) + torch.exp(sink - m2s)
        o = o * torch.exp(m - m2s)
        m = m2
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    bad = lsum == 0
    out = (o / torch.where(bad, 1.0, lsum)).to(p_dt).transpose(1, 2).contiguous()
    lse = torch.where(bad, -math.inf, m_safe + torch.log(torch.where(bad, 1.0, lsum))).squeeze(-1)
    return (out, lse) if return_lse else out


def tiled(q, k, v, **kw):
    """The correct tiled kernel (:func:`_tiled` without a bug)."""
    return _tiled(q, k, v, **kw)


def last_key_tile_dropped(q, k, v, **kw):
    """The last partial key tile dropped: with seqlen_k % tile_n != 0 the key block past the last
    full tile is never loaded (the block count taken as seqlen_k // tile_n).  Diagnosis: out/lse
    in the rows that see keys of that tile (causal: the rows from seqlen_q - seqlen_k + tile_n *
    (seqlen_k // tile_n) on)."""
    return _tiled(q, k, v, bug="last_key_tile", **kw)


def diagonal_tile_twice(q, k, v, **kw):
    """The diagonal tile counted twice in the causal forward: the unmasked loop starts at the
    diagonal block instead of the one before it, so a row tile with more than one key block
    accumulates its diagonal block twice.  Row tile 0 of a call with seqlen_q == seqlen_k and
    tile_m <= tile_n sees only its diagonal block, and doubling the only block cancels in the
    softmax.  Diagnosis: out/lse in row_tile [1, ...]; row tile 0 within bound."""
    return _tiled(q, k, v, bug="diagonal_twice", **kw)


# ---------------------------------------------------------------------------------------------
# Backward: tests.bugged_backward.clean with one gradient corrupted on its way out
# ---------------------------------------------------------------------------------------------


class _GradHook(torch.autograd.Function):
    """Identity in the forward; in the backward ``fix(grad)`` replaces the incoming gradient of
    the tensor (what the kernel's backward writes for that input)."""

    @staticmethod
    def forward(ctx, x, fix):
        ctx.fix = fix
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.fix(grad), None


def bwd_last_key_tile_dropped(q, k, v, *, deterministic: bool = False, **kw):
    """Backward: the dK/dV grid over key tiles is seqlen_k // tile_n (SM90's backward tile_n), so
    with seqlen_k % tile_n != 0 the last partial key tile's dK and dV are never written (left
    zero); dQ comes from its own pass and is right.  Diagnosis: dk/dv in col_tile [last], col
    [tile_n * (seqlen_k // tile_n), ...], mask_region ["last partial key tile"]; out, lse and dq
    clean."""
    causal = kw.get("causal", False)
    local = not causal and any(x is not None for x in kw.get("window_size", (None, None)))
    tn = sm90_bwd_tile(d=q.shape[-1], dv=v.shape[-1], causal=causal, local=local).tile_n
    first = (k.shape[1] // tn) * tn  # the first key of the partial tile (== seqlen_k: none)

    def unwritten(g):
        g = g.clone()
        g[:, first:] = 0
        return g

    if k.requires_grad:
        k, v = _GradHook.apply(k, unwritten), _GradHook.apply(v, unwritten)
    return bugged_backward.clean(q, k, v, deterministic=deterministic, **kw)


def dq_unaligned_dim(q, k, v, *, deterministic: bool = False, **kw):
    """dQ at a head-dim class: for head dims not a multiple of 32 the dQ columns past the last
    multiple of 32 are accumulated twice (the tail chunk's atomic add issued twice); dK, dV and
    every other head dim right.  Diagnosis: dq only, dim [32 * (d // 32), ..., d - 1]; dk and dv
    clean."""
    tail = (q.shape[-1] // 32) * 32

    def doubled_tail(g):
        g = g.clone()
        g[..., tail:] *= 2
        return g

    if q.requires_grad and q.shape[-1] % 32:
        q = _GradHook.apply(q, doubled_tail)
    return bugged_backward.clean(q, k, v, deterministic=deterministic, **kw)


def backward_clean(q, k, v, *, deterministic: bool = False, **kw):
    """The correct twin of the backward bugs: ``tests.bugged_backward.clean``."""
    return bugged_backward.clean(q, k, v, deterministic=deterministic, **kw)


# ---------------------------------------------------------------------------------------------
# Varlen
# ---------------------------------------------------------------------------------------------


def _varlen(fn):
    fn.fa4_audit_contract = "varlen"
    return fn


def _lengths(cu, used, n, static):
    if cu is None:
        return [(i * static, static if used is None else int(used[i])) for i in range(n)]
    return [(int(cu[i]), int(cu[i + 1] - cu[i]) if used is None else int(used[i])) for i in range(n)]


def _partial(qf, kf, vf, vis, scale, softcap):
    """One split's float32 partial: O normalised by its own row sum and its LSE ((hq, sq, dv),
    (hq, sq)); rows with no visible key: O = 0, LSE = -inf."""
    s = torch.einsum("ihd,jhd->hij", qf, kf) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~vis, -math.inf)
    m = s.amax(-1, keepdim=True)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m_safe)
    lsum = p.sum(-1, keepdim=True)
    safe = torch.where(lsum > 0, lsum, torch.ones_like(lsum))
    o = torch.einsum("hij,jhd->hid", p / safe, vf)
    lse = torch.where(lsum > 0, m_safe + torch.log(safe), torch.full_like(m, -math.inf)).squeeze(-1)
    return o, lse


def _combine(parts, sink):
    """The partials' combine: O = sum_s exp(LSE_s - LSE) O_s, LSE = log sum_s exp(LSE_s) (the
    sink, one per query head, as one more partial with O = 0); rows without any: O = 0, LSE = -inf.
    ``parts``: [(O_s (hq, sq, dv), LSE_s (hq, sq))]."""
    o_p = torch.stack([p[0] for p in parts])  # (splits, hq, sq, dv)
    l_p = torch.stack([p[1] for p in parts])  # (splits, hq, sq)
    if sink is not None:
        hq, sq = l_p.shape[1:]
        o_p = torch.cat([o_p, torch.zeros_like(o_p[:1])])
        l_p = torch.cat([l_p, sink.float().view(1, hq, 1).expand(1, hq, sq)])
    l_max = l_p.amax(0)
    l_safe = torch.where(torch.isfinite(l_max), l_max, torch.zeros_like(l_max))
    wts = torch.exp(l_p - l_safe)
    tot = wts.sum(0)
    ok = tot > 0
    o = (wts[..., None] * o_p).sum(0) / torch.where(ok, tot, 1.0)[..., None]
    return o, torch.where(ok, l_safe + torch.log(torch.where(ok, tot, 1.0)), -math.inf)


def _split_varlen(
    q,
    k,
    v,
    *,
    bug=None,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    seqused_q=None,
    seqused_k=None,
    page_table=None,
    num_splits=1,
    pack_gqa=None,
    softmax_scale=None,
    causal=False,
    window_size=(None, None),
    softcap=0.0,
    learnable_sink=None,
    return_lse=False,
):
    if page_table is not None:
        raise NotImplementedError("split_varlen: no paged KV cache")
    packed = cu_seqlens_q is not None
    if not packed:  # the contract's batched form: (b, sq, hq, d)
        b = q.shape[0]
        q = q.reshape(-1, *q.shape[2:])
        cu_seqlens_q = torch.arange(b + 1, dtype=torch.int32) * (q.shape[0] // b)
    if cu_seqlens_k is None:
        kb = k.shape[0]
        static_k = k.shape[1]
        k, v = k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:])
        cu_seqlens_k = torch.arange(kb + 1, dtype=torch.int32) * static_k
    n = cu_seqlens_q.numel() - 1
    rows = _lengths(cu_seqlens_q, seqused_q, n, 0)
    keys = _lengths(cu_seqlens_k, seqused_k, n, 0)
    hq, d = q.shape[1], q.shape[2]
    hk, dv = k.shape[1], v.shape[-1]
    idx = torch.arange(hq) // (hq // hk)
    scale = 1 / math.sqrt(d) if softmax_scale is None else softmax_scale
    out_dt = q.dtype if q.dtype.itemsize == 2 else torch.bfloat16
    out = torch.zeros(q.shape[0], hq, dv, dtype=out_dt)
    lse = torch.full((hq, q.shape[0]), -math.inf)
    local = not causal and any(x is not None for x in window_size)
    tn = sm90_fwd_tile(d=d, dv=dv, causal=causal, local=local)[1]
    for (q0, sq), (k0, sk) in zip(rows, keys):
        if sq == 0:
            continue
        qf = q[q0 : q0 + sq].float()
        kf, vf = k[k0 : k0 + sk].float()[:, idx], v[k0 : k0 + sk].float()[:, idx]
        vis = visible_mask(sq, sk, causal=causal, window_size=tuple(window_size))
        nb = -(-sk // tn)
        per = max(1, -(-nb // num_splits))  # key blocks per split
        parts = []
        for s in range(num_splits):
            j0, j1 = min(sk, s * per * tn), min(sk, (s + 1) * per * tn)
            keep = torch.zeros(sk, dtype=torch.bool)
            keep[j0:j1] = True
            parts.append(_partial(qf, kf, vf, vis & keep, scale, softcap))
        if bug == "split_dropped" and num_splits > 1:
            parts = parts[:-1]
        o, lse[:, q0 : q0 + sq] = _combine(parts, learnable_sink)
        out[q0 : q0 + sq] = o.transpose(0, 1).to(out_dt)
    if not packed:
        out = out.view(b, -1, hq, dv)
        lse = lse.view(hq, b, -1).transpose(0, 1).contiguous()
    return (out, lse) if return_lse else out


@_varlen
def split_varlen(q, k, v, **kw):
    """A correct float32 split-KV varlen kernel: per sequence, split s of num_splits takes the
    s-th run of ceil(blocks / num_splits) key blocks (SM90's tile_n) and writes its partial O
    and LSE; the combine weighs them by exp(LSE_s - LSE) (the sink as one more partial).  No
    paged cache (NotImplementedError: skipped)."""
    return _split_varlen(q, k, v, **kw)


@_varlen
def varlen_split_dropped(q, k, v, **kw):
    """Split-KV: the last split's partial dropped in the combine (the combine loops over
    num_splits - 1 partials).  Diagnosis: out/lse in the rows that see keys of the last split
    (causal: the rows from that split's first key on)."""
    return _split_varlen(q, k, v, bug="split_dropped", **kw)


@_varlen
def varlen_first_tile_shifted(q, k, v, *, cu_seqlens_q=None, **kw):
    """Varlen: the first row tile of every sequence i >= 1 loads its queries at the previous
    sequence's offset (cu_seqlens_q[i - 1] instead of cu_seqlens_q[i]); later tiles are right.
    The model's varlen entry (SM90 numerics, ``tests.bugged_varlen.clean``) on the shifted
    queries.  Diagnosis: out/lse in batch (sequence) [1, ...], row_tile [0], row [0, ...,
    tile_m - 1]."""
    if cu_seqlens_q is not None:
        d, dv = q.shape[-1], v.shape[-1]
        causal = kw.get("causal", False)
        local = not causal and any(x is not None for x in kw.get("window_size", (None, None)))
        tm = sm90_fwd_tile(d=d, dv=dv, causal=causal, local=local)[0]
        shifted = q.clone()
        for i in range(1, cu_seqlens_q.numel() - 1):
            start, end, prev = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1]), int(cu_seqlens_q[i - 1])
            n = min(tm, end - start)
            shifted[start : start + n] = q[prev : prev + n]
        q = shifted
    return bugged_varlen.clean(q, k, v, cu_seqlens_q=cu_seqlens_q, **kw)


@_varlen
def varlen_clean(q, k, v, **kw):
    """The correct twin of :func:`varlen_first_tile_shifted`: the model's varlen entry
    (``tests.bugged_varlen.clean``)."""
    return bugged_varlen.clean(q, k, v, **kw)


#: the correct twins: no diagnosis on any case
CLEAN = {
    "online": online,
    "gqa_correct": gqa_correct,
    "tiled": tiled,
    "backward_clean": backward_clean,
    "split_varlen": split_varlen,
    "varlen_clean": varlen_clean,
}
