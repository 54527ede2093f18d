"""The library mods (``numerics.mod_library``) with their kernel forms, and the conversion of a
call's mods into production FA4's keyword arguments.

:func:`build_mods` turns a case's mod names into the call's extra keywords (the kernel contract,
docs/design.md): ``score_mod`` (:class:`numerics.mods.ScoreMod`), ``mask_mod``
(:class:`numerics.mods.MaskMod`), ``aux_tensors`` (one list: the score mod's aux tensors from
index 0, the mask mod's after them) and ``block_sparse_tensors`` (:class:`numerics.mods.BlockSparse`,
the block masks of the mask mod).  Each mod carries its production forms in ``forms``:
``forms["cute"]`` (and, for score mods, ``forms["cute_bwd"]``), CuTe-DSL functions with
production's parameter names, built on first access (:class:`LazyForms`: building a case's mods
never imports the CuTe DSL, so it works without a GPU).

How production calls them (flash-attn-4 4.0.0b36):

* a score mod, ``softmax.py`` ``call_score_mod``: ``score_mod(acc_S_SSA, batch_idx, head_idx,
  q_idx=, kv_idx=, seqlen_info=, aux_tensors=)`` (the last four by keyword, so the names are
  production's), on ``s = softmax_scale * (q . k)`` (``apply_score_mod_inner`` multiplies by the
  scale first; ``utils.compute_softmax_scale_log2`` keeps it apart when a score mod is given),
  every argument a TensorSSA of ``vec_size`` lanes: 1 whenever the call has aux tensors
  (``flash_fwd.py`` ``score_vec_size``; ``flash_bwd_sm90.py`` / ``flash_bwd_sm100.py``
  ``vec_size``), which every aux-reading form here relies on (it loads one element);
* its backward, ``call_score_mod_bwd``: ``score_mod_bwd(grad_out_SSA, score_SSA, batch_idx,
  head_idx, q_idx=, kv_idx=, seqlen_info=, aux_tensors=)`` returns ``grad * f'(score)`` at the
  pre-mod score (``apply_score_mod_bwd_inner``);
* a mask mod, ``mask.py`` ``call_mask_mod``: ``mask_mod(batch_idx, head_idx, q_idx, kv_idx,
  seqlen_info, aux_tensors)`` positionally, one lane on SM90 (``flash_fwd.py`` refuses a
  ``__vec_size__`` > 1), returning a Boolean TensorSSA (True: the key is kept);
* the call's ``aux_scalars`` (``interface._flash_attn_fwd``: ``AuxData(aux_tensors, aux_scalars)``)
  reach a form only when the call has some (the compatibility shims of ``call_score_mod``,
  ``call_score_mod_bwd``: the keyword ``aux_scalars=``; of ``call_mask_mod``: a 7th positional
  argument), each a runtime DSL value: a Python float as Float32, an int as Int32
  (``cutlass.base_dsl.runtime.jit_arg_adapters._PYTHON_SCALAR_CONVERSION_MAP``; the compile key
  holds only their types, ``aux_scalar_metadata``).  :func:`build_mods` puts a library mod's
  scalars (``params["aux_scalars"]``) into the call's ``aux_scalars``.  Production hands them to
  every mod of the call, so every library form here takes ``aux_scalars=None`` (production's own
  softcap score mod, ``utils.create_softcap_scoremod``, does not: ``softcap=`` beside a mask mod
  reading scalars cannot compile).

The aux-tensor reads follow production's own test mods (flash-attention ``tests/cute``
``score_mod_definitions.py``: an index stored into a one-element register fragment, the element
read through it; ``mask_mod_definitions.py``: ``aux[batch[0], idx[0]]`` wrapped back by
``utils.scalar_to_ssa``).  Each form does the float32 operations of the reference form
(``numerics.mod_library``) in the same order; what the compiler may do beyond that is said per mod.
Constants (offsets, the window, the cap, aux indices) are closure values: production's compile
cache hashes a mod by its source and its closure (``utils.hash_callable``), so two mods of one
source and equal constants share a compiled kernel and different constants never collide.

:func:`production_kwargs` converts a call's keywords for ``flash_attn.cute.flash_attn_func``:
the mods to their forms (``score_mod_bwd`` added), the :class:`numerics.mods.BlockSparse` to
production's ``block_sparsity.BlockSparseTensorsTorch``, forward (per query block, the key
blocks) and backward (``block_sparse_tensors_bwd``: per key block, the query blocks, the
"Q-direction" ``normalize_block_sparse_config_bwd`` expects), each list ascending and packed to the
left, zeros after the count, as production's ``compute_block_sparsity`` writes them
(:func:`block_sparse_index_lists`).
"""

# No `from __future__ import annotations` here: the CuTe DSL reads the forms' source and
# evaluates annotations in the defining scope (as in fa4/production.py).
import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping

import torch

from fa4.mod_forms import forms_of
from numerics.mod_library import RELBIAS_SPAN, make_mask_mod, make_score_mod
from numerics.mods import BlockSparse, MaskMod, ScoreMod, block_sparse_from_mask, check_aux_scalars

__all__ = [
    "LazyForms",
    "build_mods",
    "attach_forms",
    "production_kwargs",
    "block_sparse_index_lists",
    "production_block_sparse",
    "SCORE_FORMS",
    "MASK_FORMS",
    "dsl_scalars",
]


class LazyForms(Mapping):
    """The kernel forms of a mod, each built by its factory on first access and kept.  Keys are
    known without building anything, so ``"cute" in mod.forms`` never imports the CuTe DSL."""

    def __init__(self, factories: Mapping[str, Callable[[], object]]):
        self._factories = dict(factories)
        self._built: dict[str, object] = {}

    def __getitem__(self, key: str):
        if key not in self._built:
            self._built[key] = self._factories[key]()  # KeyError for an unknown form
        return self._built[key]

    def __contains__(self, key) -> bool:  # Mapping's default would build the form (and import the DSL)
        return key in self._factories

    def __iter__(self) -> Iterator[str]:
        return iter(self._factories)

    def __len__(self) -> int:
        return len(self._factories)

    def __repr__(self) -> str:
        return f"LazyForms({sorted(self._factories)})"


def _dsl():
    """(cutlass, cute, flash_attn.cute.utils), or ImportError saying what is missing.  (The
    production adapter, ``fa4.production.flash_attn``, checks for the package and enables its
    compile cache before it builds a form; fa4.production imports this module, not the reverse.)"""
    try:
        import cutlass
        import cutlass.cute as cute
        from flash_attn.cute import utils as fa_utils
    except ImportError as exc:
        raise ImportError(
            f"the CuTe-DSL forms of the mods need the production package flash-attn-4 and the CuTe DSL ({exc}); "
            "install them with: pip install 'fa4-audit[gpu]'"
        ) from exc
    return cutlass, cute, fa_utils


# ---- score mods -------------------------------------------------------------------------------


@functools.cache
def _identity_bwd():
    """``score_mod_bwd`` of an additive bias ``s + c(b, h, q, kv)``: d/ds = 1, so the gradient
    passes through unchanged (the reference form ``g * 1`` is exact)."""
    _, cute, _ = _dsl()

    @cute.jit
    def additive_bias_score_mod_bwd(
        grad_out_SSA, score_SSA, batch_idx, head_idx, q_idx, kv_idx, seqlen_info, aux_tensors, aux_scalars=None
    ):
        return grad_out_SSA

    return additive_bias_score_mod_bwd


@functools.cache
def _alibi_form(slopes_index: int):
    """ALiBi, ``s + slope[h] * float(kv - q)``: the slope read from aux tensor ``slopes_index``
    (float32), the distance converted exactly (|kv - q| < 2**24), then FMUL and FADD as the
    reference form rounds them.  The compiler may contract the two into one FFMA; with the
    library's slopes ``2**(-8 (h + 1) / heads)`` at heads 1, 2, 4 or 8 the slope is a power of
    two and the product exact, so contracted or not the result is the same bits."""
    cutlass, cute, _ = _dsl()

    @cute.jit
    def alibi_score_mod(acc_S_SSA, batch_idx, head_idx, q_idx, kv_idx, seqlen_info, aux_tensors, aux_scalars=None):
        slopes = aux_tensors[slopes_index]
        h_frag = cute.make_rmem_tensor(1, cutlass.Int32)
        h_frag.store(head_idx)
        slope_frag = cute.make_rmem_tensor(1, slopes.element_type)
        slope_frag[0] = slopes[h_frag[0]]
        slope = slope_frag.load().to(cutlass.Float32)
        dist = (kv_idx - q_idx).to(cutlass.Float32)
        return acc_S_SSA + slope * dist

    return alibi_score_mod


@functools.cache
def _relbias_form(table_index: int, buckets_index: int, span: int):
    """T5-style relative bias, ``s + table[h, buckets[kv - q + span]]``: two exact reads (the
    bucket, int32; the table value, float32) and one FADD, the reference form's one rounding."""
    cutlass, cute, _ = _dsl()

    @cute.jit
    def relbias_score_mod(acc_S_SSA, batch_idx, head_idx, q_idx, kv_idx, seqlen_info, aux_tensors, aux_scalars=None):
        table = aux_tensors[table_index]
        buckets = aux_tensors[buckets_index]
        rel = kv_idx - q_idx + cute.full_like(q_idx, span)
        rel_frag = cute.make_rmem_tensor(1, cutlass.Int32)
        rel_frag.store(rel)
        h_frag = cute.make_rmem_tensor(1, cutlass.Int32)
        h_frag.store(head_idx)
        bucket_frag = cute.make_rmem_tensor(1, cutlass.Int32)
        bucket_frag[0] = buckets[rel_frag[0]]
        bias_frag = cute.make_rmem_tensor(1, table.element_type)
        bias_frag[0] = table[h_frag[0], bucket_frag[0]]
        return acc_S_SSA + bias_frag.load().to(cutlass.Float32)

    return relbias_score_mod


@functools.cache
def _softcap_forms(cap: float):
    """Production's own softcap score mod and its backward (``utils.create_softcap_scoremod``,
    ``create_softcap_scoremod_bwd``): the very functions ``softcap=cap`` builds inside
    ``_flash_attn_fwd`` / ``_flash_attn_bwd``, so the flag and the score_mod run the same code."""
    _, _, fa_utils = _dsl()
    return fa_utils.create_softcap_scoremod(cap), fa_utils.create_softcap_scoremod_bwd(cap)


@functools.cache
def _temperature_forms(scalar_index: int):
    """``s * aux_scalars[scalar_index]`` and its backward ``g * aux_scalars[scalar_index]``: the
    scalar arrives as a runtime value (module doc; ``cutlass.Float32(...)`` converts an Int32 one,
    exactly below 2**24, and leaves a Float32 one as it is), multiplied into every lane of the
    score (two per call in SM90's forward, four in its backward without aux tensors:
    ``flash_fwd.py`` ``score_vec_size``, ``flash_bwd_sm90.py`` ``vec_size``; a TensorSSA times a
    scalar broadcasts it); one FMUL each, which NVVM cannot contract with the scale's FMUL before
    it (``fa4.mod_forms``)."""
    cutlass, cute, _ = _dsl()

    @cute.jit
    def temperature_score_mod(acc_S_SSA, batch_idx, head_idx, q_idx, kv_idx, seqlen_info, aux_tensors, aux_scalars):
        return acc_S_SSA * cutlass.Float32(aux_scalars[scalar_index])

    @cute.jit
    def temperature_score_mod_bwd(
        grad_out_SSA, score_SSA, batch_idx, head_idx, q_idx, kv_idx, seqlen_info, aux_tensors, aux_scalars
    ):
        return grad_out_SSA * cutlass.Float32(aux_scalars[scalar_index])

    return temperature_score_mod, temperature_score_mod_bwd


def _score_factories(mod: ScoreMod) -> dict[str, Callable[[], object]]:
    a = mod.aux_base
    model = {k: (lambda f=f: f) for k, f in forms_of(mod).items()}  # fa4.mod_forms: the model's float32 forms
    if mod.name == "alibi":
        return {"cute": lambda: _alibi_form(a), "cute_bwd": _identity_bwd, **model}
    if mod.name == "relbias":
        return {"cute": lambda: _relbias_form(a, a + 1, RELBIAS_SPAN), "cute_bwd": _identity_bwd, **model}
    if mod.name == "softcap":
        cap = float(mod.params["cap"])
        return {"cute": lambda: _softcap_forms(cap)[0], "cute_bwd": lambda: _softcap_forms(cap)[1], **model}
    if mod.name == "temperature":
        i = int(mod.params["scalar_base"])
        return {"cute": lambda: _temperature_forms(i)[0], "cute_bwd": lambda: _temperature_forms(i)[1], **model}
    raise ValueError(f"no CuTe-DSL form for score mod {mod.name!r}; accepted: {', '.join(SCORE_FORMS)}")


#: the library score mods that have production forms here
SCORE_FORMS = ("alibi", "relbias", "softcap", "temperature")


# ---- mask mods --------------------------------------------------------------------------------


@functools.cache
def _causal_form(offset: int):
    """``kv <= q + offset`` (offset = seqlen_k - seqlen_q, bottom-right as FA's causal)."""
    cutlass, cute, fa_utils = _dsl()

    @cute.jit
    def causal_mask_mod(batch_idx, head_idx, q_idx, kv_idx, seqlen_info, aux_tensors, aux_scalars=None):
        off = fa_utils.scalar_to_ssa(offset, cutlass.Int32)
        return kv_idx <= q_idx + off

    return causal_mask_mod


@functools.cache
def _sliding_window_form(offset: int, window: int):
    """``(kv <= q + offset) & (kv >= q + offset - window)``."""
    cutlass, cute, fa_utils = _dsl()

    @cute.jit
    def sliding_window_mask_mod(batch_idx, head_idx, q_idx, kv_idx, seqlen_info, aux_tensors, aux_scalars=None):
        center = q_idx + fa_utils.scalar_to_ssa(offset, cutlass.Int32)
        lower = center - fa_utils.scalar_to_ssa(window, cutlass.Int32)
        return (kv_idx <= center) & (kv_idx >= lower)

    return sliding_window_mask_mod


@functools.cache
def _document_form(q_doc_index: int, kv_doc_index: int, last_q: int, last_kv: int):
    """``q_doc[b, q] == kv_doc[b, kv]``.  The indices are clamped to the sequence (``last_q`` =
    seqlen_q - 1, ``last_kv`` = seqlen_k - 1): production's SM90 ``Mask.apply_mask`` wraps a
    mask mod's indices into the sequence only on the block that masks seqlen_k
    (``wrap_aux_indices``), so the query rows past seqlen_q of a last, partial query block reach
    the mod unwrapped on the other key blocks; their results are discarded, the clamp only keeps
    the read inside the aux tensor.  In-range indices are untouched."""
    cutlass, cute, fa_utils = _dsl()

    @cute.jit
    def document_mask_mod(batch_idx, head_idx, q_idx, kv_idx, seqlen_info, aux_tensors, aux_scalars=None):
        q_doc = aux_tensors[q_doc_index]
        kv_doc = aux_tensors[kv_doc_index]
        qi = cutlass.min(q_idx[0], cutlass.Int32(last_q))
        ki = cutlass.min(kv_idx[0], cutlass.Int32(last_kv))
        q_d = fa_utils.scalar_to_ssa(q_doc[batch_idx[0], qi], cutlass.Int32)
        kv_d = fa_utils.scalar_to_ssa(kv_doc[batch_idx[0], ki], cutlass.Int32)
        return q_d == kv_d

    return document_mask_mod


@functools.cache
def _prefix_lm_form(prefix_index: int, offset: int):
    """``(kv < prefix[b]) | (kv <= q + offset)``."""
    cutlass, cute, fa_utils = _dsl()

    @cute.jit
    def prefix_lm_mask_mod(batch_idx, head_idx, q_idx, kv_idx, seqlen_info, aux_tensors, aux_scalars=None):
        prefix = aux_tensors[prefix_index]
        p = fa_utils.scalar_to_ssa(prefix[batch_idx[0]], cutlass.Int32)
        off = fa_utils.scalar_to_ssa(offset, cutlass.Int32)
        return (kv_idx < p) | (kv_idx <= q_idx + off)

    return prefix_lm_mask_mod


def _mask_factories(mod: MaskMod, *, seqlen_q: int, seqlen_k: int) -> dict[str, Callable[[], object]]:
    a, p = mod.aux_base, mod.params
    if mod.name == "causal":
        return {"cute": lambda: _causal_form(int(p["offset"]))}
    if mod.name == "sliding_window":
        return {"cute": lambda: _sliding_window_form(int(p["offset"]), int(p["window"]))}
    if mod.name == "document":
        return {"cute": lambda: _document_form(a, a + 1, max(seqlen_q - 1, 0), max(seqlen_k - 1, 0))}
    if mod.name == "prefix_lm":
        return {"cute": lambda: _prefix_lm_form(a, int(p["offset"]))}
    raise ValueError(f"no CuTe-DSL form for mask mod {mod.name!r}; accepted: {', '.join(MASK_FORMS)}")


#: the library mask mods that have production forms here
MASK_FORMS = ("causal", "sliding_window", "document", "prefix_lm")


def attach_forms(mod, *, seqlen_q: int, seqlen_k: int):
    """``mod`` (a library ScoreMod or MaskMod) with its production forms (:class:`LazyForms`)."""
    if isinstance(mod, ScoreMod):
        return dataclasses.replace(mod, forms=LazyForms(_score_factories(mod)))
    if isinstance(mod, MaskMod):
        return dataclasses.replace(mod, forms=LazyForms(_mask_factories(mod, seqlen_q=seqlen_q, seqlen_k=seqlen_k)))
    raise TypeError(f"attach_forms takes a ScoreMod or MaskMod, got {type(mod).__name__}")


def build_mods(
    *,
    score_mod: str = "",
    mask_mod: str = "",
    block_sparse: tuple = (),
    batch: int,
    heads_q: int,
    seqlen_q: int,
    seqlen_k: int,
    seed: int,
    device="cpu",
) -> dict:
    """The call's mod keywords for library mods by name (module doc): any of ``score_mod``,
    ``mask_mod``, ``aux_tensors`` (the score mod's at 0.., the mask mod's after; absent when
    neither has any), ``aux_scalars`` (the score mod's runtime scalars, ``params["aux_scalars"]``;
    absent when it has none: ``temperature``'s factor, drawn from ``seed``) and
    ``block_sparse_tensors`` (``block_sparse`` = (block_q, block_k): the mask mod's block masks,
    :func:`numerics.mods.block_sparse_from_mask`).  Empty names and () leave a keyword out; block
    sparsity needs a mask mod (its partial blocks apply it)."""
    shape = dict(batch=batch, heads_q=heads_q, seqlen_q=seqlen_q, seqlen_k=seqlen_k, seed=seed, device=device)
    kw: dict = {}
    aux: list[torch.Tensor] = []
    if score_mod:
        sm, sm_aux = make_score_mod(score_mod, aux_base=len(aux), **shape)
        aux += sm_aux
        if sm.params.get("aux_scalars"):
            kw["aux_scalars"] = tuple(sm.params["aux_scalars"])
        kw["score_mod"] = attach_forms(sm, seqlen_q=seqlen_q, seqlen_k=seqlen_k)
    mm = None
    if mask_mod:
        mm, mm_aux = make_mask_mod(mask_mod, aux_base=len(aux), **shape)
        aux += mm_aux
        mm = attach_forms(mm, seqlen_q=seqlen_q, seqlen_k=seqlen_k)
        kw["mask_mod"] = mm
    if block_sparse:
        if mm is None:
            raise ValueError(f"block_sparse={tuple(block_sparse)} needs a mask_mod: the block masks are built from it")
        bq, bk = (int(x) for x in block_sparse)
        kw["block_sparse_tensors"] = block_sparse_from_mask(
            mm,
            batch=batch,
            heads=heads_q,
            seqlen_q=seqlen_q,
            seqlen_k=seqlen_k,
            block_size=(bq, bk),
            aux=aux,
            device=device,
        )
    if aux:
        kw["aux_tensors"] = aux
    return kw


# ---- block sparsity in production's layout -------------------------------------------------------


def block_sparse_index_lists(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(count, indices) of a bool block mask (B, H, rows, cols): per (b, h, row) the number of
    True columns (int32, (B, H, rows)) and their indices ascending, packed to the left, zeros after
    the count (int32, (B, H, rows, cols)): the layout production's ``compute_block_sparsity``
    writes (``BlockSparsityKernel.kernel``: ascending ``n_block`` loop, ``torch.zeros`` buffers)
    and its kernels read (entries 0..count-1 only; the SM90 forward walks them in reverse,
    ``block_sparse_utils.load_block_list``)."""
    if blocks.dtype != torch.bool or blocks.dim() != 4:
        raise ValueError(f"blocks must be a 4-d bool tensor, got {blocks.dtype} {tuple(blocks.shape)}")
    cnt = blocks.sum(dim=-1)
    # a stable sort of ~blocks puts the True columns first, each group in ascending order
    order = torch.sort((~blocks).to(torch.int8), dim=-1, stable=True).indices
    cols = torch.arange(blocks.shape[-1], device=blocks.device)
    idx = torch.where(cols < cnt.unsqueeze(-1), order, torch.zeros_like(order))
    return cnt.to(torch.int32).contiguous(), idx.to(torch.int32).contiguous()


def production_block_sparse(bs: BlockSparse, *, device=None, deterministic: bool = False):
    """(forward, backward) ``BlockSparseTensorsTorch`` of ``bs`` on ``device`` (default: where
    ``bs`` is): forward from the (query block -> key blocks) lists of the partial (``mask_*``)
    and full (``full_*``) masks, backward from the transposed masks (key block -> query blocks),
    both with ``block_size = bs.block_size``.  With ``deterministic`` the backward also gets
    production's dQ write order (``block_sparsity.compute_dq_write_order``, ascending:
    ``spt=False``), which its deterministic block-sparse backward requires
    (``interface._flash_attn_bwd``)."""
    # lazy: the production package is optional (GPU extra)
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch, compute_dq_write_order

    dev = bs.full.device if device is None else torch.device(device)
    part, full = bs.partial.to(dev), bs.full.to(dev)
    block_size = tuple(int(x) for x in bs.block_size)
    f_mask = block_sparse_index_lists(part)
    f_full = block_sparse_index_lists(full)
    b_mask = block_sparse_index_lists(part.transpose(-1, -2))
    b_full = block_sparse_index_lists(full.transpose(-1, -2))
    fwd = BlockSparseTensorsTorch(
        mask_block_cnt=f_mask[0],
        mask_block_idx=f_mask[1],
        full_block_cnt=f_full[0],
        full_block_idx=f_full[1],
        block_size=block_size,
    )
    order = {}
    if deterministic:
        dq, dq_full = compute_dq_write_order(*f_mask, *f_full, *b_mask, *b_full, spt=False)
        order = {"dq_write_order": dq, "dq_write_order_full": dq_full, "spt": False}
    bwd = BlockSparseTensorsTorch(
        mask_block_cnt=b_mask[0],
        mask_block_idx=b_mask[1],
        full_block_cnt=b_full[0],
        full_block_idx=b_full[1],
        block_size=block_size,
        **order,
    )
    return fwd, bwd


def dsl_scalars(aux_scalars) -> tuple | None:
    """The call's ``aux_scalars`` as CuTe-DSL values: a Python float as ``cutlass.Float32``, an int
    as ``cutlass.Int32``, a bool as ``cutlass.Boolean`` (the conversion the DSL itself documents for
    a Python scalar argument, ``jit_arg_adapters._PYTHON_SCALAR_CONVERSION_MAP``); None for none
    (production's ``tuple(aux_scalars) if aux_scalars else None``).  Why: with nvidia-cutlass-dsl
    4.8.1, production's compile of a call with Python-number ``aux_scalars`` fails on SM90 and
    SM100 alike (the scalars ride inside the ``utils.AuxData`` NamedTuple, which the DSL's argument
    adapters do not enter, "Argument aux_data ... cannot be converted to a JitArgument"; the
    kernel's flattened arguments then misalign and ``cute.compile`` raises "unable to convert
    BlockArgument ... '!cuda.stream' ... to Numeric"), while the same scalars as DSL values compile
    (CPU cross-compiles, 2026-12-02, ``tests/test_aux_scalars.py``).  The values, and the Float32
    rounding of a float, are the same either way."""
    scalars = check_aux_scalars(aux_scalars)
    if scalars is None:
        return None
    cutlass, _, _ = _dsl()
    kinds = ((bool, cutlass.Boolean), (int, cutlass.Int32), (float, cutlass.Float32))
    return tuple(next(dsl(x) for py, dsl in kinds if isinstance(x, py)) for x in scalars)


def production_kwargs(kw: dict, *, device=None, deterministic: bool = False) -> dict:
    """The keywords ``kw`` (the contract's: ``score_mod``, ``mask_mod``, ``aux_tensors``,
    ``block_sparse_tensors``, anything else passed through) as production's ``flash_attn_func``
    takes them: a ScoreMod becomes ``score_mod=forms["cute"]`` and ``score_mod_bwd=
    forms["cute_bwd"]`` (None when it has none: production then asserts in the backward), a
    MaskMod ``forms["cute"]``, a BlockSparse ``block_sparse_tensors`` and
    ``block_sparse_tensors_bwd`` (:func:`production_block_sparse`; production's autograd wrapper
    hands the backward only the latter, ``FlashAttnFunc.backward``; the BlockSparse's own
    mask_mod when the call names none), aux tensors moved to ``device`` (contiguous),
    ``aux_scalars`` as DSL values (:func:`dsl_scalars`: a workaround, it says for what).  Callables
    (a user's own production forms) pass through as they are."""
    out = dict(kw)
    if "aux_scalars" in out:
        out["aux_scalars"] = dsl_scalars(out["aux_scalars"])
    sm = out.pop("score_mod", None)
    if isinstance(sm, ScoreMod):
        if "cute" not in sm.forms:
            raise NotImplementedError(f"score_mod {sm.name!r} has no production form (forms['cute'])")
        out["score_mod"] = sm.forms["cute"]
        if out.get("score_mod_bwd") is None:
            out["score_mod_bwd"] = sm.forms["cute_bwd"] if "cute_bwd" in sm.forms else None
    elif sm is not None:
        out["score_mod"] = sm
    mm = out.pop("mask_mod", None)
    if isinstance(mm, MaskMod):
        if "cute" not in mm.forms:
            raise NotImplementedError(f"mask_mod {mm.name!r} has no production form (forms['cute'])")
        out["mask_mod"] = mm.forms["cute"]
    elif mm is not None:
        out["mask_mod"] = mm
    aux = out.pop("aux_tensors", None)
    if aux is not None:
        out["aux_tensors"] = [(t.to(device) if device is not None else t).contiguous() for t in aux]
    bs = out.pop("block_sparse_tensors", None)
    if isinstance(bs, BlockSparse):
        if out.get("mask_mod") is None and bs.mask_mod is not None:
            # the mask its partial blocks apply (numerics.mods.visibility uses it when the call
            # names no mask_mod); production applies a mask_mod on partial blocks only
            out["mask_mod"] = bs.mask_mod.forms["cute"]
        fwd, bwd = production_block_sparse(bs, device=device, deterministic=deterministic)
        out["block_sparse_tensors"] = fwd
        out.setdefault("block_sparse_tensors_bwd", bwd)
    elif bs is not None:
        out["block_sparse_tensors"] = bs
    return out
