"""The attention call's visibility and scoring keywords as one record: :class:`AttentionCall`.

The audited callable takes ``softmax_scale``, ``causal``, ``window_size``, ``softcap``,
``learnable_sink`` and the mods (``score_mod``, ``mask_mod``, ``aux_tensors``,
``block_sparse_tensors``, ``aux_scalars``) as keywords (the signature of
``flash_attn.cute.flash_attn_func``; their semantics in the docstring of
``numerics.reference``).  Kernels keep that keyword API; the references and bounds of
``numerics`` take the bundle as one ``call: AttentionCall``, checked once here:

* softcap and a score_mod are exclusive, as production asserts (``flash_attn/cute/interface.py``
  ``_flash_attn_fwd``: "softcap and score_mod cannot be used together"; the softcap flag *is* a
  score_mod there, ``utils.create_softcap_scoremod``);
* ``window_size`` is a (left, right) pair, None meaning unbounded on that side;
* the mods are ``numerics.mods`` objects and ``aux_tensors`` a list (or tuple) of tensors
  (production hands every mod the whole list);
* ``aux_scalars`` are normalised as production does (``numerics.mods.check_aux_scalars``: a
  tuple of Python ints / floats, an empty one is None).

:meth:`AttentionCall.from_kwargs` reads a kernel's keyword dict, :meth:`AttentionCall.kernel_kwargs`
gives it back, and :meth:`AttentionCall.bind_scalars` hands the runtime scalars to the mods
(``numerics.mods.bind_aux_scalars``, production's shim) once per entry point.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import torch

from numerics.mods import BlockSparse, MaskMod, ScoreMod, bind_aux_scalars, check_aux_scalars

__all__ = ["AttentionCall", "effective_window"]


def effective_window(*, causal: bool, window_size) -> tuple[int | None, int | None]:
    """The (left, right) window a call keeps (``numerics.reference`` module doc): ``causal`` caps
    ``right`` at 0; None = unbounded on that side."""
    left, right = (None, None) if window_size is None else tuple(window_size)
    if causal:
        right = 0 if right is None else min(right, 0)
    return left, right


#: the keywords of the audited callable the record holds, in the contract's order
_NAMES = (
    "softmax_scale",
    "causal",
    "window_size",
    "softcap",
    "learnable_sink",
    "score_mod",
    "mask_mod",
    "aux_tensors",
    "block_sparse_tensors",
    "aux_scalars",
)
#: the keywords every kernel of the contract takes (README, "Audit your kernel"); the mods are
#: handed only to a kernel whose domain declares them, so kernel_kwargs gives them only when set
_BASE = ("softmax_scale", "causal", "window_size", "softcap", "learnable_sink")


@dataclass(frozen=True, eq=False)
class AttentionCall:
    """What one attention call computes besides its q, k, v: the score scale (None: 1/sqrt(d)),
    the flag masks (causal, a (left, right) window), the softcap (0: none), the learnable sink
    ((heads_q,) logits), and the mods (``numerics.mods``).  Frozen; compared by identity (it
    holds tensors)."""

    softmax_scale: float | None = None
    causal: bool = False
    window_size: tuple[int | None, int | None] = (None, None)
    softcap: float = 0.0
    learnable_sink: torch.Tensor | None = None
    score_mod: ScoreMod | None = None
    mask_mod: MaskMod | None = None
    aux_tensors: list | None = None
    block_sparse_tensors: BlockSparse | None = None
    aux_scalars: tuple | None = None

    def __post_init__(self):
        window = (None, None) if self.window_size is None else tuple(self.window_size)
        if len(window) != 2:
            raise ValueError(
                f"window_size must be a (left, right) pair (None = unbounded on that side), got {self.window_size!r}"
            )
        object.__setattr__(self, "window_size", window)
        object.__setattr__(self, "softcap", float(self.softcap or 0.0))
        object.__setattr__(self, "aux_scalars", check_aux_scalars(self.aux_scalars))
        for name, kind in (("score_mod", ScoreMod), ("mask_mod", MaskMod), ("block_sparse_tensors", BlockSparse)):
            x = getattr(self, name)
            if x is not None and not isinstance(x, kind):
                raise TypeError(f"{name} must be a numerics.mods.{kind.__name__}, got {type(x).__name__}")
        aux = self.aux_tensors
        if aux is not None and not (isinstance(aux, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in aux)):
            raise TypeError(
                "aux_tensors must be a list of tensors (production hands every mod the whole list), got "
                f"{type(aux).__name__}"
                + (f" of {sorted({type(t).__name__ for t in aux})}" if isinstance(aux, (list, tuple)) else "")
            )
        if self.score_mod is not None and self.softcap > 0:
            raise ValueError(
                "softcap and score_mod are exclusive (production asserts it; softcap is itself a score_mod): got "
                f"softcap={self.softcap!r} and score_mod={self.score_mod!r}; give one of them"
            )

    @classmethod
    def from_kwargs(cls, **kw) -> AttentionCall:
        """The record of a kernel's keywords (``fn(q, k, v, **kw)``); a keyword outside the bundle
        (``return_lse``, the varlen ones...) is refused with a TypeError naming it, so a caller
        holding a wider dict picks the bundle's keys first."""
        unknown = sorted(set(kw) - set(_NAMES))
        if unknown:
            raise TypeError(f"AttentionCall.from_kwargs got {', '.join(unknown)}; accepted: {', '.join(_NAMES)}")
        return cls(**kw)

    def kernel_kwargs(self) -> dict:
        """The keywords the kernel contract takes for this call: ``softmax_scale``, ``causal``,
        ``window_size``, ``softcap``, ``learnable_sink`` always, the mods and ``aux_scalars`` only
        when the call has them (a kernel without mods is never handed their keywords)."""
        return {
            f.name: getattr(self, f.name) for f in fields(self) if f.name in _BASE or getattr(self, f.name) is not None
        }

    def bind_scalars(self) -> AttentionCall:
        """This call with its ``aux_scalars`` handed to its mods (``numerics.mods.bind_aux_scalars``)
        and ``aux_scalars`` None; the call itself when it has none.  An entry point of
        ``numerics`` binds once, and what it calls inside sees plain mods (binding again is a no-op)."""
        if self.aux_scalars is None:
            return self
        sm, mm, bs = bind_aux_scalars(
            self.aux_scalars, score_mod=self.score_mod, mask_mod=self.mask_mod, block_sparse=self.block_sparse_tensors
        )
        return replace(self, score_mod=sm, mask_mod=mm, block_sparse_tensors=bs, aux_scalars=None)

    def scale(self, d: int) -> float:
        """The score scale for head dim ``d``: ``softmax_scale``, or 1/sqrt(d) when None."""
        return 1.0 / math.sqrt(d) if self.softmax_scale is None else float(self.softmax_scale)

    def effective_window(self) -> tuple[int | None, int | None]:
        """(left, right) with ``causal`` applied (:func:`effective_window`)."""
        return effective_window(causal=self.causal, window_size=self.window_size)

    @property
    def has_mask_mods(self) -> bool:
        """Whether visibility depends on more than the flags (a mask_mod or block sparsity)."""
        return self.mask_mod is not None or self.block_sparse_tensors is not None
