"""Score and mask modifications (FA4's ``score_mod`` / ``mask_mod``, flex_attention's) as numbers.

A *mod* is one mathematical function with several forms.  This module holds the **reference
form**: torch operations over broadcast index tensors, dtype-polymorphic, so that one function
is evaluated in float64 by the FP64 reference (``numerics.reference``) and in float32, in
production's order of operations, by the model (``fa4.model``).  The kernel forms (production's
CuTe-DSL function and its ``score_mod_bwd``) are opaque here: they ride in ``forms`` untouched
and are attached by ``fa4.mods``.  numerics imports nothing of ``fa4`` and holds none of its
tables: what a form means is ``fa4``'s business.

Semantics (production's, ``flash_attn/cute/softmax.py`` ``apply_score_mod_inner``, and
flex_attention's): the score a mod sees is ``s = softmax_scale * (q . k)`` (the scale is applied
*before* the mod: ``utils.compute_softmax_scale_log2`` keeps it apart when a score_mod is given),
and the softmax runs on ``f(s)``; a mask_mod returns True where the key is kept; a masked score
is -inf after the score_mod.  Index arguments are logical positions within the sequence:
``b`` batch, ``h`` the *query* head, ``q_idx`` the query row, ``kv_idx`` the key.

Index tensors (:func:`index_grid`) broadcast as (b, 1, 1, 1), (1, h, 1, 1), (1, 1, i, 1),
(1, 1, 1, j), int64.  Runtime scalars (production's ``aux_scalars``): :func:`bind_aux_scalars`
hands a call's scalars to every form and hook of its mods as the keyword ``aux_scalars=``, only
when the call has some (production's compatibility shim).  A reference form must be written
with tensor operations only (indexing an aux tensor with index tensors, ``torch.where``, no
Python branching on values) so that it also runs elementwise under flex_attention's vmap.

Block sparsity (production's ``BlockSparseTensorsTorch``, flex's ``BlockMask``) is held here as
dense block masks (:class:`BlockSparse`): per (batch, head, query block, key block), *full*
(visited, the mask_mod not applied) or *partial* (visited, the mask_mod applied); a block in
neither is skipped.  A key is visible to a query when its block is full, or partial and the
mask_mod keeps it (:func:`visibility`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

__all__ = [
    "ScoreMod",
    "MaskMod",
    "BlockSparse",
    "index_grid",
    "visibility",
    "block_sparse_from_mask",
    "at_sequence",
    "shift_batch_arg",
    "check_aux_scalars",
    "bind_aux_scalars",
]


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


def shift_batch_arg(f: Callable | None, pos: int, index: int) -> Callable | None:
    """``f`` with its positional argument ``pos`` (a batch index tensor) offset by ``index``:
    the call ``f(..., b, ...)`` becomes ``f(..., b + index, ...)``, keywords (``aux_scalars=``)
    passed on.  None stays None."""
    if f is None or index == 0:
        return f

    def shifted(*args, **kw):
        args = list(args)
        args[pos] = args[pos] + index
        return f(*args, **kw)

    return shifted


def at_sequence(mod, index: int, *, forms: Mapping[str, Any] | None = None):
    """``mod`` as sequence ``index`` of a varlen call sees it, for a batch-1 evaluation of that
    sequence alone (``fa4.varlen``, the varlen references and bounds).  Production's varlen
    entry hands a mod the *sequence* index as ``batch_idx`` and positions *within the sequence*
    as ``q_idx`` / ``kv_idx`` (``flash_fwd_sm90.py`` / ``flash_fwd_sm100.py``: the tile scheduler's
    ``batch_idx`` is the sequence, ``SeqlenInfoQK`` offsets the tensors to it, and with aux
    tensors ``softmax.py`` ``apply_score_mod_inner`` / ``mask.py`` wrap the indices by the
    sequence's own lengths, ``FastDivmodDivisorV2(seqlen.seqlen_q)``).  A batch-1 evaluation
    gives ``b = 0``; this copy adds ``index`` to ``b`` in ``fn``, ``grad`` and every bound hook,
    so it reads the sequence's rows of per-batch aux tensors.  ``forms``: the copy's kernel
    forms (opaque here: whoever knows their signatures shifts them; default: none, since a kernel
    form would still read ``b = 0``)."""
    if isinstance(mod, ScoreMod):
        hooks = {n: shift_batch_arg(getattr(mod, n), 2, index) for n in ("slope", "grad_error", "curvature")}
        return replace(
            mod,
            fn=shift_batch_arg(mod.fn, 1, index),
            grad=shift_batch_arg(mod.grad, 2, index),
            value_error=shift_batch_arg(mod.value_error, 1, index),
            forms=dict(forms or {}),
            **hooks,
        )
    if isinstance(mod, MaskMod):
        return replace(mod, fn=shift_batch_arg(mod.fn, 0, index), forms=dict(forms or {}))
    raise TypeError(f"at_sequence takes a ScoreMod or MaskMod, got {type(mod).__name__}")


def check_aux_scalars(aux_scalars, *, where: str = "aux_scalars") -> tuple | None:
    """The call's ``aux_scalars`` as production normalises them (``interface._flash_attn_fwd``:
    ``tuple(aux_scalars) if aux_scalars else None``, so an empty sequence is None), checked: a
    sequence of Python ints or floats (bools are ints).  Production's compile key holds only their
    types (``aux_scalar_metadata``); the CuTe DSL hands each to the kernel as a runtime value, a
    float as Float32 and an int as Int32 (``cutlass.base_dsl.runtime.jit_arg_adapters``
    ``_PYTHON_SCALAR_CONVERSION_MAP``), so a new value of the same type does not recompile."""
    if aux_scalars is None:
        return None
    if isinstance(aux_scalars, (str, bytes, torch.Tensor)) or not hasattr(aux_scalars, "__iter__"):
        raise TypeError(f"{where} must be a tuple of Python ints / floats (or None), got {type(aux_scalars).__name__}")
    out = tuple(aux_scalars)
    for i, x in enumerate(out):
        if not isinstance(x, (int, float)):
            raise TypeError(
                f"{where}[{i}] is {type(x).__name__} ({x!r}); accepted: a Python int or float (production's DSL "
                "passes an int as Int32 and a float as Float32)"
            )
    return out or None


def _with_scalars(f: Callable | None, scalars: tuple) -> Callable | None:
    """``f`` called with the keyword ``aux_scalars=scalars`` added (None stays None)."""
    if f is None:
        return None

    def bound(*args, **kw):
        return f(*args, **kw, aux_scalars=scalars)

    bound.__wrapped__ = f
    return bound


class _ScalarForms(Mapping):
    """A mod's ``forms`` with the entries named in ``keys`` called with ``aux_scalars=``; the
    others (the kernel forms: the kernel hands them the scalars itself) untouched.  Membership
    and iteration never build a form (``fa4.mods.LazyForms``)."""

    def __init__(self, base: Mapping, scalars: tuple, keys: tuple):
        self._base, self._scalars, self._keys = base, scalars, tuple(keys)

    def __getitem__(self, key):
        f = self._base[key]
        return _with_scalars(f, self._scalars) if key in self._keys else f

    def get(self, key, default=None):
        return self[key] if key in self._base else default

    def __contains__(self, key) -> bool:
        return key in self._base

    def __iter__(self):
        return iter(self._base)

    def __len__(self) -> int:
        return len(self._base)


_SCORE_CALLABLES = ("fn", "grad", "value_error", "slope", "grad_error", "curvature")


def bind_aux_scalars(
    aux_scalars,
    *,
    score_mod: ScoreMod | None = None,
    mask_mod: MaskMod | None = None,
    block_sparse: BlockSparse | None = None,
    form_keys: tuple = (),
) -> tuple[ScoreMod | None, MaskMod | None, BlockSparse | None]:
    """(score_mod, mask_mod, block_sparse) with the call's ``aux_scalars`` bound: each reference
    form and bound hook (and each form named in ``form_keys``: the model's) is then called with
    the keyword ``aux_scalars=`` after its usual arguments, but only when the call has scalars.
    Without them (None or empty) the mods come back as they are, so a mod written without an
    ``aux_scalars`` parameter keeps working: production's compatibility shim (``softmax.py``
    ``call_score_mod`` / ``call_score_mod_bwd`` pass ``aux_scalars=`` only when
    ``aux_data.scalars is not None``; ``mask.py`` ``call_mask_mod`` likewise, as a 7th positional
    argument).  The contract's entry points (references, bounds, models, the flex peer) call this
    once; what they call inside sees plain mods.  The mask mod of ``block_sparse`` is bound too
    (one object with ``mask_mod`` when it was one)."""
    scalars = check_aux_scalars(aux_scalars)
    if scalars is None:
        return score_mod, mask_mod, block_sparse

    def mask(m):
        if m is None:
            return None
        return replace(m, fn=_with_scalars(m.fn, scalars), forms=_ScalarForms(m.forms, scalars, form_keys))

    if score_mod is not None:
        hooks = {k: _with_scalars(getattr(score_mod, k), scalars) for k in _SCORE_CALLABLES}
        score_mod = replace(score_mod, **hooks, forms=_ScalarForms(score_mod.forms, scalars, form_keys))
    inner = block_sparse.mask_mod if block_sparse is not None else None
    bound_mask = mask(mask_mod)
    if inner is not None:
        block_sparse = replace(block_sparse, mask_mod=bound_mask if inner is mask_mod else mask(inner))
    return score_mod, bound_mask, block_sparse
