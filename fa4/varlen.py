"""The FA4 forward's serving entry (``interface.flash_attn_varlen_func``) as production computes
it: packed variable-length batches, ``seqused``, a paged KV cache, split-KV and its combine,
pack_gqa.  Each sequence runs the fixed-length model's loop (``fa4.forward_loop.forward_loop``)
on its own rows and keys, with production's block ranges for it:

* **varlen / seqused** (``seqlen_info.py`` ``SeqlenInfoQK``): sequence i's queries are rows
  ``cu_seqlens_q[i] ..`` of the packed q, ``seqused_q[i]`` of them if given (else up to
  ``cu_seqlens_q[i+1]``); its keys likewise.  Tiles and the causal / local alignment
  (bottom-right) are per sequence: a sequence computes exactly what a batch-1 call on its rows
  computes.
* **paged KV** (``paged_kv.py``; SM90 ``paged_kv_non_tma`` when the page size is not tile_n):
  k and v are (num_pages, page_size, heads_kv, d); sequence i's keys are its page-table row's
  pages in order, ``seqused_k[i]`` of them (else the whole row).  Pages are gathered into the
  logical sequence before tiling: KV blocks stay at multiples of tile_n in the sequence, so the
  page size changes which memory is read, never the arithmetic.
* **pack_gqa** (``pack_gqa.py``): the query heads of a KV head share the M dimension of a tile,
  which changes the block range of a tile (``fa4.forward_loop.kv_block_ranges``).  On finite
  inputs a row's result does not depend on it (a block outside a row's visible keys adds exact zeros);
  it moves the split boundaries and where masked non-finite values are read.
* **split-KV** (``block_info.py`` ``get_n_block_min_max`` under ``is_split_kv``): split s of
  ``num_splits`` runs the loop over its run of blocks and writes float32 partials; then
  :func:`combine` (``flash_fwd_combine.py``) merges them.  On SM100 a call with varlen queries
  gets a split count per sequence from the prepare scheduler (:func:`dynamic_splits`).  Production's SM90 path refuses
  splits (``interface.py``: "SplitKV not supported on SM 9.0"); the model runs them for both.

* **mods** (``score_mod``, ``mask_mod``, ``aux_tensors``, ``aux_scalars``, block sparsity): per
  sequence with production's indices, the sequence as ``batch_idx`` and positions within it
  (:func:`sequence_mods`); block sparsity one ``BlockSparse`` per sequence, production's layout
  :func:`varlen_block_lists` (``docs/varlen.md``, "Mods on varlen cases").

The combine's arithmetic is modelled from ``FlashAttentionForwardCombine.kernel``: see
:func:`combine`.  NaN and non-finite semantics follow the loop's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import torch

from fa4.forward_loop import FwdMods, forward_loop, kv_block_ranges
from fa4.forward_steps import finalize
from fa4.knobs import FA4Numerics
from fa4.model import validate_inputs
from fa4.mods import block_sparse_index_lists
from fa4.primitives import FP8, LOG2_E, bind_model_scalars, check_mods, fma, hardware_exp2, hardware_lg2
from numerics.fp import to_f32
from numerics.mods import BlockSparse, at_sequence, shift_batch_arg
from numerics.tiles import split_ranges

__all__ = [
    "varlen_attention",
    "combine",
    "CombineOps",
    "dynamic_splits",
    "split_counts",
    "sequence_numerics",
    "packs_gqa",
    "empty_outputs",
    "Sequence",
    "sequences",
    "VARLEN_KEYWORDS",
    "sequence_mods",
    "varlen_block_sparse",
    "varlen_block_lists",
]

#: the varlen keywords of the contract (``docs/varlen.md``), beyond the fixed-length ones
VARLEN_KEYWORDS = (
    "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "seqused_q", "seqused_k",
    "page_table", "num_splits", "pack_gqa",
)  # fmt: skip


@dataclass(frozen=True)
class Sequence:
    """Where sequence ``i`` of a varlen call lives: its query rows in q's first (packed) or
    second (batched) dimension, and its keys as indices into k's flattened token dimension."""

    index: int
    q_rows: tuple[int, int]  # [start, stop) in the packed q (or in batch row ``index``)
    k_index: torch.Tensor  # (seqlen_k,) int64 token indices into k flattened to (tokens, hk, d)

    def place(self, out, lse, o, lo, *, packed: bool) -> None:
        """Write this sequence's batch-1 result (o (1, sq, hq, dv); lo (1, hq, sq) or None) into
        the call's ``out`` and ``lse`` (:func:`empty_outputs`)."""
        r0, r1 = self.q_rows
        (out[r0:r1] if packed else out[self.index, r0:r1]).copy_(o[0])
        if lo is not None:
            (lse[:, r0:r1] if packed else lse[self.index, :, r0:r1]).copy_(lo[0])


def empty_outputs(q: torch.Tensor, v: torch.Tensor, *, packed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A varlen call's out (shaped as q with v's head dim; bf16 for fp8 inputs) and lse ((hq,
    total_q) packed, else (b, hq, sq)), before any sequence is written: rows no sequence owns
    (past ``seqused_q``) stay out 0, lse -inf."""
    out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=torch.bfloat16 if q.dtype in FP8 else q.dtype, device=q.device)
    shape = (q.shape[-2], q.shape[0]) if packed else (q.shape[0], q.shape[2], q.shape[1])
    return out, torch.full(shape, -math.inf, device=q.device)


def _lengths(cu: torch.Tensor | None, used: torch.Tensor | None, n: int, static: int) -> list[tuple[int, int]]:
    """(start, length) per sequence from cu_seqlens and seqused (``SeqlenInfoQK.create``:
    seqused wins over the cu_seqlens difference; without cu_seqlens the start is 0 in the
    sequence's own batch row and the length the static one)."""
    out = []
    for i in range(n):
        start = int(cu[i]) if cu is not None else 0
        length = int(cu[i + 1]) - start if cu is not None else static
        if used is not None:
            length = int(used[i])
        out.append((start, length))
    return out


def sequences(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    seqused_q=None,
    seqused_k=None,
    page_table=None,
) -> list[Sequence]:
    """The sequences of a varlen call, validated against the contract (``docs/varlen.md``)."""
    n = _batch_size(q, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table)
    q_static = q.shape[1] if cu_seqlens_q is None else 0
    rows = _lengths(cu_seqlens_q, seqused_q, n, q_static)
    if page_table is not None:
        page = k.shape[1]
        ks = _lengths(None, seqused_k, n, page_table.shape[1] * page)
        slot = torch.arange(page, device=page_table.device).repeat(page_table.shape[1])
        idx = [(page_table[i].long().repeat_interleave(page) * page + slot)[:ln] for i, (_, ln) in enumerate(ks)]
    else:
        ks = _lengths(cu_seqlens_k, seqused_k, n, k.shape[1] if cu_seqlens_k is None else 0)
        stride = 0 if cu_seqlens_k is not None else k.shape[1]
        idx = [torch.arange(st, st + ln, device=k.device) + i * stride for i, (st, ln) in enumerate(ks)]
    seqs = []
    for i, ((qs, ql), ki) in enumerate(zip(rows, idx)):
        seqs.append(Sequence(i, (qs, qs + ql), ki.to(device=k.device, dtype=torch.int64)))
    return seqs


def _batch_size(q, cu_q, cu_k, used_q, used_k, page_table) -> int:
    for name, t in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if t is not None:
            if t.dim() != 1 or t.dtype != torch.int32:
                raise ValueError(f"{name} must be a 1-d int32 tensor (batch + 1,), got {t.dtype} {tuple(t.shape)}")
            return t.shape[0] - 1
    if page_table is not None:
        return page_table.shape[0]
    for t in (used_q, used_k):
        if t is not None:
            return t.shape[0]
    return q.shape[0]


def _seq_tensors(q, k, v, seq: Sequence, packed_q: bool):
    """Sequence ``seq``'s q (1, sq, hq, d), k, v (1, sk, hk, ·)."""
    r0, r1 = seq.q_rows
    qs = q[r0:r1] if packed_q else q[seq.index, r0:r1]
    kf = k.reshape(-1, *k.shape[-2:])
    vf = v.reshape(-1, *v.shape[-2:])
    return qs.unsqueeze(0), kf[seq.k_index].unsqueeze(0), vf[seq.k_index].unsqueeze(0)


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    seqused_q: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    page_table: torch.Tensor | None = None,
    num_splits: int = 1,
    pack_gqa: bool | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int | None, int | None] = (None, None),
    softcap: float = 0.0,
    learnable_sink: torch.Tensor | None = None,
    return_lse: bool = False,
    numerics: FA4Numerics | None = None,
    arch: str = "sm100",
    num_sms: int = 148,
    mma: str = "exact",
    overrides: dict | None = None,
    score_mod=None,
    mask_mod=None,
    aux_tensors: list | None = None,
    block_sparse_tensors=None,
    aux_scalars: tuple | None = None,
):
    """The varlen entry as production computes it (module doc).

    q: (total_q, hq, d) with ``cu_seqlens_q`` else (b, sq, hq, d); k, v: (total_k, hk, ·) with
    ``cu_seqlens_k``, (num_pages, page_size, hk, ·) with ``page_table`` (b, pages) int32, else
    (b, sk, hk, ·).  Returns out shaped as q with v's head dim (rows past ``seqused_q`` are 0)
    and, with ``return_lse``, lse (hq, total_q) or (b, hq, sq) float32 (-inf past seqused_q).
    ``numerics=None``: production's for ``arch`` per sequence (SM100: no 2-CTA on packed
    queries, seqused_q, splits or pages other than 128, as ``interface._flash_attn_fwd``).
    ``num_sms``: the GPU's SM count (148: B200), which sets SM100's per-sequence split counts on
    varlen queries (:func:`dynamic_splits`).  ``mma``: ``FA4Numerics.mma`` of those per-sequence
    numerics (ignored with ``numerics``), ``overrides`` further ``FA4Numerics`` fields set on
    them (a variant's knobs).  ``score_mod`` / ``mask_mod`` / ``aux_tensors``: the contract's
    mods (``numerics.mods``), applied per sequence as production's varlen entry applies them
    (:func:`sequence_mods`: ``batch_idx`` the sequence, ``q_idx`` / ``kv_idx`` positions within
    it; with a mask_mod the flags are dropped, ``interface._resolve_causal_local_window``);
    ``aux_scalars``: the runtime scalars, bound as ``fa4.model.attention`` binds them.
    ``block_sparse_tensors``: per sequence a ``numerics.mods.BlockSparse`` of that sequence's
    blocks, (1, heads|1, ceil(seqlen_q / block_q), ceil(seqlen_k / block_k)) over its rows and
    used keys, or None for a sequence without queries or keys (:func:`varlen_block_sparse`;
    production's varlen layout, :func:`varlen_block_lists`).  Refused
    (NotImplementedError) as production refuses it: a sparse query block other than ``q_stage *
    tile_m`` (``block_sparsity.normalize_block_sparse_config``); and with split-KV, which the
    model does not model (FA#2761: production hangs there).
    """
    bsl = None if block_sparse_tensors is None else varlen_block_sparse(block_sparse_tensors)
    if bsl is not None and num_splits > 1:
        raise NotImplementedError(
            f"block sparsity with split-KV (num_splits={num_splits}) on the varlen entry is not modelled by fa4.varlen "
            "(production hangs there, FA#2761)"
        )
    check_mods(softcap, score_mod, mask_mod, aux_tensors, None)
    score_mod, mask_mod, _ = bind_model_scalars(aux_scalars, score_mod, mask_mod, None)
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be an int >= 1 (the model takes no heuristic 0), got {num_splits!r}")
    packed_q = cu_seqlens_q is not None
    if q.dim() != (3 if packed_q else 4):
        raise ValueError(
            f"q must be {'(total_q, heads, d)' if packed_q else '(batch, seqlen, heads, d)'}, got {tuple(q.shape)}"
        )
    seqs = sequences(
        q,
        k,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        seqused_q=seqused_q,
        seqused_k=seqused_k,
        page_table=page_table,
    )
    if bsl is not None and len(bsl) != len(seqs):
        raise ValueError(f"block_sparse_tensors has {len(bsl)} entries for {len(seqs)} sequences: one per sequence")
    hq, hk = q.shape[-2], k.shape[-2]
    pack = packs_gqa(pack_gqa, hq, hk)
    out, lse = empty_outputs(q, v, packed=packed_q)
    page_size = None if page_table is None else k.shape[1]
    if mask_mod is not None:  # interface._resolve_causal_local_window: a mask_mod drops causal and the window
        causal, window_size = False, (None, None)
    kw = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap)
    splits = _splits(seqs, num_splits, arch, packed_q or seqused_q is not None, hq, hk, pack, num_sms)
    for seq, n_split in zip(seqs, splits):
        qs, ks, vs = _seq_tensors(q, k, v, seq, packed_q)
        if qs.shape[1] == 0:
            continue
        validate_inputs(qs, ks, vs, learnable_sink)
        bs = None if bsl is None or ks.shape[1] == 0 else bsl[seq.index]
        nm = numerics or replace(
            sequence_numerics(
                arch,
                qs,
                ks,
                vs,
                causal,
                window_size,
                varlen_q=packed_q or seqused_q is not None,
                num_splits=num_splits,
                page_size=page_size,
                pack=pack,
                max_seqlen_q=max_seqlen_q,
                block_sparse=None if bs is None else tuple(bs.block_size),
            ),
            **{"mma": mma, **(overrides or {})},
        )
        if bs is not None and packed_q and bs.block_size[0] != nm.tile_m:
            raise NotImplementedError(
                f"Varlen block sparsity requires sparse_block_size[0]={nm.tile_m} (= q_stage * tile_m); got "
                f"{bs.block_size[0]} (block_sparsity.normalize_block_sparse_config)"
            )
        mods = FwdMods.of(
            **sequence_mods(
                seq.index,
                score_mod=score_mod,
                mask_mod=mask_mod,
                aux_tensors=aux_tensors,
                block_sparse_tensors=None if bs is None else bsl,
            )
        )
        o, lo = _one_sequence(
            qs,
            ks,
            vs,
            nm,
            kw,
            learnable_sink,
            hq // hk if pack else 1,
            n_split,
            out.dtype,
            split_kv=num_splits > 1,
            mods=None if mods.empty else mods,
        )
        seq.place(out, lse, o, lo, packed=packed_q)
    return (out, lse) if return_lse else out


def _splits(seqs, num_splits: int, arch: str, varlen_q: bool, hq: int, hk: int, pack: bool, num_sms: int) -> list[int]:
    if arch == "sm100" and num_splits > 1 and varlen_q:
        lens = [(s.q_rows[1] - s.q_rows[0], s.k_index.numel()) for s in seqs]
        return dynamic_splits(lens, num_splits, heads=hq, heads_kv=hk, pack=pack, num_sms=num_sms)
    return [num_splits] * len(seqs)


def split_counts(q: torch.Tensor, k: torch.Tensor, *, arch: str = "sm100", num_sms: int = 148, **kw) -> list[int]:
    """The split count :func:`varlen_attention` uses for each sequence of a call with these
    arguments (``kw``: the varlen keywords; others ignored): the static ``num_splits``, or
    SM100's per-sequence counts on varlen queries.  The split-KV bound needs the same."""
    keys = ("cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k", "page_table")
    seqs = sequences(q, k, **{n: kw.get(n) for n in keys})
    hq, hk = q.shape[-2], k.shape[-2]
    pack = packs_gqa(kw.get("pack_gqa"), hq, hk)
    varlen_q = kw.get("cu_seqlens_q") is not None or kw.get("seqused_q") is not None
    return _splits(seqs, kw.get("num_splits", 1), arch, varlen_q, hq, hk, pack, num_sms)


def dynamic_splits(
    lengths: list[tuple[int, int]],
    num_splits: int,
    *,
    heads: int,
    heads_kv: int,
    pack: bool,
    num_sms: int = 148,
    tile_m: int = 128,
    tile_n: int = 128,
) -> list[int]:
    """SM100's split count per sequence of a split-KV call on varlen queries
    (``prepare_scheduler.py`` ``FlashPrepareScheduler``, run by ``interface._flash_attn_fwd``
    through ``_get_scheduler_metadata`` when ``is_split_kv and is_varlen_q``): with
    ``m_b = ceil(seqlen_q (x qhead_per_kvhead under pack_gqa) / tile_m)``, ``n_b =
    ceil(seqlen_k / tile_n)`` and ``total = sum m_b n_b``, blocks per SM ``bps = max(int(total *
    margin * H / num_sms), 1)`` in float32 (``margin = max(num_sms / 128 + 0.001, 1.1)``, H the
    KV heads under pack_gqa, else the query heads), and ``max(1, min(ceil(n_b / bps),
    num_splits))`` per sequence (``zfill_padded_output``: at least 1).  More than 992 sequences
    (a second CTA in the prepare grid) give 1 each.  The combine reads that many splits."""
    f32 = np.float32
    if len(lengths) > 992 or num_splits == 1:
        return [1] * len(lengths)
    rep = heads // heads_kv if pack else 1
    m = [-(-sq * rep // tile_m) for sq, _ in lengths]
    n = [-(-sk // tile_n) for _, sk in lengths]
    total = sum(a * b for a, b in zip(m, n))
    margin = max(f32(num_sms) / f32(128) + f32(0.001), f32(1.1))
    bps = max(int(f32(f32(f32(total) * margin) * f32(heads_kv if pack else heads)) / f32(num_sms)), 1)
    return [max(1, min(-(-nb // bps), num_splits)) for nb in n]


def packs_gqa(pack_gqa: bool | None, heads_q: int, heads_kv: int) -> bool:
    """Whether a call packs GQA: as asked, else production's default, on when query heads share
    a KV head (``interface.py``: ``pack_gqa = qhead_per_kvhead > 1`` when None)."""
    return pack_gqa if pack_gqa is not None else heads_q // heads_kv > 1


def sequence_numerics(
    arch: str,
    q,
    k,
    v,
    causal: bool,
    window: tuple,
    *,
    varlen_q: bool,
    num_splits: int,
    page_size: int | None,
    pack: bool,
    max_seqlen_q: int | None,
    block_sparse: tuple[int, int] | None = None,
) -> FA4Numerics:
    """Production's numerics for one sequence (batch-1 q, k, v) of a varlen call: SM90's depend
    on head dims and masks only; SM100's 2-CTA choice (which sets the exp2 interleave) is off for
    packed or seqused queries (``varlen_q``; head dim 256 aside), splits and page sizes other than
    128 (``page_size`` None or 0: no page table; ``interface.py`` ``use_2cta_instrs``), its tile
    count follows ``max_seqlen_q``, and packed GQA on varlen queries changes the interleave
    (``FA4Numerics.sm100`` ``varlen_q``).  ``block_sparse``: the sparse block size of a
    block-sparse call (SM90's tiles fitted to it; SM100 without 2-CTA)."""
    if arch == "sm90":
        return FA4Numerics.for_inputs("sm90", q, k, v, causal, window, block_sparse=block_sparse)
    local = not causal and any(w is not None for w in window)
    hd256 = q.shape[-1] == 256 and v.shape[-1] == 256
    off = num_splits > 1 or page_size not in (None, 0, 128) or (varlen_q and not hd256)
    return FA4Numerics.sm100(
        q.dtype,
        q.shape[-1],
        causal,
        local,
        seqlen_q=max_seqlen_q or q.shape[1],
        qhead_per_kvhead=q.shape[2] // k.shape[2],
        head_dim_v=v.shape[-1],
        use_2cta=False if off else None,
        pack_gqa=bool(pack),
        varlen_q=varlen_q,
        block_sparse=block_sparse,
    )


def varlen_block_sparse(bs) -> tuple:
    """A varlen call's ``block_sparse_tensors`` checked: a list or tuple with, per sequence, a
    ``numerics.mods.BlockSparse`` of batch 1 (its own blocks) or None (no queries or keys), all
    of one block size."""
    if not isinstance(bs, (list, tuple)) or not all(b is None or isinstance(b, BlockSparse) for b in bs):
        raise TypeError(
            "block_sparse_tensors of a varlen call must be a list with one numerics.mods.BlockSparse (batch 1) or "
            f"None per sequence, got {type(bs).__name__}"
        )
    sizes = {tuple(b.block_size) for b in bs if b is not None}
    if len(sizes) > 1 or any(b.full.shape[0] != 1 for b in bs if b is not None):
        raise ValueError(
            f"the sequences' BlockSparse must have batch 1 and one block size; got sizes {sorted(sizes)} and batches "
            f"{sorted({b.full.shape[0] for b in bs if b is not None})}"
        )
    return tuple(bs)


def varlen_block_lists(bsl, lengths: list[tuple[int, int]], *, heads: int) -> dict:
    """The per-sequence block masks ``bsl`` (:func:`varlen_block_sparse`) in production's varlen
    block-sparse layout, the fields of ``BlockSparseTensorsTorch`` (``block_sparsity.py``), for
    sequences of ``lengths`` (rows, used keys) and ``heads`` query heads.  Read from
    ``block_sparse_utils._get_curr_blocksparse_tensors_varlen``: query block j of sequence b has
    its counts at ``[head, cu_total_m_blocks[b] + j]`` and its key-block list at ``[head,
    cu_block_idx_offsets[b] + j * n_b ..]``, ``n_b = ceil(seqlen_k_b / block_k)`` entries (the
    kernel's ``seqlen_info.num_n_blocks`` per KV subtile factor), ascending and packed to the left
    as ``fa4.mods.block_sparse_index_lists`` writes them; ``m_b = ceil(seqlen_q_b / block_q)``.
    Heads: 1 when every sequence's masks broadcast over heads (production keeps pack_gqa only
    then, ``interface._flash_attn_fwd``), else ``heads``.  A sequence without a BlockSparse (no
    queries or keys) has zero counts.  Returns int32 CPU tensors: ``mask_block_cnt`` /
    ``full_block_cnt`` (H, total_m_blocks), ``mask_block_idx`` / ``full_block_idx`` (H,
    total_index), ``cu_total_m_blocks`` / ``cu_block_idx_offsets`` (sequences + 1,)."""
    sizes = {tuple(b.block_size) for b in bsl if b is not None}
    bq, bk = sizes.pop() if sizes else (128, 128)
    H = 1 if all(b is None or b.full.shape[1] == 1 for b in bsl) else heads
    cnt: dict = {"mask": [], "full": []}
    idx: dict = {"mask": [], "full": []}
    m_all, off_all = [0], [0]
    for b, (sq, sk) in zip(bsl, lengths, strict=True):
        mb, nb = -(-sq // bq), -(-sk // bk)
        if b is not None and tuple(b.full.shape[2:]) != (mb, nb):
            raise ValueError(
                f"a sequence of {sq} rows and {sk} keys has {mb} x {nb} blocks of {(bq, bk)}; its BlockSparse has "
                f"{tuple(b.full.shape[2:])}"
            )
        for kind, blocks in (("mask", None if b is None else b.partial), ("full", None if b is None else b.full)):
            if blocks is None or nb == 0:
                cnt[kind].append(torch.zeros(H, mb, dtype=torch.int32))
                idx[kind].append(torch.zeros(H, mb * nb, dtype=torch.int32))
                continue
            c, i = block_sparse_index_lists(blocks.cpu().expand(1, H, mb, nb).contiguous())
            cnt[kind].append(c[0])
            idx[kind].append(i[0].reshape(H, mb * nb))
        m_all.append(m_all[-1] + mb)
        off_all.append(off_all[-1] + mb * nb)
    out = {f"{k}_block_cnt": torch.cat(cnt[k], 1).contiguous() for k in cnt}
    out.update({f"{k}_block_idx": torch.cat(idx[k], 1).contiguous() for k in idx})
    out["cu_total_m_blocks"] = torch.tensor(m_all, dtype=torch.int32)
    out["cu_block_idx_offsets"] = torch.tensor(off_all, dtype=torch.int32)
    return out


def sequence_mods(
    index: int, *, score_mod=None, mask_mod=None, aux_tensors=None, aux_scalars=None, block_sparse_tensors=None
) -> dict:
    """The mod keywords with which sequence ``index`` of a varlen call computes, as a batch-1 call
    on its own rows and keys: each mod sees ``b = index`` (``numerics.mods.at_sequence``: the
    sequence is production's ``batch_idx``; ``q_idx`` / ``kv_idx`` are already positions within
    the sequence in a batch-1 call) and the whole ``aux_tensors`` list, unsliced: a per-batch aux
    tensor has one row per sequence (the library's: rows padded to the call's largest lengths,
    ``audits.suites.inputs.make_varlen_inputs``).  The model forms (``fa4.mod_forms``: ``model(acc,
    scale, b, ...)``, ``model_bwd(g, x, b, ...)``) are shifted alike; the CuTe forms are left out
    (production gets the caller's mods, not these).  ``aux_scalars`` are passed on as given (the
    whole call's, as production's ``AuxData``).  ``block_sparse_tensors`` (the call's, one per
    sequence): sequence ``index``'s, its mask mod shifted alike.  Used by :func:`varlen_attention` and by the
    varlen references and bounds (``audits.engine.evaluate``), so all three see the same indices."""
    out: dict = {}
    for name, mod in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if mod is None:
            continue
        forms = {f: shift_batch_arg(mod.forms.get(f), 2, index) for f in ("model", "model_bwd") if f in mod.forms}
        out[name] = at_sequence(mod, index, forms=forms)
    if aux_tensors is not None:
        out["aux_tensors"] = list(aux_tensors)
    if aux_scalars is not None:
        out["aux_scalars"] = aux_scalars
    bs = None if block_sparse_tensors is None else block_sparse_tensors[index]
    if bs is not None:  # sequence i's blocks, its partial blocks applying the mask mod as sequence i sees it
        mm = bs.mask_mod
        if mm is not None:
            mm = out["mask_mod"] if mm is mask_mod else sequence_mods(index, mask_mod=mm)["mask_mod"]
        out["block_sparse_tensors"] = replace(bs, mask_mod=mm)
    return out


def _one_sequence(q, k, v, nm, kw, sink, pack: int, num_splits: int, out_dtype, *, split_kv: bool = False, mods=None):
    """One sequence: the loop over each split's blocks, the epilogue, and (``split_kv``) the
    combine.  A split-KV call stays one when a sequence gets a single split (SM100's per-sequence
    counts): the kernel still writes partials (an empty range: LSE -inf, no sink) and the combine
    still weighs them (a weight of ex2(0) * 1/sum, not always exactly 1).  Returns out (1, sq,
    hq, dv) and lse (1, hq, sq)."""
    sq, hq, sk = q.shape[1], q.shape[2], k.shape[1]
    n_min, n_max, _ = kv_block_ranges(sq, sk, nm, kw["causal"], kw["window_size"], q.device, heads=hq, pack=pack)
    if not split_kv:
        st, sl2, off = forward_loop(q, k, v, nm, ranges=(n_min, n_max), mods=mods, **kw)
        out, lse = finalize(nm, st.row_max, st.final_row_sum(nm), st.acc_o, sl2, off, sink, out_dtype)
        return out.permute(0, 2, 1, 3), lse
    parts = [
        _split_partial(q, k, v, nm, kw, sink, split_ranges(n_min, n_max, s, num_splits), s, mods)
        for s in range(num_splits)
    ]
    o_part = torch.stack([p[0] for p in parts])  # (splits, 1, hq, sq, dv)
    l_part = torch.stack([p[1] for p in parts])  # (splits, 1, hq, sq)
    out, lse = combine(o_part, l_part, out_dtype)
    return out.permute(0, 2, 1, 3), lse


def _split_partial(q, k, v, nm, kw, sink, ranges, split: int, mods=None):
    """Split ``split``'s float32 partial O (normalised by its own row sum) and partial LSE, as
    the epilogue writes them to ``out_partial`` / ``lse_partial``: the fixed-length epilogue
    without the output cast.  A row whose split owns no block writes O = 0, LSE = -inf (the
    kernel skips it and the host zero-fills the partials: ``interface.py``).  The learnable sink
    enters split 0 only, so that the combine counts it once."""
    st, sl2, off = forward_loop(q, k, v, nm, ranges=ranges, mods=mods, **kw)
    o, lse = finalize(
        nm, st.row_max, st.final_row_sum(nm), st.acc_o, sl2, off, sink if split == 0 else None, torch.float32
    )
    work = (ranges[1] > ranges[0]).view(1, *ranges[0].shape)
    return torch.where(work.unsqueeze(-1), o, torch.zeros_like(o)), torch.where(
        work, lse, torch.full_like(lse, -math.inf)
    )


@dataclass(frozen=True)
class CombineOps:
    """How :func:`combine` evaluates its steps.  The defaults are the model (MUFU stand-ins
    correctly rounded, as in ``fa4.model``; the fusions ptxas applies); the H200 fidelity probe
    (``benchmarks/experiments/combine_fidelity.py``) swaps in production's MUFU functions and the other
    fusions to find which matches production's combine kernel bit for bit.

    exp2, lg2: float32 -> float32 (``ex2.approx.ftz``, ``lg2.approx.ftz``).
    scale_fma: step 2 as one FFMA (else two roundings: ``fl(fl(lse l2e) - fl(max l2e))``).
    lse_fma: step 4's ``lg2 * ln2 + max`` as one FFMA (else ``fl(fl(lg2 * ln2) + max)``).
    inv: ``"div"`` (``div.rn``, a correctly rounded 1/x) or ``"rcp"`` (``rcp.approx.ftz``; then
    ``rcp`` is used)."""

    exp2: object = None
    lg2: object = None
    rcp: object = None
    scale_fma: bool = True
    lse_fma: bool = True
    inv: str = "div"


def _div(x: torch.Tensor) -> torch.Tensor:
    return (1.0 / x.double()).float()


def combine(
    o_partial: torch.Tensor, lse_partial: torch.Tensor, out_dtype: torch.dtype, ops: CombineOps | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``flash_fwd_combine.py`` ``FlashAttentionForwardCombine.kernel`` per row: o_partial
    (splits, ..., dv) float32, lse_partial (splits, ...) float32 -> out (..., dv) in
    ``out_dtype``, lse (...) float32.

    1. ``lse_max`` = max over splits (``ReductionOp.MAX`` and ``warp_reduction_max``: fmax, NaN
       ignored); ``lse_max_cur`` = 0 where every split is -inf.
    2. ``scale_s = ex2.approx.ftz(lse_s * LOG2_E - lse_max_cur * LOG2_E)``: the second product
       is loop-invariant; ptxas contracts the first with the subtraction into one FFMA (no
       rounding modifier, so ``fmad`` applies), as in the softmax (``fa4.model`` step 5).
    3. ``sum``: per thread its splits in order from 0.0, then the warp butterfly across the
       threads of a row (:func:`_split_sum`).
    4. ``lse = log(sum) + lse_max`` (``cute.math.log(fastmath=True)``: ``lg2.approx * ln2``; the
       multiply and the add contracted); ``inv = 1 / sum`` (``div.rn``; 0 where sum is 0 or
       NaN); ``scale_s *= inv``.
    5. ``O = sum_s scale_s * O_s`` from 0.0 in split order, one FFMA per split; splits with
       scale 0 are skipped (0 * inf never enters); cast to ``out_dtype`` (rn).
    """
    ops = ops or CombineOps()
    ex2, lg2 = ops.exp2 or hardware_exp2, ops.lg2 or hardware_lg2
    l2e = torch.tensor(to_f32(LOG2_E), device=lse_partial.device)
    ln2 = torch.tensor(to_f32(math.log(2.0)), device=lse_partial.device)
    nan_free = torch.where(torch.isnan(lse_partial), torch.full_like(lse_partial, -math.inf), lse_partial)
    lse_max = nan_free.amax(0)
    cur = torch.where(lse_max == -math.inf, torch.zeros_like(lse_max), lse_max)
    if ops.scale_fma:
        scales = ex2(fma(lse_partial, l2e, -(cur * l2e)))
    else:
        scales = ex2(lse_partial * l2e - cur * l2e)
    total = _split_sum(scales, threads=32 if o_partial.shape[-1] > 64 else 16)
    lse = fma(lg2(total), ln2, lse_max) if ops.lse_fma else lg2(total) * ln2 + lse_max
    bad = (total == 0) | torch.isnan(total)
    safe = torch.where(bad, torch.ones_like(total), total)
    inv = torch.where(bad, torch.zeros_like(total), ops.rcp(safe) if ops.inv == "rcp" else _div(safe))
    scales = scales * inv
    acc = torch.zeros_like(o_partial[0])
    for s in range(o_partial.shape[0]):
        w = scales[s].unsqueeze(-1).expand_as(acc).contiguous()
        acc = torch.where(w > 0, fma(w, o_partial[s].contiguous(), acc.contiguous()), acc)
    return acc.to(out_dtype), lse


def _split_sum(scales: torch.Tensor, threads: int) -> torch.Tensor:
    """Step 3 of :func:`combine`: the sum of a row's split scales in the kernel's order.  The
    combine runs 256 threads on tiles of 8 rows (head dim > 64) or 16 (``interface.py``
    ``_flash_attn_fwd_combine``), so ``threads`` = 32 or 16 threads share a row; the s2r copy
    (``make_ordered_layout((threads, ·), order=(0, 1))``) gives thread t the splits t, t +
    threads, ... (padding splits are -inf: scale 0).  Each thread adds its own from 0.0 in
    order; ``warp_reduction_sum`` then adds ``shfl_bfly`` partners at offsets threads/2, ..., 1
    (own value first; float addition is commutative, so every lane ends with lane 0's)."""
    n = scales.shape[0]
    pad = (-n) % threads
    x = torch.cat([scales, torch.zeros(pad, *scales.shape[1:], dtype=scales.dtype, device=scales.device)])
    x = x.view(-1, threads, *scales.shape[1:])  # (rounds, lanes, ...)
    acc = torch.zeros_like(x[0])
    for j in range(x.shape[0]):
        acc = acc + x[j]
    off = threads // 2
    while off:
        acc = acc[:off] + acc[off : 2 * off]
        off //= 2
    return acc[0]
