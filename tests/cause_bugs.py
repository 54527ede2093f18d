"""Kernels with seeded bugs of distinct causes, for the cause catalogue (docs/diagnosis.md,
"Causes"): each a small function over the FA4 model (``fa4.model.attention``) or the FP64
reference rounded, its docstring naming the cause ``audits.verdict.causes`` must name first."""

import torch

from fa4.model import attention

# ---- poisoned runs (audits.engine.poison): unwritten_output, uninitialized_read ------------------


def unwritten_rows(q, k, v, *, return_lse=False, **kw):
    """Cause unwritten_output: out is allocated with torch.empty and the last query row of every
    batch is never written; every other row is the model's."""
    o, lse = attention(q, k, v, return_lse=True, **kw)
    out = torch.empty_like(o)
    out[:, :-1] = o[:, :-1]
    return (out, lse) if return_lse else out


def uninitialized_accumulator(q, k, v, *, return_lse=False, **kw):
    """Cause uninitialized_read: the rows from s_q // 2 on (a second row tile, say) add an
    accumulator taken from torch.empty and never zeroed, times 2**-4.  The accumulator reuses the
    float32 workspace the kernel freed just before (as an allocator cache hands a freed block back),
    so a normal run adds the workspace's stale values and fails; poisoned runs add the fill."""
    o, lse = attention(q, k, v, return_lse=True, **kw)
    work = torch.empty(o.shape, dtype=torch.float32, device=o.device)
    work.copy_(o)  # the workspace: written, used, freed
    del work
    acc = torch.empty(o.shape, dtype=torch.float32, device=o.device)  # the bug: never zeroed
    out = o.float().clone()
    half = o.shape[1] // 2
    out[:, half:] += acc[:, half:] * 2.0**-4
    out = out.to(o.dtype)
    return (out, lse) if return_lse else out


def batch_offset_unwritten(q, k, v, *, return_lse=False, **kw):
    """Cause unwritten_output (with misplaced_rows): the Triton tutorial's batch offset bug. Batch
    b >= 1 writes its output one row down into batch b - 1's rows (its row i at batch b - 1's row
    i + 1, its last row dropped), so batch b's own rows are never written (torch.empty)."""
    o, lse = attention(q, k, v, return_lse=True, **kw)
    out = torch.empty_like(o)
    out[0] = o[0]
    for b in range(1, o.shape[0]):
        out[b - 1, 1:] = o[b, :-1]
    return (out, lse) if return_lse else out


# ---- rounding bias (audits.verdict.bias): rounding_bias -------------------------------------------


def _round_toward_zero(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 ``p`` >= 0 rounded toward zero to ``dtype``: to nearest, then one step down where
    that went up (a positive float's bit pattern, read as an integer, steps by one ULP)."""
    r = p.to(dtype)
    up = (r.float() > p) & (r.float() > 0)
    bits = r.view(torch.int16)
    return torch.where(up, bits - 1, bits).view(dtype)


def _pv_kernel(q, k, v, *, truncate: bool, return_lse=False, softmax_scale=None, causal=False,
               window_size=(None, None), softcap=0.0, learnable_sink=None, **mods):  # fmt: skip
    """A plain softmax kernel: scores and max in float64, P = exp(s - max) in float32, the row sum
    of the float32 P, P rounded to the output dtype before P V (toward zero with ``truncate``,
    else to nearest), P V in float64, the output rounded to nearest.  Mods: refused (skipped)."""
    from numerics.reference import visible_mask

    if any(val is not None for val in mods.values()):
        raise NotImplementedError("_pv_kernel takes no mods")
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    dt = torch.bfloat16 if q.dtype.itemsize == 1 else q.dtype
    kk, vv = (t.double().repeat_interleave(hq // hk, dim=2) for t in (k, v))
    s = torch.einsum("bihd,bjhd->bhij", q.double(), kk) * (softmax_scale or d**-0.5)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    vis = visible_mask(sq, sk, causal=causal, window_size=tuple(window_size), device=q.device)
    s = s.masked_fill(~vis, -torch.inf)
    m = s.amax(dim=-1, keepdim=True)
    if learnable_sink is not None:
        m = torch.maximum(m, learnable_sink.double().view(1, -1, 1, 1))
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m).float()
    rowsum = p.double().sum(-1, keepdim=True)
    if learnable_sink is not None:
        rowsum = rowsum + torch.exp(learnable_sink.double().view(1, -1, 1, 1) - m)
    p_lp = _round_toward_zero(p, dt) if truncate else p.to(dt)
    o = torch.einsum("bhij,bjhd->bihd", p_lp.double(), vv) / rowsum.transpose(1, 2).clamp(min=1e-300)
    out = o.to(dt)
    lse = torch.where(rowsum > 0, m + torch.log(rowsum), -torch.inf).squeeze(-1).float()
    return (out, lse) if return_lse else out


def truncating_pv(q, k, v, *, return_lse=False, **kw):
    """Cause rounding_bias: P is rounded toward zero (truncated) to the input dtype before P V
    instead of to nearest, while the row sum keeps the float32 P: every output leans toward zero
    by about half a ULP of P's share, inside the error bound, and with V of one sign (the
    tied_max family) every output is biased low."""
    return _pv_kernel(q, k, v, truncate=True, return_lse=return_lse, **kw)


def rounding_pv(q, k, v, *, return_lse=False, **kw):
    """The same kernel as :func:`truncating_pv` rounding P to nearest: no cause (the control)."""
    return _pv_kernel(q, k, v, truncate=False, return_lse=return_lse, **kw)


# ---- data-tested causes (audits.verdict.causes.data_causes) ---------------------------------------


def scale_by_dv(q, k, v, *, return_lse=False, softmax_scale=None, **kw):
    """Cause softmax_scale: the default scale is 1/sqrt(dv) instead of 1/sqrt(d) (the scores are
    off by c = sqrt(d/dv) wherever d != dv)."""
    scale = softmax_scale if softmax_scale is not None else v.shape[-1] ** -0.5
    return attention(q, k, v, return_lse=return_lse, softmax_scale=scale, **kw)


def window_left_plus_one(q, k, v, *, return_lse=False, window_size=(None, None), **kw):
    """Cause mask_edge (window_left): the local window's left edge admits one key too many."""
    left, right = tuple(window_size)
    w = (None if left is None else left + 1, right)
    return attention(q, k, v, return_lse=return_lse, window_size=w, **kw)


def causal_diagonal_plus_one(q, k, v, *, return_lse=False, causal=False, window_size=(None, None), **kw):
    """Cause mask_edge (causal_diagonal): the causal mask keeps one key past the diagonal (a
    ``<=`` where ``<`` belonged, on the shifted index)."""
    if causal:
        left = tuple(window_size)[0]
        return attention(q, k, v, return_lse=return_lse, causal=False, window_size=(left, 1), **kw)
    return attention(q, k, v, return_lse=return_lse, causal=causal, window_size=window_size, **kw)


def gqa_modulo(q, k, v, *, return_lse=False, **kw):
    """Cause head_mapping: query head h reads kv head h % heads_kv instead of h // group."""
    hq, hk = q.shape[2], k.shape[2]
    idx = torch.arange(hq, device=k.device) % hk
    return attention(q, k[:, :, idx], v[:, :, idx], return_lse=return_lse, **kw)


def batch_shifted(q, k, v, *, return_lse=False, **kw):
    """Cause misplaced_rows: batch b >= 1 is written with batch b - 1's output (an output
    pointer one batch stride short); batch 0 is right."""
    o, lse = attention(q, k, v, return_lse=True, **kw)
    o2, l2 = o.clone(), lse.clone()
    o2[1:], l2[1:] = o[:-1], lse[:-1]
    return (o2, l2) if return_lse else o2


def fp16_p_overflow(q, k, v, **kw):
    """Cause overflow: lazy rescaling compares the max's lag in natural-log units with a
    threshold of 16 (tests/bugged_kernels.py ``fp16_lagging_max``): P = e**lag exceeds fp16's
    65504 once the row max rises by more than 11.09 nats between key tiles."""
    from tests.bugged_kernels import bug_fp16_lagging_max

    return bug_fp16_lagging_max(q, k, v, **kw)


def drop_tile_one(q, k, v, *, return_lse=False, **kw):
    """Cause dropped_tile: the FP64 reference rounded, with key tile 1 (keys 128..255) never
    loaded (a loop bound that starts one tile late after the first)."""
    from numerics.call import AttentionCall
    from numerics.reference import attention_reference

    b, sq, hq, _ = q.shape
    sk = k.shape[1]
    keep = torch.ones(hq, sq, sk, dtype=torch.bool, device=q.device)
    keep[:, :, 128:256] = False
    out, lse = attention_reference(q, k, v, call=AttentionCall.from_kwargs(**kw), return_lse=True, key_mask=keep)
    out = out.to(torch.bfloat16 if q.dtype.itemsize == 1 else q.dtype)
    return (out, lse.float()) if return_lse else out


def nan_from_masked_keys(q, k, v, **kw):
    """Cause nan_leak: masking adds -inf to the scores instead of selecting, so NaN (and inf)
    at masked keys reach the output (tests/bugged_kernels.py ``nan_leak``)."""
    from tests.bugged_kernels import bug_nan_leak

    return bug_nan_leak(q, k, v, **kw)


# ---- the backward's poisoned runs (audits.engine.poison.grad_poison_causes) -----------------------


class _StaleDqAccumulator(torch.autograd.Function):
    """The identity on q whose backward adds an fp32 accumulator to dq that is zeroed only for
    the first half of the query rows (a first row tile, say): the rest holds whatever the memory
    held, as production's SM90 dQ accumulator did at head dims its padding rules disagree on."""

    @staticmethod
    def forward(ctx, q):
        return q.view_as(q)

    @staticmethod
    def backward(ctx, g):
        acc = torch.empty(g.shape, dtype=torch.float32, device=g.device)
        acc[:, : g.shape[1] // 2] = 0
        # scaled before it is added (as a softmax scale would be): a stale value reaches dq moved,
        # not as it was, which is what tells a read from an element never written
        return (g.float() + acc * 2.0**-4).to(g.dtype)


def stale_dq_accumulator(q, k, v, **kw):
    """Cause uninitialized_read in dq (the backward's poisoned runs): rows from s_q // 2 on add
    a never-zeroed accumulator to the right gradient; the forward is the model's, exact."""
    return attention(_StaleDqAccumulator.apply(q), k, v, **kw)


def stale_nan_batch(q, k, v, *, return_lse=False, **kw):
    """No overflow: batch 1's output is left unwritten, holding NaN (as Triton's tutorial's did on the
    H200, most likely memory an earlier poisoned run had filled); batch 0 exact."""
    o, lse = attention(q, k, v, return_lse=True, **kw)
    o = o.clone()
    o[1:] = float("nan")
    return (o, lse) if return_lse else o


def flat_batch_offset(q, k, v, *, return_lse=False, **kw):
    """Cause misplaced_rows (the batch stride taken as 1 row) with unwritten_output: Triton's
    fused-attention tutorial's Hopper addressing, emulated.  q, k, v and out are laid out (Z, H, N, D)
    and flattened to (Z·H·N) rows; program (z, h) addresses rows ``z + h·N`` (the tutorial's
    ``offset_y = off_z + off_h * N_CTX``) instead of ``(z·H + h)·N``: batch 1 reads and writes
    batch 0's rows one row down (past the end: zeros, as a TMA load), its own rows never written
    (``torch.empty``); programs run batch after batch, so batch 1's writes land last; the LSE is
    written at the program's own row, as the tutorial writes M.  Each program is the model's."""
    return _flat_batch(q, k, v, return_lse=return_lse, raced=False, **kw)


def flat_batch_offset_raced(q, k, v, *, return_lse=False, **kw):
    """``flat_batch_offset`` with its racing writes landing both ways: where batch 0's program
    and batch 1's both write a row, batch 0's write lands last on every other tile of 64 rows
    (on the H200 the tutorial's batch 0 ended correct on some cases, moved on others, 2026-12-04)."""
    return _flat_batch(q, k, v, return_lse=return_lse, raced=True, **kw)


def flat_batch_offset_two(q, k, v, *, return_lse=False, **kw):
    """Not a cause of the vocabulary: ``flat_batch_offset`` with the batch stride taken as 2 rows,
    a control that the batch-stride hypothesis (strides 1 and 0) must not name."""
    return _flat_batch(q, k, v, return_lse=return_lse, raced=False, stride=2, **kw)


def _flat_batch(q, k, v, *, return_lse, raced, stride=1, **kw):
    B, N, H, D = q.shape
    flat = [t.transpose(1, 2).reshape(B * H * N, t.shape[-1]) for t in (q, k, v)]
    out = torch.empty(B * H * N, v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(B, H, N, dtype=torch.float32, device=q.device)
    late = []  # batch 0's tiles written after every other program (raced)
    for z in range(B):
        for h in range(H):
            start = z * stride + h * N
            rows = [
                torch.cat([t[start : start + N], t.new_zeros(max(0, start + N - len(t)), t.shape[1])]) for t in flat
            ]
            o, l1 = attention(*(r.view(1, N, 1, -1) for r in rows), return_lse=True, **kw)
            end = min(start + N, len(out))
            out[start:end] = o.view(N, -1)[: end - start]
            lse[z, h] = l1.view(N)
            if raced and z == 0:
                late += [(start + i, o.view(N, -1)[i : i + 64]) for i in range(0, N, 128)]
    for at, tile in late:
        out[at : at + len(tile)] = tile
    out = out.view(B, H, N, -1).transpose(1, 2)
    return (out, lse) if return_lse else out


# ---- passes on memory (audits.engine.evaluate._judged_written, the gate's "unwritten") ---------------


def _rows_seeing_keys(lse: torch.Tensor) -> torch.Tensor:
    """(b, s, h): the rows with a visible key (a finite LSE, which is (b, h, s))."""
    return torch.isfinite(lse).transpose(1, 2)


def unwritten_empty_rows(q, k, v, *, return_lse=False, **kw):
    """Rows that see no key are never written (torch.empty), where FA's output is 0; the LSE is the
    model's (-inf there).  Where fresh memory holds 0, the output matches the reference."""
    o, lse = attention(q, k, v, return_lse=True, **kw)
    out = torch.empty_like(o)
    seen = _rows_seeing_keys(lse)
    out[seen] = o[seen]
    return (out, lse) if return_lse else out


def stale_empty_rows(q, k, v, *, return_lse=False, **kw):
    """Rows that see no key are an accumulator never zeroed (torch.empty) times 2**-30 (divided by
    a huge row sum, say): 0 while that memory holds 0, another value where it holds another;
    every other row the model's."""
    o, lse = attention(q, k, v, return_lse=True, **kw)
    acc = torch.empty(o.shape, dtype=torch.float32, device=o.device)
    out = o.clone()
    empty = ~_rows_seeing_keys(lse)
    out[empty] = (acc[empty] * 2.0**-30).to(o.dtype)
    return (out, lse) if return_lse else out


def unwritten_later_batches(q, k, v, *, return_lse=False, **kw):
    """Batches after the first are never written (torch.empty); batch 0 and the LSE the model's.
    Where the reference is NaN everywhere and fresh memory holds NaN, the output matches it."""
    o, lse = attention(q, k, v, return_lse=True, **kw)
    out = torch.empty_like(o)
    out[0] = o[0]
    return (out, lse) if return_lse else out


class _SkippedZeroDqRows(torch.autograd.Function):
    """The identity on q whose backward writes dq only on the rows whose gradient is not all zero:
    rows that see no key (FA's dq is 0 there) are skipped, left as torch.empty gave them."""

    @staticmethod
    def forward(ctx, q):
        return q.view_as(q)

    @staticmethod
    def backward(ctx, g):
        dq = torch.empty_like(g)
        written = (g != 0).any(dim=-1)  # (b, s, h): the rows the kernel computes
        dq[written] = g[written]
        return dq


def unwritten_empty_dq_rows(q, k, v, **kw):
    """The backward never writes dq on rows that see no key (where it is 0); the forward and every
    other gradient the model's.  Where fresh memory holds 0, dq matches the reference."""
    return attention(_SkippedZeroDqRows.apply(q), k, v, **kw)
