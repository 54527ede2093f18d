"""Adapters to the production FA4 package (``flash-attn-4``, import ``flash_attn.cute``).

Everything here is imported lazily: without CUDA or without the package the rest of fa4-audit
works, and the functions here raise :class:`ProductionUnavailable` with what is missing and how
to install it.

``ex2_kernel(variant, degree)`` compiles a small CuTe-DSL kernel that applies a *production*
device function elementwise, so the model in ``fa4.ex2`` can be compared with it bit for bit:

* ``"scalar"``: ``flash_attn.cute.utils.ex2_emulation(x, poly_degree=degree)``;
* ``"packed"``: ``flash_attn.cute.utils.ex2_emulation_2(x0, x1, poly_degree=degree)`` on pairs
  of consecutive elements (its f32x2 instructions exist from sm_100 on);
* ``"hardware"``: ``cute.math.exp2(x, fastmath=True)`` (``ex2.approx.ftz.f32``, MUFU.EX2), what
  the kernel uses for the non-emulated elements.

Each thread handles two consecutive elements (the pair for ``packed``).
"""

# No `from __future__ import annotations` here: the CuTe DSL evaluates the kernels'
# annotations (cute.Tensor, cutlass.Constexpr) at compile time, in the defining scope.
import functools
import glob
import os
import re
from collections.abc import Callable

import torch

from fa4.mods import production_kwargs
from fa4.refusals import REFUSALS, ProductionRefusal, production_domain, refusal_in_call

__all__ = [
    "ProductionError",
    "ProductionUnavailable",
    "INSTALL_HINT",
    "COMPILE_CACHE_ENV",
    "enable_compile_cache",
    "require_production",
    "ex2_kernel",
    "EX2_VARIANTS",
    "flash_attn_varlen",
]

INSTALL_HINT = (
    "install the production kernel with: pip install 'fa4-audit[gpu]' "
    "(flash-attn-4 4.0.0b36 to 4.0.0b40, nvidia-cutlass-dsl==4.8.1; needs an NVIDIA GPU with CUDA 12.9+ or 13)"
)
EX2_VARIANTS = ("scalar", "packed", "hardware")
#: Other MUFU approximations production uses: lg2.approx.ftz (LSE), rcp.approx.ftz (final
#: normalisation), tanh.approx (softcap).
MUFU_VARIANTS = ("lg2", "rcp", "tanh")
_THREADS = 256


class ProductionError(RuntimeError):
    """Production raised something that is not a documented refusal: an ``error`` verdict."""


class ProductionUnavailable(RuntimeError):
    """The production FA4 package or a CUDA device is missing; the message says which."""


def require_production() -> None:
    """Raise :class:`ProductionUnavailable` unless CUDA and ``flash_attn.cute`` are usable."""
    if not torch.cuda.is_available():
        raise ProductionUnavailable(f"no CUDA device is visible to torch (torch {torch.__version__}); {INSTALL_HINT}")
    _import_dsl()


def _first_line(exc: BaseException) -> str:
    """The compiler's diagnosis in one line: ANSI colours removed, the backend's own reason
    preferred over the DSL's generic header."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
    for line in text.splitlines():
        if "not supported" in line:
            return line.strip().removeprefix("extra log:").strip()
    return " ".join(text.split())[:160]


#: production's persistent compile cache (``flash_attn/cute/cache_utils.py``: read once, when
#: ``flash_attn.cute`` is first imported; directory ``FLASH_ATTENTION_CUTE_DSL_CACHE_DIR``, by
#: default ``/tmp/$USER/flash_attention_cute_dsl_cache``; entries keyed by a hash of production's
#: sources and the cutlass / tvm_ffi versions, written under file locks, so parallel ``--jobs``
#: processes share it).  Off in production by default; on for audits: on the H200 the
#: ``head-dims`` suite with ``--backward`` (128 compile keys, 14 jobs) took 131 s with an empty
#: cache and 71 s with a warm one (docs/h200-results.md).
COMPILE_CACHE_ENV = "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"


def enable_compile_cache() -> str:
    """Turn production's persistent compile cache on unless the user set
    :data:`COMPILE_CACHE_ENV` (``0`` keeps it off); returns the setting in force.  Effective
    only before ``flash_attn.cute`` is first imported in the process (production reads it then)."""
    return os.environ.setdefault(COMPILE_CACHE_ENV, "1")


def _import_dsl():
    """Import the CuTe DSL and the production utils, or raise :class:`ProductionUnavailable`
    (production's compile cache enabled first, :func:`enable_compile_cache`)."""
    enable_compile_cache()
    try:
        import cutlass
        import cutlass.cute as cute
        from cutlass.cute.runtime import from_dlpack
        from flash_attn.cute import utils as fa_utils
    except ImportError as exc:
        raise ProductionUnavailable(f"cannot import the production package ({exc}); {INSTALL_HINT}") from exc
    return cutlass, cute, from_dlpack, fa_utils


def _ex2_launcher(variant: str, degree: int):
    """The ``@cute.jit`` launcher of a kernel applying the production function ``variant``
    elementwise: ``launch(mX, mY, n_blocks)``, 2 elements per thread, 256 threads per block."""
    if variant not in EX2_VARIANTS + MUFU_VARIANTS:
        raise ValueError(f"variant must be one of {EX2_VARIANTS + MUFU_VARIANTS}, got {variant!r}")
    cutlass, cute, _, fa_utils = _import_dsl()

    @cute.kernel
    def _apply(mX: cute.Tensor, mY: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        i = (bidx * _THREADS + tidx) * 2
        x0 = mX[i]
        x1 = mX[i + 1]
        if cutlass.const_expr(variant == "scalar"):
            y0 = fa_utils.ex2_emulation(x0, poly_degree=degree)
            y1 = fa_utils.ex2_emulation(x1, poly_degree=degree)
        elif cutlass.const_expr(variant == "packed"):
            y0, y1 = fa_utils.ex2_emulation_2(x0, x1, poly_degree=degree)
        elif cutlass.const_expr(variant == "lg2"):
            y0 = cute.math.log2(x0, fastmath=True)
            y1 = cute.math.log2(x1, fastmath=True)
        elif cutlass.const_expr(variant == "rcp"):
            y0 = cute.arch.rcp_approx(x0)
            y1 = cute.arch.rcp_approx(x1)
        elif cutlass.const_expr(variant == "tanh"):
            y0 = cute.math.tanh(x0, fastmath=True)
            y1 = cute.math.tanh(x1, fastmath=True)
        else:
            y0 = cute.math.exp2(x0, fastmath=True)
            y1 = cute.math.exp2(x1, fastmath=True)
        mY[i] = y0
        mY[i + 1] = y1

    @cute.jit
    def _launch(mX: cute.Tensor, mY: cute.Tensor, n_blocks: cutlass.Constexpr[int]):
        _apply(mX, mY).launch(grid=[n_blocks, 1, 1], block=[_THREADS, 1, 1])

    return _launch


@functools.cache
def ex2_kernel(variant: str, degree: int = 3) -> Callable[[torch.Tensor], torch.Tensor]:
    """A callable float32 CUDA tensor -> float32 CUDA tensor applying the production device
    function ``variant`` (see module doc) elementwise.  Compiled once per (variant, degree) and
    grid size (the grid is a compile-time constant, so chunks should have one size).

    Raises :class:`ProductionUnavailable`; or, when the production function does not compile
    for this GPU (``packed`` before sm_100), ``NotImplementedError`` on the first call.
    """
    require_production()
    _, cute, from_dlpack, _ = _import_dsl()
    launch = _ex2_launcher(variant, degree)
    compiled = {}
    per_block = 2 * _THREADS

    def run(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or not x.is_cuda:
            raise TypeError(f"x must be a float32 CUDA tensor, got {x.dtype} on {x.device}")
        n = x.numel()
        pad = (-n) % per_block
        xf = x.reshape(-1)
        if pad:
            xf = torch.cat([xf, xf.new_zeros(pad)])
        y = torch.empty_like(xf)
        mx, my = from_dlpack(xf, assumed_align=16), from_dlpack(y, assumed_align=16)
        nb = xf.numel() // per_block
        if nb not in compiled:
            try:
                compiled[nb] = cute.compile(launch, mx, my, nb)
            except Exception as exc:  # the DSL raises its own error types
                if variant == "packed":
                    major, minor = torch.cuda.get_device_capability()
                    cc = f"sm_{major:d}{minor:d}"
                    raise NotImplementedError(
                        f"production ex2_emulation_2 does not compile for this GPU ({cc}): its f32x2 "
                        f"instructions need sm_100+ (compiler: {_first_line(exc)})"
                    ) from exc
                raise
        compiled[nb](mx, my)  # the constexpr grid size is not a runtime argument
        return y[:n].view(x.shape)

    return run


def compile_ex2_ptx(variant: str, degree: int, dump_dir: str) -> str:
    """Compile the ``variant`` kernel without running it and return its PTX text.

    The target is ``CUTE_DSL_ARCH`` (e.g. ``sm_100a``), which, with ``CUTE_DSL_KEEP_PTX=1`` and
    ``CUTE_DSL_DUMP_DIR=dump_dir``, must be set before ``cutlass`` is first imported (the DSL
    reads them then); so call this in a fresh process.  Needs no GPU.
    """
    if not os.environ.get("CUTE_DSL_ARCH") or os.environ.get("CUTE_DSL_DUMP_DIR") != dump_dir:
        raise RuntimeError("set CUTE_DSL_ARCH, CUTE_DSL_KEEP_PTX=1 and CUTE_DSL_DUMP_DIR before importing cutlass")
    _, cute, from_dlpack, _ = _import_dsl()
    pattern = os.path.join(dump_dir, "**", "*.ptx")
    before = {p: os.path.getmtime(p) for p in glob.glob(pattern, recursive=True)}
    x = torch.zeros(2 * _THREADS, dtype=torch.float32)
    y = torch.zeros_like(x)
    cute.compile(_ex2_launcher(variant, degree), from_dlpack(x, assumed_align=16), from_dlpack(y, assumed_align=16), 1)
    # the dump's file name does not encode the kernel body: a later compile overwrites it
    new = sorted(
        (p for p in glob.glob(pattern, recursive=True) if before.get(p) != os.path.getmtime(p)), key=os.path.getmtime
    )
    if not new:
        raise RuntimeError(f"the compiler wrote no PTX into {dump_dir}")
    with open(new[-1]) as fh:
        return fh.read()


def flash_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale=None,
    causal: bool = False,
    window_size=(None, None),
    softcap: float = 0.0,
    learnable_sink=None,
    return_lse: bool = False,
    deterministic: bool = False,
    score_mod=None,
    mask_mod=None,
    aux_tensors=None,
    block_sparse_tensors=None,
    aux_scalars=None,
):
    """The audited-callable adapter of production ``flash_attn.cute.flash_attn_func`` (kernel
    ``fa4``); ``deterministic`` is its flag (the backward's semaphore-ordered dQ).  The mods
    (``score_mod``, ``mask_mod``, ``aux_tensors``, ``block_sparse_tensors``: the contract's
    objects, ``numerics.mods``) are converted by ``fa4.mods.production_kwargs`` into
    production's callables and ``BlockSparseTensorsTorch`` (forward and backward, with
    ``score_mod_bwd``).  Production's meaning of a mask_mod with ``causal`` / a window is its own
    (``_resolve_causal_local_window`` drops the flags in the forward): passed as given, the
    audit's reference (their intersection) surfaces the difference.  An exception that a rule of
    :data:`REFUSALS` predicts from the call's features (:func:`refusal_in_call`) becomes
    :class:`ProductionRefusal`, a ``NotImplementedError`` (verdict ``skipped``); every other
    exception, ``NotImplementedError`` included, propagates as :class:`ProductionError` (verdict
    ``error``): an unknown failure is never a skip, whatever its wording.  (Errors in the backward are raised by
    ``torch.autograd.grad``, outside this call: the runner maps them through the same rules,
    ``audits.engine.backward``.)"""
    require_production()
    from flash_attn.cute import flash_attn_func

    given = dict(
        score_mod=score_mod,
        mask_mod=mask_mod,
        aux_tensors=aux_tensors,
        block_sparse_tensors=block_sparse_tensors,
        aux_scalars=aux_scalars,
    )
    mods = production_kwargs(
        {k_: v_ for k_, v_ in given.items() if v_ is not None}, device=q.device, deterministic=deterministic
    )
    try:
        out, lse = flash_attn_func(
            q,
            k,
            v,
            softmax_scale=softmax_scale,
            causal=causal,
            window_size=tuple(window_size),
            softcap=softcap,
            learnable_sink=learnable_sink,
            return_lse=return_lse,
            deterministic=deterministic,
            **mods,
        )
    except Exception as exc:
        flags = dict(causal=causal, window_size=window_size, softcap=softcap, learnable_sink=learnable_sink)
        match = refusal_in_call(
            exc, q, k, v, backward=_requires_grad(q, k, v), deterministic=deterministic, **flags, **given
        )
        if match is None:
            raise ProductionError(f"flash_attn_func raised {type(exc).__name__}: {exc}") from exc
        raise ProductionRefusal(match.reason(exc)) from exc
    return (out, lse) if return_lse else out


def _requires_grad(*tensors) -> bool:
    """Whether production's forward sees a backward coming (``flash_attn_func``'s autograd
    Function: grad mode on and an input that requires grad)."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


#: The runner's mark of a production adapter: its refusals are these rules only (an unmatched
#: NotImplementedError from production is an error, as in the forward), where a user's kernel
#: refuses by any NotImplementedError (``audits.engine.backward``).
flash_attn.fa4_audit_refusals = REFUSALS
#: ... and how the runner decides one raised outside the adapter (the backward): :func:`refusal_in_call`
flash_attn.fa4_audit_refusal = refusal_in_call
#: Its declared domain (``audits.suites.domain.domain_of`` evaluates it when asked: it depends on the GPU).
flash_attn.fa4_audit_domain = production_domain


#: the varlen keywords production's ``flash_attn_varlen_func`` takes from the contract
_VARLEN_KEYS = (
    "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "seqused_q", "seqused_k", "page_table",
    "num_splits", "pack_gqa",
)  # fmt: skip


#: the mod keywords the varlen adapter takes (block sparsity refused: see flash_attn_varlen)
_VARLEN_MOD_KEYS = ("score_mod", "mask_mod", "aux_tensors", "block_sparse_tensors", "aux_scalars")


def flash_attn_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, return_lse: bool = False, **kw):
    """The varlen-contract adapter (``docs/varlen.md``) of production
    ``flash_attn.cute.flash_attn_varlen_func``: the contract's keywords passed through (the
    forward ones and ``cu_seqlens_q/k``, ``max_seqlen_q/k``, ``seqused_q/k``, ``page_table``,
    ``num_splits``, ``pack_gqa``) and the mods (``score_mod``, ``mask_mod``, ``aux_tensors``,
    ``aux_scalars``, as in :func:`flash_attn`; ``block_sparse_tensors``: one
    ``numerics.mods.BlockSparse`` or None per sequence, converted to production's varlen layout
    by ``fa4.varlen.varlen_block_lists``: ``cu_total_m_blocks``, ``cu_block_idx_offsets``);
    refusals mapped by :data:`REFUSALS` as in :func:`flash_attn` (split-KV on SM90 among them)."""
    require_production()
    from flash_attn.cute import flash_attn_varlen_func

    unknown = sorted(
        set(kw)
        - set(_VARLEN_KEYS)
        - {"softmax_scale", "causal", "window_size", "softcap", "learnable_sink"}
        - set(_VARLEN_MOD_KEYS)
    )
    if unknown:
        raise TypeError(f"flash_attn_varlen: unknown keyword(s) {', '.join(unknown)}")
    if "window_size" in kw:
        kw["window_size"] = tuple(kw["window_size"])
    given = dict(kw)  # the call as the contract gave it: the refusal rules read its features
    # lazy: fa4.varlen loads the forward model and numba (~0.25 s), which importers of these adapters
    # (audits.kernels, the PTX compile subprocesses) otherwise never load
    from fa4.varlen import sequences, varlen_block_lists, varlen_block_sparse

    bsl = kw.pop("block_sparse_tensors", None)
    mods = {n: kw.pop(n) for n in _VARLEN_MOD_KEYS if kw.get(n) is not None}
    if bsl is not None:
        bsl = varlen_block_sparse(bsl)
        if mods.get("mask_mod") is None:  # the blocks' own mask mod, as production_kwargs does for a fixed-length call
            mods["mask_mod"] = next((b.mask_mod for b in bsl if b is not None and b.mask_mod is not None), None)
    kw.update(production_kwargs(mods, device=q.device))
    if bsl is not None:  # production's varlen layout (fa4.varlen.varlen_block_lists): the forward only
        from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

        seqs = sequences(
            q, k, **{n: kw.get(n) for n in ("cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k", "page_table")}
        )
        lens = [(s.q_rows[1] - s.q_rows[0], s.k_index.numel()) for s in seqs]
        lists = varlen_block_lists(bsl, lens, heads=q.shape[-2])
        size = next((tuple(b.block_size) for b in bsl if b is not None), None)
        kw["block_sparse_tensors"] = BlockSparseTensorsTorch(
            **{n: t.to(q.device) for n, t in lists.items()}, block_size=size
        )
    try:
        res = flash_attn_varlen_func(q, k, v, return_lse=return_lse, **kw)
    except Exception as exc:
        match = refusal_in_call(exc, q, k, v, backward=_requires_grad(q, k, v), **given)
        if match is None:
            raise ProductionError(f"flash_attn_varlen_func raised {type(exc).__name__}: {exc}") from exc
        raise ProductionRefusal(match.reason(exc)) from exc
    out, lse = res if isinstance(res, tuple) else (res, None)
    return (out, lse) if return_lse else out


flash_attn_varlen.fa4_audit_refusals = REFUSALS
flash_attn_varlen.fa4_audit_refusal = refusal_in_call
flash_attn_varlen.fa4_audit_contract = "varlen"
