"""Score and mask modifications (FA4's ``score_mod`` / ``mask_mod``, flex_attention's) as numbers.

A *mod* is one mathematical function with several forms.  This module holds the **reference
form**: torch operations over broadcast index tensors, dtype-polymorphic, so that one function
is evaluated in float64 by the FP64 reference (``numerics.reference``) and in float32, in
production's order of operations, by the model (``fa4.model``).  The kernel forms (production's
CuTe-DSL function and its ``score_mod_bwd``) are opaque here: they ride in ``forms`` untouched
and are attached by ``fa4.mods``.  numerics knows no FA4: what a form means is ``fa4``'s business.

Semantics (production's, ``flash_attn/cute/softmax.py`` ``apply_score_mod_inner``, and
flex_attention's): the score a mod sees is ``s = softmax_scale * (q . k)`` (the scale is applied
*before* the mod: ``utils.compute_softmax_scale_log2`` keeps it apart when a score_mod is given),
and the softmax runs on ``f(s)``; a mask_mod returns True where the key is kept; a masked score
is -inf after the score_mod.  Index arguments are logical positions within the sequence:
``b`` batch, ``h`` the *query* head, ``q_idx`` the query row, ``kv_idx`` the key.

Index tensors (:func:`index_grid`) broadcast as (b, 1, 1, 1), (1, h, 1, 1), (1, 1, i, 1),
(1, 1, 1, j), int64.  A reference form must be written with tensor operations only (indexing an
aux tensor with index tensors, ``torch.where``, no Python branching on values) so that it also
runs elementwise under flex_attention's vmap.

Block sparsity (production's ``BlockSparseTensorsTorch``, flex's ``BlockMask``) is held here as
dense block masks (:class:`BlockSparse`): per (batch, head, query block, key block), *full*
(visited, the mask_mod not applied) or *partial* (visited, the mask_mod applied); a block in
neither is skipped.  A key is visible to a query when its block is full, or partial and the
mask_mod keeps it (:func:`visibility`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "ScoreMod", "MaskMod", "BlockSparse", "index_grid", "visibility", "block_sparse_from_mask",
]  # fmt: skip


@dataclass(frozen=True, eq=False)
class ScoreMod:
    """A score modification ``s -> f(s, b, h, q_idx, kv_idx, aux)``.

    ``fn(s, b, h, q_idx, kv_idx, aux)``: the reference form; ``s`` float64 (the reference) or
    float32 (the model: then each operation rounds to float32 in production's order, and the
    docstring of the mod says which production operations it mirrors).  ``aux`` is the call's
    whole ``aux_tensors`` list (production hands every mod the same list); a mod reads its own
    entries from ``aux_base`` on.
    ``grad(g, s, b, h, q_idx, kv_idx, aux)``: the reference form of ``score_mod_bwd``:
    ``g * f'(s)`` at the pre-mod score ``s``, same dtype rules; None when the mod has no
    backward (the backward is then refused).
    Bound hooks (``numerics.forward_bound`` / ``backward_bound``; None = not bounded: the
    bound is infinite where the mod applies, and says so):
      ``value_error(s, b, h, q_idx, kv_idx, aux)``: per element, a bound on
        |fl32(fn)(s) - f(s)| for the float32 score ``s`` (given as float64);
      ``slope(lo, hi, b, h, q_idx, kv_idx, aux)``: sup |f'| over [lo, hi];
      ``grad_error(g, s, b, h, q_idx, kv_idx, aux)``: a bound on |fl32(grad)(g, s) - g f'(s)|;
      ``curvature(lo, hi, b, h, q_idx, kv_idx, aux)``: sup |f''| over [lo, hi].
    The bounds evaluate ``value_error`` and ``grad_error`` only at the two ends of a score's
    error interval, so each must be quasi-convex in ``s`` (its largest value on an interval is at
    an end), and ``grad_error`` nondecreasing in |g|; ``slope`` and ``curvature`` are suprema
    over the whole interval by definition.
    ``forms``: the kernel forms, opaque here (``fa4.mods`` puts production's CuTe-DSL functions
    under "cute" and "cute_bwd").  ``params``: what the mod was built with (reports)."""

    name: str
    fn: Callable[..., torch.Tensor]
    grad: Callable[..., torch.Tensor] | None = None
    value_error: Callable[..., torch.Tensor] | None = None
    slope: Callable[..., torch.Tensor] | None = None
    grad_error: Callable[..., torch.Tensor] | None = None
    curvature: Callable[..., torch.Tensor] | None = None
    aux_base: int = 0
    forms: Mapping[str, Any] = field(default_factory=dict)
    params: Mapping[str, Any] = field(default_factory=dict)
    #: the mod depends on the head index (block masks and aux tensors are then per head)
    per_head: bool = True

    def __repr__(self) -> str:
        return f"ScoreMod({self.name!r})"


@dataclass(frozen=True, eq=False)
class MaskMod:
    """A mask modification ``(b, h, q_idx, kv_idx, aux) -> bool`` (True: the key is kept).
    ``fn``: the reference form over index tensors; ``forms``, ``aux_base``, ``params``,
    ``per_head`` as for :class:`ScoreMod`."""

    name: str
    fn: Callable[..., torch.Tensor]
    aux_base: int = 0
    forms: Mapping[str, Any] = field(default_factory=dict)
    params: Mapping[str, Any] = field(default_factory=dict)
    per_head: bool = False

    def __repr__(self) -> str:
        return f"MaskMod({self.name!r})"


@dataclass(frozen=True, eq=False)
class BlockSparse:
    """Block sparsity as dense block masks.  ``full`` and ``partial``: bool (B, H, nq, nk) with
    B in {1, batch} and H in {1, heads_q} (1: broadcast), nq = ceil(seqlen_q / block_q),
    nk = ceil(seqlen_k / block_k); never both True for one block.  ``block_size``:
    (block_q, block_k) in tokens.  ``mask_mod``: the mask the partial blocks apply (None: none,
    a partial block is then visited whole up to seqlen_k).  ``forms``: kernel forms, opaque."""

    full: torch.Tensor
    partial: torch.Tensor
    block_size: tuple[int, int]
    mask_mod: MaskMod | None = None
    forms: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if self.full.shape != self.partial.shape or self.full.dim() != 4:
            raise ValueError(
                f"BlockSparse: full {tuple(self.full.shape)} and partial {tuple(self.partial.shape)} "
                "must be bool tensors of one shape (B, H, n_query_blocks, n_key_blocks)"
            )
        if bool((self.full & self.partial).any()):
            raise ValueError("BlockSparse: a block is marked both full and partial; a block is one or the other")

    def __repr__(self) -> str:
        return f"BlockSparse(block_size={self.block_size}, shape={tuple(self.full.shape)})"


def index_grid(
    batch: int, heads: int, seqlen_q: int, seqlen_k: int, *, rows=None, keys=None, device="cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(b, h, q_idx, kv_idx): int64 index tensors broadcasting to (batch, heads, rows, keys);
    ``rows`` / ``keys``: these indices only (default: all)."""
    b = torch.arange(batch, device=device).view(-1, 1, 1, 1)
    h = torch.arange(heads, device=device).view(1, -1, 1, 1)
    q = (torch.arange(seqlen_q, device=device) if rows is None else torch.as_tensor(rows, device=device)).long()
    kv = (torch.arange(seqlen_k, device=device) if keys is None else torch.as_tensor(keys, device=device)).long()
    return b, h, q.view(1, 1, -1, 1), kv.view(1, 1, 1, -1)


def _expand_blocks(blocks: torch.Tensor, bq: int, bk: int, rows: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """A (B, H, nq, nk) block mask at token level for ``rows`` x ``keys``: (B, H, rows, keys)."""
    return blocks[:, :, (rows // bq).view(-1, 1), (keys // bk).view(1, -1)]


def visibility(
    *,
    batch: int,
    heads: int,
    seqlen_q: int,
    seqlen_k: int,
    mask_mod: MaskMod | None = None,
    block_sparse: BlockSparse | None = None,
    aux: list | None = None,
    rows=None,
    keys=None,
    device="cpu",
) -> torch.Tensor | None:
    """Bool, broadcastable to (batch, heads, rows, keys): where the mods keep a key (module doc);
    None when neither a mask_mod nor block sparsity is given (everything kept).  The flag masks
    (causal, window) and seqlen_k are the caller's to intersect."""
    if mask_mod is None and block_sparse is None:
        return None
    dev = torch.device(device)
    b, h, q, kv = index_grid(batch, heads, seqlen_q, seqlen_k, rows=rows, keys=keys, device=dev)
    mm = mask_mod if mask_mod is not None else (block_sparse.mask_mod if block_sparse is not None else None)
    kept = None if mm is None else mm.fn(b, h, q, kv, aux).to(torch.bool)
    if block_sparse is None:
        return kept
    bq, bk = block_sparse.block_size
    full = _expand_blocks(block_sparse.full.to(dev), bq, bk, q.view(-1), kv.view(-1))
    part = _expand_blocks(block_sparse.partial.to(dev), bq, bk, q.view(-1), kv.view(-1))
    return full | (part & kept) if kept is not None else full | part


def block_sparse_from_mask(
    mask_mod: MaskMod,
    *,
    batch: int,
    heads: int,
    seqlen_q: int,
    seqlen_k: int,
    block_size: tuple[int, int],
    aux: list | None = None,
    device="cpu",
) -> BlockSparse:
    """The block masks of ``mask_mod`` (what production's ``compute_block_sparsity`` and flex's
    ``create_block_mask`` compute): a block is *full* when the mask keeps every (query, key) of
    it inside the sequence, *partial* when it keeps some, skipped when none.  A block cut by
    seqlen_q / seqlen_k is judged on its in-range part.  Per head only when ``mask_mod.per_head``."""
    bq, bk = block_size
    if bq <= 0 or bk <= 0:
        raise ValueError(f"block_size must be two positive ints, got {block_size}")
    nq, nk = math.ceil(seqlen_q / bq), math.ceil(seqlen_k / bk)
    hh = heads if mask_mod.per_head else 1
    b, h, q, kv = index_grid(batch, hh, seqlen_q, seqlen_k, device=device)
    kept = mask_mod.fn(b, h, q, kv, aux).to(torch.bool).expand(batch, hh, seqlen_q, seqlen_k)
    pad = (0, nk * bk - seqlen_k, 0, nq * bq - seqlen_q)
    inside = torch.nn.functional.pad(torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device), pad)
    kept = torch.nn.functional.pad(kept, pad)
    blk = lambda t: t.reshape(*t.shape[:-2], nq, bq, nk, bk)
    n_kept = blk(kept).sum(dim=(-3, -1))
    n_inside = blk(inside).sum(dim=(-3, -1))
    full = n_kept == n_inside
    partial = (n_kept > 0) & ~full
    return BlockSparse(full=full, partial=partial, block_size=(bq, bk), mask_mod=mask_mod)
