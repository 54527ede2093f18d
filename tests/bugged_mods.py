"""Seeded mod bugs (``docs/mods.md``): kernels built on the model (``fa4.model.attention`` and its
backward ``fa4.model_bwd.attention_backward``), each with ONE bug of the programmable surface,
the field's recent FA4 bugs in kind.  tests/test_mod_catalogue.py runs the audit on smoke's mod
cases (``audits.suites.cases.smoke_mods``) and asserts each is caught with the reason it should cause,
and that :func:`clean` passes the same cases.

Every kernel takes the kernel contract's keywords (the mods as ``numerics.mods`` objects) and
declares the mod kinds (``fa4_audit_domain``: ``mods``), so smoke's mod cases run on it.  The
forward is the model's; the backward is ``attention_backward`` on the saved inputs, the forward's
out and LSE (as ``interface.FlashAttnFunc`` saves them), through :class:`_Seeded` — so a bug of
the backward changes the gradients only, never the forward the audit compares first.  The
numerics record is generic flash-attention numerics (:func:`_numerics`), passed to both: the
audit judges a file kernel as a peer, against the bound of those numerics.
"""

from __future__ import annotations

import dataclasses

import torch

from audits.suites.cases import MOD_KINDS
from fa4.model import FA4Numerics, attention
from fa4.model_bwd import attention_backward
from numerics.mods import BlockSparse

__all__ = ["BUGS", "clean"]

#: the seeded mod bugs, each with the field issue it reproduces (the kernel ``bug_<name>``'s docstring)
BUGS = {
    "mask_ignored_in_bwd": (
        "the backward runs without the mask_mod and the block-sparse tensors: gradients of the unmasked "
        "attention (the autograd wrappers dropping mask_mod / block-sparse tensors in backward, flash-attention #2424)"
    ),
    "partial_block_as_full": (
        "one partial block treated as full: its keys the mask_mod hides are attended, forward and backward "
        "(a partial/full block-list mix-up leaks masked keys)"
    ),
    "score_mod_bwd_wrong": (
        "score_mod_bwd returns twice the derivative: dS, hence dQ and dK, scaled wrongly where the mod applies "
        "(a wrong score_mod derivative, cf. the softcap score_mod computing s tanh(s), flash-attention #2396)"
    ),
    "aux_wrong_head": (
        "the score_mod's aux tensor read at head h + 1 (mod heads): every head gets its neighbour's bias or "
        "slope (an aux tensor indexed by the wrong head)"
    ),
    "bs_bwd_drops_dq_block": (
        "the block-sparse backward drops one visited block's dQ contribution (dK and dV right): dQ off with no "
        "NaN (the SM90 block-sparse backward's dQ 150-700x off, flash-attention #2623)"
    ),
}

_DOMAIN = {"mods": list(MOD_KINDS)}


def _numerics(q: torch.Tensor) -> FA4Numerics:
    """Generic flash-attention numerics, the ones the audit holds a kernel it knows nothing about
    to (the peer bound: ``audits.engine.evaluate``'s peer numerics, thresholds ``peer_bound``):
    float32 softmax, hardware-class exp2, no lazy rescaling, P rounded to the input dtype, 128 x
    128 tiles (which every suite block, (128, 128) and (256, 128), fits).  With the model's own
    SM100 numerics a kernel is no peer: its LSE on smoke's causal ``flat`` case errs 1.8x the
    peer bound with or without mods (measured), while ``fa4-model`` meets its own bound there."""
    return FA4Numerics(
        arch="sm90", tile_m=128, tile_n=128, exp2="hardware", rescale_threshold=0.0, max_offset=0, p_dtype=q.dtype
    )


def _model_bwd(q, k, v, out, lse, dout, nm, kw):
    dq, dk, dv, _ = attention_backward(q, k, v, out, lse, dout, numerics=nm, **kw)
    return dq, dk, dv


class _Seeded(torch.autograd.Function):
    """The model's forward with ``fwd_kw``; the backward ``bwd(q, k, v, out, lse, dout, nm,
    fwd_kw) -> (dq, dk, dv)`` on the saved out and LSE (no learnable sink: smoke's mod cases
    have none)."""

    @staticmethod
    def forward(ctx, q, k, v, nm, fwd_kw, bwd):
        out, lse = attention(q, k, v, return_lse=True, numerics=nm, **fwd_kw)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.nm, ctx.kw, ctx.bwd = nm, fwd_kw, bwd
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        return (*ctx.bwd(q, k, v, out, lse, dout, ctx.nm, ctx.kw), None, None, None)


def _kernel(bwd=None, fwd_kw=None):
    """A contract kernel: the model forward with ``fwd_kw(q, kw)`` (default: the call's kw) and the
    backward ``bwd`` (default: the model's)."""

    def run(q, k, v, *, return_lse: bool = False, **kw):
        if kw.get("learnable_sink") is not None:
            raise NotImplementedError("the seeded mod kernels take no learnable sink (smoke's mod cases have none)")
        kw = fwd_kw(q, kw) if fwd_kw is not None else kw
        nm = _numerics(q)
        out, lse = _Seeded.apply(q, k, v, nm, kw, bwd or _model_bwd)
        return (out, lse) if return_lse else out

    run.fa4_audit_domain = _DOMAIN
    return run


clean = _kernel()
clean.__doc__ = "The model, forward and backward, with the call's mods (no bug)."


def _without_mask_bwd(q, k, v, out, lse, dout, nm, kw):
    kw = {n: x for n, x in kw.items() if n not in ("mask_mod", "block_sparse_tensors")}
    return _model_bwd(q, k, v, out, lse, dout, nm, kw)


def _first_block(mask: torch.Tensor) -> tuple | None:
    """The first True block (batch, head, query block, key block) of a (B, H, nq, nk) mask, or None."""
    hits = mask.nonzero()
    return None if hits.numel() == 0 else tuple(int(x) for x in hits[0])


def _partial_as_full(q, kw):
    bs = kw.get("block_sparse_tensors")
    at = None if bs is None else _first_block(bs.partial)
    if at is None:  # nothing partial to mistake: the bug has nothing to act on
        return kw
    full, partial = bs.full.clone(), bs.partial.clone()
    full[at], partial[at] = True, False
    return {**kw, "block_sparse_tensors": dataclasses.replace(bs, full=full, partial=partial)}


# The seeded score mods carry no kernel forms (``forms={}``): the model evaluates a library mod
# through its model forms when it has them (``forms["model"]`` / ``["model_bwd"]``, fa4.mod_forms:
# production's contracted arithmetic), which would bypass the wrong ``fn`` / ``grad`` seeded here.


def _doubled_grad(q, kw):
    mod = kw.get("score_mod")
    if mod is None or mod.grad is None:
        return kw
    right = mod.grad
    wrong = dataclasses.replace(mod, grad=lambda g, *a, **k: 2.0 * right(g, *a, **k), forms={})
    return {**kw, "score_mod": wrong}


def _neighbour_head(q, kw):
    mod = kw.get("score_mod")
    if mod is None:
        return kw
    heads, right = q.shape[2], mod.fn
    wrong = dataclasses.replace(
        mod, fn=lambda s, b, h, *a, **k: right(s, b, (h + 1) % heads, *a, **k), forms={}
    )  # runtime scalars pass through
    return {**kw, "score_mod": wrong}


def _visited_block(bs: BlockSparse) -> tuple | None:
    """A visited block whose query block visits another one too (so dQ of those rows keeps a
    contribution and is not merely zero): the first full one, else the first partial one."""
    seen = bs.full | bs.partial
    several = seen.sum(-1, keepdim=True) >= 2
    return _first_block(bs.full & several) or _first_block(bs.partial & several)


def _drop_dq_block_bwd(q, k, v, out, lse, dout, nm, kw):
    dq, dk, dv = _model_bwd(q, k, v, out, lse, dout, nm, kw)
    bs = kw.get("block_sparse_tensors")
    at = None if bs is None else _visited_block(bs)
    if at is None:
        return dq, dk, dv
    full, partial = bs.full.clone(), bs.partial.clone()
    full[at], partial[at] = False, False
    less = {**kw, "block_sparse_tensors": dataclasses.replace(bs, full=full, partial=partial)}
    dq_less, _, _ = _model_bwd(q, k, v, out, lse, dout, nm, less)  # the same saved out and LSE: D unchanged
    return dq_less, dk, dv


bug_mask_ignored_in_bwd = _kernel(bwd=_without_mask_bwd)
bug_partial_block_as_full = _kernel(fwd_kw=_partial_as_full)
bug_score_mod_bwd_wrong = _kernel(fwd_kw=_doubled_grad)
bug_aux_wrong_head = _kernel(fwd_kw=_neighbour_head)
bug_bs_bwd_drops_dq_block = _kernel(bwd=_drop_dq_block_bwd)
for _name, _doc in BUGS.items():
    globals()[f"bug_{_name}"].__doc__ = _doc
