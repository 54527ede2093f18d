"""Which KV blocks a query row visits: production's block ranges (``block_info.py``), shared by
the model (``fa4.model``, ``fa4.varlen``) and the split-KV error bound
(``numerics.forward_bound``).  A tile is ``tm`` query rows by ``tn`` keys."""

from __future__ import annotations

import torch

__all__ = ["block_ranges", "split_ranges", "split_key_masks", "masked_blocks"]


def _m_blocks(sq: int, tm: int, device, heads: int, pack: int) -> torch.Tensor:
    """(heads, sq): each row's m_block; with pack_gqa (``pack`` > 1) the packed index is
    ``row * pack + head % pack`` (``pack_gqa.py``: divmod by qhead_per_kvhead gives (row, head))."""
    rows = torch.arange(sq, device=device).view(1, sq)
    grp = (torch.arange(heads, device=device) % pack).view(heads, 1)
    return (rows * pack + grp) // tm


def block_ranges(
    sq: int, sk: int, tm: int, tn: int, causal: bool, window: tuple, device, *, heads: int = 1, pack: int = 1
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Per (head, query row): [n_min, n_max) of the KV blocks its query tile visits
    (``block_info.BlockInfo.get_n_block_min_max``), and the number of blocks.  ``pack`` > 1 is
    pack_gqa: the ``pack`` query heads of a KV head share the M dimension of a tile, packed
    index ``row * pack + head % pack`` (``pack_gqa.py``: the divmod by qhead_per_kvhead gives
    (row, head)), and a tile's query rows are ``ceil``/``floor`` of its packed range / pack."""
    left, right = window
    if causal:
        right = 0
    nblk = max(1, -(-sk // tn))
    mb = _m_blocks(sq, tm, device, heads, pack)
    n_max = torch.full((heads, sq), -(-sk // tn), dtype=torch.int64, device=device)  # 0 blocks when sk = 0
    if right is not None:
        m_idx_max = -(-((mb + 1) * tm) // pack)
        n_idx_right = torch.clamp(m_idx_max + sk - sq + right, min=0)
        n_max = torch.minimum(n_max, -(-n_idx_right // tn))
    n_min = torch.zeros((heads, sq), dtype=torch.int64, device=device)
    if left is not None:
        n_idx_left = torch.div(mb * tm, pack, rounding_mode="floor") + sk - sq - left
        n_min = torch.clamp(torch.div(n_idx_left, tn, rounding_mode="floor"), min=0)
    return n_min, n_max, nblk


def split_ranges(n_min: torch.Tensor, n_max: torch.Tensor, split: int, num_splits: int):
    """Split ``split`` of ``num_splits`` of each row's block range (``block_info.py``
    ``get_n_block_min_max`` under ``is_split_kv``): ``ceil((n_max - n_min) / num_splits)`` blocks
    per split (0 for an empty range), split s taking the s-th run of them, cut at n_max.  A
    split left with no block (n_min >= n_max) has no KV work (``BlockInfo.has_kv_work``)."""
    per = torch.where(n_max <= n_min, torch.zeros_like(n_min), (n_max - n_min + num_splits - 1) // num_splits)
    lo = n_min + split * per
    return lo, torch.minimum(lo + per, n_max)


def split_key_masks(
    sq: int, sk: int, tm: int, tn: int, causal: bool, window: tuple, device, *, heads: int, pack: int, num_splits: int
) -> list[torch.Tensor]:
    """Per split: a bool (heads, sq, sk) mask of the keys each row's split visits (the keys of
    its blocks; masking within them is the caller's)."""
    n_min, n_max, _ = block_ranges(sq, sk, tm, tn, causal, window, device, heads=heads, pack=pack)
    blk = (torch.arange(sk, device=device) // tn).view(1, 1, sk)
    masks = []
    for s in range(num_splits):
        lo, hi = split_ranges(n_min, n_max, s, num_splits)
        masks.append((blk >= lo.unsqueeze(-1)) & (blk < hi.unsqueeze(-1)))
    return masks


def masked_blocks(
    sq: int, sk: int, tm: int, tn: int, causal: bool, window: tuple, device, *, heads: int = 1, pack: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (head, row): the blocks its query tile runs *with a mask* apply: blocks >= the first
    value (the causal / right-window diagonal, ``BlockInfo.get_n_block_min_causal_local_mask``;
    nblk when there is no right mask) and blocks < the second (the left window's edge,
    ``get_n_block_min_before_local_mask``; 0 without one).  The last block is masked as well
    when seqlen_k is not a multiple of tn (the seqlen mask of the first iteration)."""
    left, right = window
    if causal:
        right = 0
    nblk = max(1, -(-sk // tn))
    mb = _m_blocks(sq, tm, device, heads, pack)
    hi = torch.full((heads, sq), nblk, dtype=torch.int64, device=device)
    if right is not None:
        n_idx_right = torch.div(mb * tm, pack, rounding_mode="floor") + sk - sq + right
        hi = torch.clamp(torch.div(n_idx_right, tn, rounding_mode="floor"), min=0)
    lo = torch.zeros((heads, sq), dtype=torch.int64, device=device)
    if left is not None:
        n_idx_left = -(-((mb + 1) * tm) // pack) + sk - sq - left
        lo = torch.clamp(-(-n_idx_left // tn), min=0)
    return hi, lo
