"""Block sparsity in the forward: which KV tiles each query tile visits, in production's order
(``block_sparse_utils.py`` ``consume_block_sparse_loads`` on SM90, ``softmax_block_sparse_sm100``
on SM100; ``fa4.model``'s module doc, "Mods"), and the schedule ``fa4.forward_loop`` runs them in.
"""

from __future__ import annotations

import torch

from fa4.knobs import FA4Numerics
from fa4.primitives import check_block_sparse
from numerics.mods import BlockSparse

__all__ = ["block_sparse_kv_order", "sparse_steps"]


def block_sparse_kv_order(bs: BlockSparse, b: int, h: int, qb: int, tile_n: int, sk: int) -> list[tuple[int, str]]:
    """The KV tiles a query tile of sparse query block ``qb`` (batch ``b``, head ``h``, indices
    into the block masks, broadcast dims 0) visits, in production's order, each with its kind:
    ``"partial"`` (the mask_mod applied), ``"full_first"`` (no mask_mod; the full list's first
    coarse block, which ``softmax_block_sparse_sm100_list`` runs with the seqlen ``mask_fn``) or
    ``"full"``.  ``consume_block_sparse_loads`` (SM90) / ``softmax_block_sparse_sm100``: the
    partial list, then the full list, each from its last entry to its first
    (``mask_block_idx[cnt - 1 - i]``), the lists ascending (the block masks' order); a coarse
    block of ``kv_subtile_factor`` tiles from its last tile to its first
    (``sparse_physical_n_block_forward`` over descending offsets).  Tiles at or beyond seqlen_k
    (a coarse block's tail) are dropped: production runs them fully masked, which leaves the
    row's state as it was (row max -inf, sum and O 0 times a 0 rescale) on finite inputs."""
    f = bs.block_size[1] // tile_n
    nblk = -(-sk // tile_n)
    out = []
    for mask, kind in ((bs.partial, "partial"), (bs.full, "full")):
        lst = mask[b, h, qb].nonzero().flatten().tolist()
        for i, c in enumerate(reversed(lst)):
            k = "full_first" if kind == "full" and i == 0 else kind
            out += [(c * f + j, k) for j in reversed(range(f)) if c * f + j < nblk]
    return out


def sparse_steps(bs: BlockSparse, nm: FA4Numerics, b: int, hq: int, sq: int, sk: int, dev):
    """The block-sparse forward schedule: (n, active, masked, hw) per step, each (b, heads_q, sq)
    bool — the rows visiting KV tile n at that step of their tile's order
    (:func:`block_sparse_kv_order`), those applying the mask_mod there (partial blocks) and those
    running it as a masked iteration (partial, or the full list's first coarse block).  Rows are
    independent, so the steps only keep each row's own order."""
    check_block_sparse(bs, b, hq, sq, sk, nm.tile_m, nm.tile_n, nm.arch)
    B, H, nq, _ = bs.full.shape
    full, part = bs.full.cpu(), bs.partial.cpu()
    bsc = BlockSparse(full, part, tuple(bs.block_size))
    kinds = {"partial": 0, "full_first": 1, "full": 2}
    orders = [
        [[block_sparse_kv_order(bsc, i, j, qb, nm.tile_n, sk) for qb in range(nq)] for j in range(H)] for i in range(B)
    ]
    steps = max((len(o) for ob in orders for oh in ob for o in oh), default=0)
    n_at = torch.full((B, H, nq, max(steps, 1)), -1, dtype=torch.int64)
    k_at = torch.zeros_like(n_at)
    for i in range(B):
        for j in range(H):
            for qb in range(nq):
                for t, (n, kind) in enumerate(orders[i][j][qb]):
                    n_at[i, j, qb, t], k_at[i, j, qb, t] = n, kinds[kind]
    row_blk = torch.arange(sq) // bs.block_size[0]
    n_rows, k_rows = (x[:, :, row_blk].expand(b, hq, sq, -1).to(dev) for x in (n_at, k_at))
    for t in range(steps):
        nt, kt = n_rows[..., t], k_rows[..., t]
        for n in sorted(set(nt.unique().tolist()) - {-1}):
            active = nt == n
            yield n, active, active & (kt == 0), active & (kt <= 1)
