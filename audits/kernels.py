"""Kernels by name (docs/design.md, the kernel contract), each an audited callable
``fn(q, k, v, *, softmax_scale, causal, window_size, softcap, learnable_sink, return_lse)``.

* ``fa4``: production ``flash_attn.cute.flash_attn_func`` (CUDA + the ``gpu`` extra).
* ``fa4-model``: ``fa4.model.attention`` with production SM100 numerics for the inputs.
* ``fa4-model-sm90``: the model's Hopper configuration.
* ``fa4-model-sm90-tc``: the same with the H200's measured tensor-core summation
  (``FA4Numerics.mma="tensor_core"``, docs/tensor-cores.md): with MUFU itself on CUDA, the
  closest model of production on Hopper; on the CPU it costs about 60x the default at b1 h8
  s512 (docs/performance.md).
* ``sdpa-math``, ``sdpa-flash``, ``sdpa-efficient``, ``sdpa-cudnn``: PyTorch's SDPA backends
  as peers.  SDPA has no softcap, sink, fp8 or LSE output: the first three are outside its
  declared domain (the runner skips them before calling); what a domain cannot say raises
  ``NotImplementedError`` at run time (rows with no visible key: SDPA gives NaN there where FA's
  convention is 0; bottom-right causal masks on flash and cudnn; efficient and cudnn off CUDA,
  ``sdpa_unavailable``), and ``return_lse`` yields
  ``None``.
* ``flex``: PyTorch's ``flex_attention`` as a peer (compiled on CUDA, eager and forward-only on
  the CPU), with the mods (``numerics.mods``) in flex's own form; no sink, no fp8.
* ``module:attr`` or ``path/to/file.py:fn``: any callable with that signature.

Each built-in declares its domain (``fn.fa4_audit_domain``, ``audits.suites.domain``): production's per
GPU architecture (``fa4.production.production_domain``), the models' (``_MODEL_DOMAINS``),
SDPA's per backend (``_sdpa_domain``), flex's (``_flex.fa4_audit_domain``).

``fa4_numerics(name)`` says which ``FA4Numerics`` family a kernel implements, so the runner
can hold it to ``numerics.forward_bound``; None for the peers.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention import flex_attention as flex_module
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from audits.common import UsageError
from audits.suites.domain import Domain, DomainError, domain_of
from fa4.mods import block_sparse_index_lists
from fa4.production import (
    REFUSALS,
    ProductionUnavailable,
    flash_attn,
    flash_attn_varlen,
    production_domain,
    refusal_in_call,
    require_production,
)
from numerics.mods import bind_aux_scalars
from numerics.reference import effective_window, visible_mask

__all__ = [
    "KERNELS",
    "MODELS",
    "get_kernel",
    "kernel_domain",
    "portable_spec",
    "fa4_numerics",
    "fa4_arch",
    "production_arch",
    "cuda_arch",
    "arch_of_capability",
    "claims_nonfinite_inputs",
    "contract_error",
    "SDPA_DEVICES",
    "sdpa_unavailable",
    "ContractBreach",
    "contract_breaches",
    "breach_of",
    "OUT_AXES",
    "LSE_AXES",
    "VARLEN_KERNELS",
    "get_varlen_kernel",
    "per_sequence",
    "varlen_contract_error",
    "varlen_contract_breaches",
    "fa4_varlen_numerics",
    "fa4_varlen_splits",
]


#: the models by name: (FA4Numerics family, its ``mma``)
MODELS = {
    "fa4-model": ("sm100", "exact"),
    "fa4-model-sm90": ("sm90", "exact"),
    "fa4-model-sm90-tc": ("sm90", "tensor_core"),
}


def _model_of(arch: str, mma: str = "exact"):
    """The model with production's ``arch`` numerics for the inputs and MMA summation ``mma``;
    ``deterministic`` is production's flag (the backward's semaphore-ordered dQ:
    ``FA4Numerics.bwd_deterministic``)."""

    def run(q, k, v, *, causal=False, window_size=(None, None), return_lse=False, deterministic=False, **kw):
        from fa4.model import FA4Numerics, attention  # lazy: fa4.model loads numba (~0.2 s)

        # production's numerics for this call: a mask_mod drops the flags from the forward's
        # configuration (interface._resolve_causal_local_window), block sparsity fits the tiles
        nm = FA4Numerics.for_call(
            arch,
            q,
            k,
            v,
            causal=causal,
            window_size=window_size,
            mask_mod=kw.get("mask_mod"),
            block_sparse_tensors=kw.get("block_sparse_tensors"),
        )
        nm = dataclasses.replace(nm, bwd_deterministic=bool(deterministic), mma=mma)
        return attention(q, k, v, causal=causal, window_size=window_size, return_lse=return_lse, numerics=nm, **kw)

    run.fa4_audit_domain = _MODEL_DOMAINS[arch]
    run.fa4_audit_arch = arch  # whose code-path classes it models (audits.verdict.coverage)
    return run


#: The models' declared domains.  SM100: every configuration (the model computes any dtype, head
#: dims, mask, softcap, sink, layout, and the backward and ``deterministic``; production's own
#: refusals, e.g. (192, 192), are production's: ``fa4``).  SM90: bf16 and fp16 only
#: (``FA4Numerics.sm90`` raises NotImplementedError for fp8, fa4/model.py, after production's
#: flash_fwd.py _check_type).  Their backward's head-dim limits (fa4/model_bwd.py ``bwd_plan``,
#: ``_hd256_refusals``) concern the backward only and stay run-time refusals.
#: Both model every mod kind (fa4/model.py, "Mods"); their varlen entries refuse mods at run time.
_MODEL_DOMAINS = {
    "sm100": {"mods": ["score_mod", "mask_mod", "block_sparse", "aux_scalars"]},
    "sm90": {"dtypes": ["bfloat16", "float16"], "mods": ["score_mod", "mask_mod", "block_sparse", "aux_scalars"]},
}


def _production(q, k, v, *, deterministic=False, **kw):
    return flash_attn(q, k, v, deterministic=deterministic, **kw)


_production.fa4_audit_refusals = REFUSALS  # its backward refuses by these rules only,
_production.fa4_audit_refusal = refusal_in_call  # predicted from the call's features (fa4.production)


def arch_of_capability(major: int) -> str | None:
    """The code-path architecture (``fa4.code_paths``) of compute capability ``major``.x:
    "sm90" on 9.x (Hopper), "sm100" on 10.x and 11.x (production's SM100/110 path,
    flash_attn/cute/interface.py ``_flash_attn_fwd`` dispatches both to the SM100 kernel); None
    on another generation."""
    return {9: "sm90", 10: "sm100", 11: "sm100"}.get(major)


def cuda_arch() -> str | None:
    """The code-path architecture of this machine's GPU (production's ``fa4_audit_arch``, for
    coverage: ``audits.verdict.coverage``), :func:`arch_of_capability`; None without CUDA."""
    if not torch.cuda.is_available():
        return None
    return arch_of_capability(torch.cuda.get_device_capability()[0])


_production.fa4_audit_arch = cuda_arch
#: per GPU architecture, evaluated when asked (fa4.production.production_domain cites the source)
_production.fa4_audit_domain = production_domain


#: the device types on which PyTorch builds each SDPA backend: on the CPU its dispatcher chooses
#: between flash and math only (``aten/src/ATen/native/transformers/sdp_utils_cpp.cpp``,
#: ``select_sdp_backend_cpp``); the memory-efficient and cuDNN backends are CUDA kernels
#: (``sdp_utils.cpp``, ``select_sdp_backend``); math runs wherever torch does (None: any device)
SDPA_DEVICES: dict[str, tuple[str, ...] | None] = {
    "math": None,
    "flash": ("cpu", "cuda"),
    "efficient": ("cuda",),
    "cudnn": ("cuda",),
}


def sdpa_unavailable(*, backend: str, device: torch.device) -> str | None:
    """Why PyTorch's SDPA ``backend`` cannot run on ``device``, decided before any call (None: it
    may; what it refuses per configuration is still raised by the call): the backend is not built
    for that device type (:data:`SDPA_DEVICES`), or this torch build lacks it on CUDA
    (``torch.backends.cuda.is_flash_attention_available``, ``torch.backends.cudnn.is_available``).
    Never read from an exception's wording: torch says the same absence as "No viable backend"
    or "No available kernel" depending on its version."""
    where = SDPA_DEVICES[backend]
    if where is not None and device.type not in where:
        return (
            f"sdpa-{backend}: PyTorch has no {backend} SDPA backend on device {device.type!r} "
            f"(it is built for {', '.join(where)} only)"
        )
    if device.type == "cuda" and backend == "flash" and not torch.backends.cuda.is_flash_attention_available():
        return f"sdpa-flash: this torch build ({torch.__version__}) has no flash SDPA backend on device 'cuda'"
    if device.type == "cuda" and backend == "cudnn" and not torch.backends.cudnn.is_available():
        return f"sdpa-cudnn: this torch build ({torch.__version__}) has no cuDNN on device 'cuda'"
    return None


def _sdpa(backend: str) -> Callable:
    def run(
        q,
        k,
        v,
        *,
        softmax_scale=None,
        causal=False,
        window_size=(None, None),
        softcap=0.0,
        learnable_sink=None,
        return_lse=False,
    ):
        # softcap, the sink, fp8 and (flash, cudnn) windows are outside its declared domain:
        # the runner skips those cases before calling (run.fa4_audit_domain below); a backend
        # absent from this device is a refusal decided from the device, before the call
        if (absent := sdpa_unavailable(backend=backend, device=q.device)) is not None:
            raise NotImplementedError(absent)
        sq, sk = q.shape[1], k.shape[1]
        vis = visible_mask(sq, sk, causal=causal, window_size=window_size, device=q.device)
        if not bool(vis.any(-1).all()):
            raise NotImplementedError("SDPA returns NaN for rows with no visible key (FA returns 0)")
        mask = None
        is_causal = False
        if causal and sq == sk and all(w is None for w in window_size):
            is_causal = True
        elif not bool(vis.all()):
            if backend in ("flash", "cudnn"):  # causal with seqlen_q != seqlen_k: not a domain key
                raise NotImplementedError(f"sdpa-{backend} takes no arbitrary mask (bottom-right causal, windows)")
            mask = vis
        be = {
            "math": SDPBackend.MATH,
            "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION,
        }[backend]
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        try:
            with sdpa_kernel(be):
                o = torch.nn.functional.scaled_dot_product_attention(
                    qt,
                    kt,
                    vt,
                    attn_mask=mask,
                    is_causal=is_causal,
                    scale=softmax_scale,
                    enable_gqa=q.shape[2] != k.shape[2],
                )
        except RuntimeError as exc:  # "No available kernel": the backend refuses this configuration
            if "No available kernel" in str(exc) or "not supported" in str(exc).lower():
                raise NotImplementedError(f"sdpa-{backend}: {str(exc).splitlines()[0]}") from exc
            raise
        o = o.transpose(1, 2)
        return (o, None) if return_lse else o

    run.fa4_audit_domain = _sdpa_domain(backend)
    return run


def _sdpa_domain(backend: str) -> dict:
    """SDPA's declared domain: ``scaled_dot_product_attention`` has no softcap and no sink
    parameter, takes no fp8 inputs, and has no ``deterministic`` flag (the backward runs, its
    run-to-run differences are measured, never promised away: ``accepts_deterministic`` is False).
    flash and cudnn take no ``attn_mask`` (``sdpa_kernel``'s constraints), so no windows; math and
    efficient take the window as a boolean mask.  Not expressible here, so raised at run time:
    rows with no visible key (SDPA gives NaN, FA 0), bottom-right causal with seqlen_q !=
    seqlen_k on flash and cudnn, a backend absent from the device the call runs on (efficient and
    cudnn off CUDA: :func:`sdpa_unavailable`, decided from the device before the call; a domain
    has no device key) and whatever a backend refuses on this device ("No available kernel": GQA
    on some backends, head dims, the GPU)."""
    d = {"dtypes": ["bfloat16", "float16"], "softcap": False, "sink": False, "deterministic": False}
    return {**d, "local": False} if backend in ("flash", "cudnn") else d


#: flex_attention's recompile allowance on CUDA: dynamo specialises the compiled kernel on the
#: score_mod / mask_mod closures, which change with every case's mods (their constants, aux
#: tensors), and past torch's default of 8 it would fall back to the unfused eager path
#: silently; an audit run's distinct mod configurations stay well under this
FLEX_RECOMPILE_LIMIT = 512


def _flex_compiled():
    """``flex_attention`` compiled by ``torch.compile`` (once per process): the fused Triton
    kernel the peer audits on CUDA (eager flex materialises the scores, another algorithm)."""
    global _FLEX_COMPILED
    if _FLEX_COMPILED is None:
        import torch._dynamo.config as dynamo_config  # lazy: dynamo only where flex is compiled (CUDA)
        from torch.nn.attention.flex_attention import flex_attention

        for knob in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit"):
            if hasattr(dynamo_config, knob):
                setattr(dynamo_config, knob, max(getattr(dynamo_config, knob), FLEX_RECOMPILE_LIMIT))
        # specialize_float: a mod's float constant (softcap's cap) would otherwise enter the graph
        # as a 0-d CPU float64 input, which flex's lowering rejects (InductorError "unbacked_bindings",
        # every softcap case on the H200, torch 2.11, 2026-12-02); dynamic=False: one kernel per shape,
        # as flex is used (no symbolic lengths in its block masks)
        if hasattr(dynamo_config, "specialize_float"):
            dynamo_config.specialize_float = True
        _FLEX_COMPILED = torch.compile(flex_attention, dynamic=False)
    return _FLEX_COMPILED


_FLEX_COMPILED = None


def _flag_mask(causal: bool, window_size, seqlen_q: int, seqlen_k: int) -> Callable | None:
    """The flags' mask as a flex mask_mod ``(b, h, q_idx, kv_idx) -> bool`` (None: keeps every
    key): ``numerics.reference.visible_key_range``'s rule, bottom-right aligned."""
    left, right = effective_window(causal=causal, window_size=window_size)
    if left is None and right is None:
        return None
    off = seqlen_k - seqlen_q

    def keep(b, h, q_idx, kv_idx):
        diag = q_idx + off
        ok = kv_idx >= diag - left if left is not None else kv_idx >= 0
        return ok & (kv_idx <= diag + right) if right is not None else ok

    return keep


def _flex_block_mask(bs, mask_mod, seqlen_q: int, seqlen_k: int, device):
    """flex's ``BlockMask`` of a :class:`numerics.mods.BlockSparse`: the partial blocks as its
    ``kv_num_blocks`` / ``kv_indices`` (``mask_mod`` applied there), the full ones as
    ``full_kv_*`` (not masked), the lists ascending as ``create_block_mask`` orders them;
    ``BlockMask.from_kv_blocks`` derives the transposed lists the backward walks."""
    cnt, idx = block_sparse_index_lists(bs.partial.to(device))
    full_cnt, full_idx = block_sparse_index_lists(bs.full.to(device))
    return BlockMask.from_kv_blocks(
        cnt,
        idx,
        full_cnt,
        full_idx,
        BLOCK_SIZE=tuple(bs.block_size),
        mask_mod=mask_mod,
        seq_lengths=(seqlen_q, seqlen_k),
    )


def _eager_block_mask_mod(bs, mask_mod, device) -> Callable:
    """The block structure of ``bs`` folded into the mask_mod: ``full | (partial & mask_mod)``
    per key.  flex's eager path (the CPU) evaluates only the BlockMask's mask_mod, on every score
    (``torch._higher_order_ops.flex_attention``, ``_math_attention_inner``), never its block
    lists; on a partial block this is the mask_mod itself, so where the block lists are used
    (the compiled kernel) it changes nothing."""
    full, part = bs.full.to(device), bs.partial.to(device)
    bq, bk = bs.block_size

    def keep(b, h, q_idx, kv_idx):
        bb = b if full.shape[0] > 1 else torch.zeros_like(b)
        hh = h if full.shape[1] > 1 else torch.zeros_like(h)
        i, j = q_idx // bq, kv_idx // bk
        inner = part[bb, hh, i, j] if mask_mod is None else part[bb, hh, i, j] & mask_mod(b, h, q_idx, kv_idx)
        return full[bb, hh, i, j] | inner

    return keep


def _working_score(s: torch.Tensor) -> torch.Tensor:
    """The score a mod's form sees under flex: at least float32.  flex traces a score_mod on an
    example score of the query's dtype (``torch/_higher_order_ops/flex_attention.py``,
    ``trace_flex_attention`` and the functionalization rule: ``query.new_zeros(())``), so a
    form's ``.to(s.dtype)`` (the bias of ``alibi`` and ``relbias``, ``numerics/mod_library.py``)
    would be recorded as a cast to bf16/fp16 and the bias computed in the input dtype, while
    flex's scores are float32 (its Triton template, ``forward_block_mn``; the eager path's
    ``_math_attention_inner``): on the CPU that cost an ALiBi case of smoke 2.8 times the LSE bound
    (docs/peers.md).  Promoting the example to float32 makes the forms compute in the scores'
    own precision; at run time, on a float32 (or float64) score, it is a no-op."""
    return s.to(torch.promote_types(s.dtype, torch.float32))


def _flex_mods(q, k, *, causal, window_size, softcap, score_mod, mask_mod, aux, block_sparse):
    """(score_mod, block_mask) of a flex call for the contract's flags and mods (:func:`_flex`)."""
    b, sq, hq, sk = q.shape[0], q.shape[1], q.shape[2], k.shape[1]
    flags = _flag_mask(causal, window_size, sq, sk)
    sm = None
    if score_mod is not None:
        fn = score_mod.fn
        sm = lambda s, bi, hi, qi, ki: fn(_working_score(s), bi, hi, qi, ki, aux)  # noqa: E731
    elif softcap and softcap > 0:
        cap = float(softcap)
        sm = lambda s, bi, hi, qi, ki: cap * torch.tanh(s / cap)  # noqa: E731
    mm_obj = mask_mod if mask_mod is not None else (block_sparse.mask_mod if block_sparse is not None else None)
    mm = None
    if mm_obj is not None:
        mfn = mm_obj.fn
        mm = lambda bi, hi, qi, ki: mfn(bi, hi, qi, ki, aux)  # noqa: E731
    if block_sparse is not None:
        if not q.is_cuda:
            mm = _eager_block_mask_mod(block_sparse, mm, q.device)
        block_mask = _flex_block_mask(block_sparse, mm, sq, sk, q.device)
        if flags is None:
            return sm, block_mask
        inner = sm

        def flagged(s, bi, hi, qi, ki):  # the flags hold on full blocks too: -inf where they hide the key
            s2 = inner(s, bi, hi, qi, ki) if inner is not None else s
            return torch.where(flags(bi, hi, qi, ki), s2, torch.full_like(s2, -math.inf))

        return flagged, block_mask
    if mm is not None and flags is not None:
        inner_mm = mm
        mm = lambda bi, hi, qi, ki: inner_mm(bi, hi, qi, ki) & flags(bi, hi, qi, ki)  # noqa: E731
    elif mm is None:
        mm = flags
    if mm is None:
        return sm, None
    per_head = mm_obj is not None and mm_obj.per_head
    return sm, create_block_mask(mm, b, hq if per_head else None, sq, sk, device=q.device)


def _flex(
    q,
    k,
    v,
    *,
    softmax_scale=None,
    causal=False,
    window_size=(None, None),
    softcap=0.0,
    learnable_sink=None,
    return_lse=False,
    score_mod=None,
    mask_mod=None,
    aux_tensors=None,
    block_sparse_tensors=None,
    aux_scalars=None,
):
    """PyTorch's ``flex_attention`` as a peer (kernel ``flex``): compiled on CUDA, eager on the
    CPU (forward only there: flex refuses a CPU backward, NotImplementedError).  The mods are
    the contract's (``numerics.mods``) reference forms, which flex evaluates on its own
    (``score_mod(score, b, h, q_idx, kv_idx)`` on ``scale * q.k``, the semantics production's
    forms share), closing over the call's ``aux_tensors`` and ``aux_scalars`` (the latter handed to
    the forms only when the call has some: ``numerics.mods.bind_aux_scalars``).  The flags intersect a mask_mod (the
    audit's meaning, ``numerics.mods``): without block sparsity both go into the mask_mod of
    ``create_block_mask``; with it the blocks are the BlockSparse's (``BlockMask.from_kv_blocks``,
    the mask_mod on partial blocks only; on the CPU, whose eager flex reads no block lists, the
    blocks are folded into the mask_mod: :func:`_eager_block_mask_mod`) and the flags, which
    must hold on full blocks too, become a score_mod setting hidden keys to -inf.  ``softcap``
    becomes the score_mod ``c * tanh(s / c)`` (with a score_mod too it is refused, as
    production refuses it); ``learnable_sink`` is refused (flex has no sink).  The LSE
    (``return_aux=AuxRequest(lse=True)``; ``return_lse`` before torch 2.9) is natural-log (flex
    rescales its base-2 statistics: ``_finalize_outputs``); GQA through ``enable_gqa``."""
    if learnable_sink is not None:
        raise NotImplementedError("flex_attention has no learnable sink")
    if softcap and score_mod is not None:
        raise NotImplementedError("softcap and a score_mod together: one score_mod only (production refuses it too)")
    score_mod, mask_mod, block_sparse_tensors = bind_aux_scalars(
        aux_scalars, score_mod=score_mod, mask_mod=mask_mod, block_sparse=block_sparse_tensors
    )
    sm, block_mask = _flex_mods(
        q,
        k,
        causal=causal,
        window_size=window_size,
        softcap=softcap,
        score_mod=score_mod,
        mask_mod=mask_mod,
        aux=list(aux_tensors or []),
        block_sparse=block_sparse_tensors,
    )
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    run = _flex_compiled() if q.is_cuda else flex_module.flex_attention
    # torch >= 2.9 asks for the LSE through return_aux (return_lse deprecated); older, return_lse
    request = {"return_aux": flex_module.AuxRequest(lse=True)} if hasattr(flex_module, "AuxRequest") else {}
    try:
        res = run(
            qt,
            kt,
            vt,
            score_mod=sm,
            block_mask=block_mask,
            scale=softmax_scale,
            enable_gqa=q.shape[2] != k.shape[2],
            **(request or {"return_lse": True}),
        )
    except Exception as exc:
        cause = exc.__cause__ or exc.__context__
        while cause is not None and not isinstance(cause, NotImplementedError):
            cause = cause.__cause__ or cause.__context__
        if isinstance(exc, NotImplementedError) or cause is not None:  # flex's own refusal (maybe wrapped)
            raise NotImplementedError(f"flex_attention: {cause or exc}") from exc
        raise
    o, stats = res
    lse = stats.lse if request else stats
    o = o.transpose(1, 2)
    return (o, lse.float()) if return_lse else o


_flex.fa4_audit_domain = {
    "dtypes": ["bfloat16", "float16"],
    "sink": False,
    "deterministic": False,
    "mods": ["score_mod", "mask_mod", "block_sparse", "aux_scalars"],
}


KERNELS: dict[str, Callable] = {
    "fa4": _production,
    **{name: _model_of(*family) for name, family in MODELS.items()},
    "sdpa-math": _sdpa("math"),
    "sdpa-flash": _sdpa("flash"),
    "sdpa-efficient": _sdpa("efficient"),
    "sdpa-cudnn": _sdpa("cudnn"),
    "flex": _flex,
}


def claims_nonfinite_inputs(name: str) -> bool:
    """Whether a kernel claims defined results for NaN/inf inputs (FA's convention: masked
    positions never leak).  PyTorch's SDPA makes no such claim — its additive mask lets a NaN at
    a masked key reach every row — so cases with non-finite inputs are out of its domain; nor
    does flex_attention (its P.V meets a NaN value at a masked key of a visited block).  FA4
    kernels and user kernels (``module:attr``) are held to it."""
    return not name.startswith("sdpa-") and name != "flex"


def production_arch() -> str:
    """The FA4Numerics family of the production kernel on this machine's GPU: ``sm90`` on
    Hopper (compute capability 9.x), ``sm100`` on Blackwell datacenter parts (10.x) and, with
    no GPU, the SM100 path the model describes.  Other generations (SM120's own kernel) have no
    model: ValueError."""
    if not torch.cuda.is_available():
        return "sm100"
    major, minor = torch.cuda.get_device_capability()
    if major in (9, 10):
        return {9: "sm90", 10: "sm100"}[major]
    raise ValueError(f"no numerics model for compute capability {major}.{minor}: FA4Numerics covers sm90 and sm100")


def fa4_numerics(name: str):
    """Callable (q, k, v, causal, window) -> FA4Numerics for kernels that implement FA4's
    numerics (held to the forward-pass bound); None for the others."""
    from fa4.model import FA4Numerics  # lazy: numba

    arch = fa4_arch(name)
    if arch is None:
        return None
    return lambda q, k, v, causal, window: FA4Numerics.for_inputs(arch, q, k, v, causal, window)


def fa4_arch(name: str) -> str | None:
    """The FA4Numerics family of a built-in FA4 kernel (production: this machine's GPU's)."""
    if name == "fa4":  # on this machine's GPU generation
        return production_arch()
    return MODELS[name][0] if name in MODELS else None


def fa4_varlen_numerics(name: str):
    """Callable (q, k, v, causal, window, *, num_splits, page_size, pack_gqa, max_seqlen_q,
    block_sparse=None) -> the FA4Numerics of one sequence (batch-1 tensors) of a varlen call with
    packed queries, as the kernel's varlen entry chooses them (``fa4.varlen``: SM100 without
    2-CTA for packed queries, splits and pages other than 128; tiles from ``max_seqlen_q``; the
    interleave of packed GQA; tiles fitted to a sparse block); ``page_size`` 0: no page table;
    ``pack_gqa`` None: the default (on for GQA).  None for kernels that do not implement FA4's
    numerics."""
    from fa4.varlen import packs_gqa, sequence_numerics  # lazy: fa4.varlen loads fa4.model (numba)

    arch = fa4_arch(name)
    if arch is None:
        return None

    def nm(q, k, v, causal, window, *, num_splits: int, page_size: int, pack_gqa, max_seqlen_q: int, block_sparse=None):
        pack = packs_gqa(pack_gqa, q.shape[2], k.shape[2])
        return sequence_numerics(
            arch,
            q,
            k,
            v,
            causal,
            window,
            varlen_q=True,
            num_splits=num_splits,
            page_size=page_size,
            pack=pack,
            max_seqlen_q=max_seqlen_q,
            block_sparse=block_sparse,
        )

    return nm


def fa4_varlen_splits(name: str):
    """Callable (q, k, kw) -> the split count of each sequence of a varlen call with keywords
    ``kw``, as the kernel's varlen entry runs it (``fa4.varlen.split_counts``: the static
    ``num_splits``, or SM100's per-sequence counts on varlen queries, which follow the GPU's SM
    count: production's own GPU's, the model's 148 of a B200); None for kernels that do not
    implement FA4's numerics."""
    from fa4.varlen import split_counts  # lazy: numba

    arch = fa4_arch(name)
    if arch is None:
        return None
    sms = torch.cuda.get_device_properties(0).multi_processor_count if name == "fa4" else 148
    return lambda q, k, kw: split_counts(q, k, arch=arch, num_sms=sms, **kw)


def _package_root(path: Path) -> tuple[Path, str]:
    """(the directory to put on sys.path, the dotted module name) of a Python file: walk up
    while the directory is a package (has ``__init__.py``), so relative imports keep working."""
    path = path.resolve()
    parts = [path.stem]
    d = path.parent
    while (d / "__init__.py").exists():
        parts.insert(0, d.name)
        d = d.parent
    return d, ".".join(parts)


def _split_spec(spec: str) -> tuple[str, str]:
    mod, sep, attr = spec.rpartition(":")
    if not sep or not mod or not attr:
        raise ValueError(f"unknown kernel {spec!r}; accepted: {', '.join(KERNELS)}, module:attr or path/to/file.py:fn")
    return mod, attr


def get_kernel(spec: str) -> Callable:
    """A kernel by name, ``module:attr`` (importable from the current directory or sys.path) or
    ``path/to/file.py:fn`` (any directory); ``ValueError`` naming what was wrong and what is
    accepted."""
    if spec in KERNELS:
        return KERNELS[spec]
    mod, attr = _split_spec(spec)
    if mod.endswith(".py"):
        path = Path(mod)
        if not path.is_file():
            raise ValueError(f"kernel {spec!r}: no such file {path}")
        root, mod = _package_root(path)
        if str(root) not in sys.path:
            sys.path.insert(0, str(root))
    elif os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(mod)
    except Exception as exc:  # noqa: BLE001 - whatever the user's module raises on import: one line, exit 2
        raise ValueError(_import_failure(spec, exc)) from None
    if not hasattr(module, attr):
        where = getattr(module, "__file__", None) or mod
        defined = sorted(n for n, x in vars(module).items() if callable(x) and not n.startswith("_"))
        raise ValueError(
            f"{where}: kernel {spec!r}: the module defines no {attr!r} (its public callables: "
            f"{', '.join(defined) or 'none'})"
        )
    fn = getattr(module, attr)
    if not callable(fn):
        raise ValueError(f"kernel {spec!r}: {attr} is a {type(fn).__name__}, not a callable")
    return fn


def _import_failure(spec: str, exc: BaseException) -> str:
    """One line ``file:line: Type: message`` for a kernel module that does not import: a syntax
    error at its own location; any other exception at the innermost frame of the traceback that
    lies outside the import machinery (the user's line, or the line of theirs that imported a
    missing module)."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{exc.filename}:{exc.lineno}: SyntaxError: {exc.msg} (loading kernel {spec!r})"
    here = str(Path(__file__).resolve())
    tb = traceback.extract_tb(exc.__traceback__)
    frames = [f for f in tb if "importlib" not in f.filename and f.filename != here]
    at = f"{frames[-1].filename}:{frames[-1].lineno}: " if frames else ""
    if isinstance(exc, ModuleNotFoundError) and not frames:
        return f"cannot load kernel {spec!r}: no module named {exc.name!r} (importable from {os.getcwd()} or sys.path)"
    return f"{at}{type(exc).__name__}: {exc} (loading kernel {spec!r})"


def portable_spec(spec: str) -> str:
    """``spec`` in a form that loads from any working directory: built-in names as they are,
    ``module:attr`` and relative file paths as the absolute path of the module's file."""
    if spec in KERNELS:
        return spec
    get_kernel(spec)  # loads it, or says why not
    mod, attr = _split_spec(spec)
    if mod.endswith(".py"):
        return f"{Path(mod).resolve()}:{attr}"
    f = getattr(sys.modules[mod], "__file__", None)
    return f"{Path(f).resolve()}:{attr}" if f else spec


def usable_kernels(specs: list[str], *, domains: bool = True) -> list[str]:
    """The kernels named (duplicates dropped), each loadable, the production kernel only where
    it can run, and (``domains``) each declaring a well-formed domain: otherwise a ``UsageError``
    (exit 2, with the install hint), never an error verdict per case.  ``domains=False`` where
    the caller resolves the domains next (the case selection, which reports a malformed one alike)."""
    kernels = list(dict.fromkeys(specs))
    for kern in kernels:
        try:
            get_kernel(kern)
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
    if "fa4" in kernels:
        try:
            require_production()
        except ProductionUnavailable as exc:
            raise UsageError(f"--kernel fa4 is the production kernel, which cannot run here: {exc}") from exc
    for kern in kernels if domains else ():  # a malformed declaration is a usage error before any case runs
        try:
            kernel_domain(kern)
        except DomainError as exc:
            raise UsageError(str(exc)) from exc
    return kernels


def kernel_domain(spec: str) -> Domain:
    """The domain the kernel ``spec`` declares (``audits.suites.domain.domain_of``; production's for
    this machine's GPU), resolved now: the runner resolves it once per kernel and run."""
    return domain_of(get_kernel(spec))


#: the axes of the audited callable's output and LSE (README, "Audit your kernel"), named by the
#: Case fields that size them (``audits.suites.cases.Case``), as a shape error names them
OUT_AXES = ("batch", "seqlen_q", "heads_q", "dv")
LSE_AXES = ("batch", "heads_q", "seqlen_q")


@dataclasses.dataclass(frozen=True)
class ContractBreach:
    """One returned tensor that breaks the audited callable's contract: ``tensor`` ("out", "lse",
    "dq", "dk", "dv", "dsink"), what the contract expects (``expected`` shape with its ``axes``
    named, ``expected_dtype`` and the rule it follows, ``dtype_rule``) and what the kernel returned
    (``got`` shape and ``got_dtype``, both None when it is no tensor; ``got_type``, the type's
    name).  Its :attr:`reason` says the case's shapes; its :attr:`fault` the same breach without
    them, so that every case a kernel breaks the same way (a transposed output at any size) is one
    fault (``audits.verdict.separators.fault_groups``).  The record a report keeps: :meth:`as_record`
    (``audits.report.records.ContractRecord``)."""

    tensor: str
    axes: tuple[str, ...]
    expected: tuple[int, ...]
    expected_dtype: str
    dtype_rule: str
    got: tuple[int, ...] | None
    got_dtype: str | None
    got_type: str

    @property
    def shape_wrong(self) -> bool:
        return self.got is not None and self.got != self.expected

    @property
    def dtype_wrong(self) -> bool:
        return self.got_dtype is not None and self.got_dtype != self.expected_dtype

    def _shape_fault(self) -> str:
        """The shape's fault in axis names only: another number of axes; the axes whose sizes
        differ, "swapped" (two) or "permuted" (more) when their sizes are the expected ones in
        another order (a transposed tensor), else "wrong"."""
        got, want = self.got or (), self.expected
        if len(got) != len(want):
            return f"{len(got)} axes returned, {len(want)} expected ({', '.join(self.axes)})"
        off = [i for i in range(len(want)) if got[i] != want[i]]
        names = [self.axes[i] for i in off]
        if len(off) >= 2 and sorted(got[i] for i in off) == sorted(want[i] for i in off):
            return f"{' and '.join(names)} swapped" if len(off) == 2 else f"{', '.join(names)} permuted"
        return f"wrong {' and '.join(names)}"

    @property
    def fault(self) -> str:
        """The breach without the case's sizes: "seqlen_q and heads_q swapped", "wrong dv", "3 axes
        returned, 4 expected (...)", "dtype float32 returned (expected the input dtype, bfloat16 for
        fp8 inputs)", "a tuple returned, not a tensor"."""
        if self.got is None:
            return f"a {self.got_type} returned, not a tensor"
        parts = [self._shape_fault()] if self.shape_wrong else []
        if self.dtype_wrong:
            parts.append(f"dtype {self.got_dtype} returned (expected {self.dtype_rule})")
        return "; ".join(parts)

    @property
    def reason(self) -> str:
        """The breach with the case's sizes, after the tensor's name: "out: shape (1, 2, 17, 32)
        returned, (1, 17, 2, 32) expected (batch, seqlen_q, heads_q, dv): seqlen_q and heads_q swapped"."""
        want = f"{self.expected} ({', '.join(self.axes)}) and dtype {self.expected_dtype}"
        if self.got is None:
            return f"{self.tensor}: a {self.got_type} returned, a tensor of shape {want} expected"
        parts = []
        if self.shape_wrong:
            parts.append(
                f"shape {self.got} returned, {self.expected} expected ({', '.join(self.axes)}): {self._shape_fault()}"
            )
        if self.dtype_wrong:
            parts.append(f"dtype {self.got_dtype} returned, {self.expected_dtype} expected ({self.dtype_rule})")
        return f"{self.tensor}: {'; '.join(parts)}"

    def as_record(self) -> dict:
        """The JSON record (``audits.report.records.ContractRecord``): the fields, shapes as lists,
        with the :attr:`fault` and :attr:`reason` they say."""
        rec = dataclasses.asdict(self)
        rec["axes"], rec["expected"] = list(self.axes), list(self.expected)
        rec["got"] = None if self.got is None else list(self.got)
        return {**rec, "fault": self.fault, "reason": self.reason}


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def breach_of(
    *, tensor: str, got, expected: tuple[int, ...], axes: tuple[str, ...], dtype: torch.dtype, dtype_rule: str
) -> ContractBreach | None:
    """The :class:`ContractBreach` of returned ``got`` against the ``expected`` shape (its ``axes``
    named) and ``dtype`` (``dtype_rule``: that dtype's rule in words), or None when it keeps both."""
    is_tensor = isinstance(got, torch.Tensor)
    shape = tuple(got.shape) if is_tensor else None
    if is_tensor and shape == tuple(expected) and got.dtype == dtype:
        return None
    return ContractBreach(
        tensor=tensor,
        axes=tuple(axes),
        expected=tuple(int(n) for n in expected),
        expected_dtype=_dtype_name(dtype),
        dtype_rule=dtype_rule,
        got=shape,
        got_dtype=_dtype_name(got.dtype) if is_tensor else None,
        got_type=type(got).__name__,
    )


#: the output's dtype rule (README): the input dtype, bfloat16 for the 1-byte fp8 inputs
_OUT_DTYPE_RULE = "the input dtype, bfloat16 for fp8 inputs"


def _out_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.bfloat16 if q.dtype.itemsize == 1 else q.dtype


def contract_breaches(*, q: torch.Tensor, v: torch.Tensor, out, lse) -> list[ContractBreach]:
    """How a kernel's returned ``out``/``lse`` break the audited-callable contract (README): out
    ``(batch, seqlen_q, heads_q, dv)`` (:data:`OUT_AXES`) in the input dtype (bfloat16 for fp8
    inputs), lse ``(batch, heads_q, seqlen_q)`` (:data:`LSE_AXES`) float32 when returned; each
    tensor's breach, empty when they keep it."""
    b, sq, hq, dv = q.shape[0], q.shape[1], q.shape[2], v.shape[-1]
    found = [
        breach_of(
            tensor="out",
            got=out,
            expected=(b, sq, hq, dv),
            axes=OUT_AXES,
            dtype=_out_dtype(q),
            dtype_rule=_OUT_DTYPE_RULE,
        )
    ]
    if lse is not None:
        found.append(
            breach_of(
                tensor="lse", got=lse, expected=(b, hq, sq), axes=LSE_AXES, dtype=torch.float32, dtype_rule="float32"
            )
        )
    return [x for x in found if x is not None]


def contract_error(q: torch.Tensor, v: torch.Tensor, out, lse) -> str | None:
    """Why a kernel's returned ``out``/``lse`` break the audited-callable contract
    (:func:`contract_breaches`, their reasons joined), None when they keep it."""
    found = contract_breaches(q=q, v=v, out=out, lse=lse)
    return "; ".join(x.reason for x in found) if found else None


# ---- the varlen contract (docs/varlen.md) ----------------------------------------------------


def _model_varlen(arch: str, mma: str = "exact") -> Callable:
    def run(q, k, v, **kw):
        from fa4.varlen import varlen_attention  # lazy: numba

        if arch == "sm90" and q.dtype.itemsize == 1:
            raise NotImplementedError("the SM90 path supports only bf16 and fp16 (flash_fwd.py _check_type)")
        return varlen_attention(q, k, v, arch=arch, mma=mma, **kw)

    run.__name__ = f"fa4_model_varlen_{arch}" + ("_tc" if mma == "tensor_core" else "")
    run.fa4_audit_contract = "varlen"
    run.fa4_audit_domain = _MODEL_DOMAINS[arch]
    run.fa4_audit_arch = arch
    return run


def _production_varlen(q, k, v, **kw):
    return flash_attn_varlen(q, k, v, **kw)


_production_varlen.fa4_audit_refusals = REFUSALS
_production_varlen.fa4_audit_refusal = refusal_in_call
_production_varlen.fa4_audit_domain = production_domain
_production_varlen.fa4_audit_contract = "varlen"
_production_varlen.fa4_audit_arch = cuda_arch

#: the built-in kernels' varlen entries: production's ``flash_attn_varlen_func`` and the models'
#: ``fa4.varlen.varlen_attention``
VARLEN_KERNELS: dict[str, Callable] = {
    "fa4": _production_varlen,
    **{name: _model_varlen(*family) for name, family in MODELS.items()},
}


def get_varlen_kernel(spec: str) -> Callable | None:
    """The varlen entry of kernel ``spec``: the built-ins' (:data:`VARLEN_KERNELS`), or a user
    callable that declares the varlen contract (``fn.fa4_audit_contract = "varlen"``); None for
    a fixed-length kernel (audited on varlen cases only per sequence, when asked)."""
    if spec in VARLEN_KERNELS:
        return VARLEN_KERNELS[spec]
    if spec in KERNELS:
        return None
    fn = get_kernel(spec)
    return fn if getattr(fn, "fa4_audit_contract", None) == "varlen" else None


def per_sequence(fn: Callable) -> Callable:
    """A fixed-length kernel ``fn`` behind the varlen contract: each sequence called alone
    (batch 1, its used rows and keys, pages gathered), the results packed back.  Only what the
    user asked for (``--per-sequence``): it audits the sequences, not a varlen entry; split-KV
    and pack_gqa are ignored (the fixed-length call has neither)."""

    def run(q, k, v, *, return_lse=False, num_splits=1, pack_gqa=None, max_seqlen_q=None, max_seqlen_k=None, **kw):
        from fa4.varlen import VARLEN_KEYWORDS, empty_outputs, sequences  # lazy: numba

        vk = {n: kw.pop(n) for n in VARLEN_KEYWORDS if n in kw}
        mods = [n for n in ("score_mod", "mask_mod", "aux_tensors", "block_sparse_tensors") if kw.get(n) is not None]
        if mods:
            raise NotImplementedError(
                f"--per-sequence does not pass mods ({', '.join(mods)}): a batch-1 call per sequence would hand a "
                "mod batch_idx 0 for every sequence, where the varlen entry hands it the sequence's index "
                "(docs/varlen.md, 'Mods on varlen cases'); audit mods on varlen cases through a varlen entry"
            )
        packed = vk.get("cu_seqlens_q") is not None
        seqs = sequences(q, k, **vk)
        out, lse = empty_outputs(q, v, packed=packed)
        kf, vf = k.reshape(-1, *k.shape[-2:]), v.reshape(-1, *v.shape[-2:])
        for s in seqs:
            r0, r1 = s.q_rows
            if r1 == r0:
                continue
            qs = (q[r0:r1] if packed else q[s.index, r0:r1]).unsqueeze(0)
            res = fn(qs, kf[s.k_index].unsqueeze(0), vf[s.k_index].unsqueeze(0), return_lse=True, **kw)
            o, lo = res if isinstance(res, tuple) else (res, None)
            s.place(out, lse, o, lo, packed=packed)
        return (out, lse) if return_lse else out

    run.fa4_audit_contract = "varlen"
    return run


def varlen_contract_breaches(*, q: torch.Tensor, v: torch.Tensor, out, lse, packed: bool) -> list[ContractBreach]:
    """How a varlen kernel's ``out``/``lse`` break the varlen contract (docs/varlen.md): out shaped
    as q with v's head dim, in the input dtype (bf16 for fp8); lse (heads_q, total_q) when q is
    packed, else (batch, heads_q, seqlen_q), float32.  Empty when they keep it."""
    axes = ("total_q", "heads_q", "dv") if packed else OUT_AXES
    want = (*q.shape[:-1], v.shape[-1])
    found = [
        breach_of(tensor="out", got=out, expected=want, axes=axes, dtype=_out_dtype(q), dtype_rule=_OUT_DTYPE_RULE)
    ]
    if lse is not None:
        want_lse, lse_axes = ((q.shape[-2], q.shape[0]), ("heads_q", "total_q")) if packed else (
            (q.shape[0], q.shape[2], q.shape[1]), LSE_AXES)  # fmt: skip
        found.append(
            breach_of(
                tensor="lse", got=lse, expected=want_lse, axes=lse_axes, dtype=torch.float32, dtype_rule="float32"
            )
        )
    return [x for x in found if x is not None]


def varlen_contract_error(q: torch.Tensor, v: torch.Tensor, out, lse, *, packed: bool) -> str | None:
    """Why a varlen kernel's ``out``/``lse`` break the varlen contract
    (:func:`varlen_contract_breaches`, their reasons joined), None when they keep it."""
    found = varlen_contract_breaches(q=q, v=v, out=out, lse=lse, packed=packed)
    return "; ".join(x.reason for x in found) if found else None
