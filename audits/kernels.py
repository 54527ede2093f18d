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
  as peers (their adapters: ``audits.peers``).  SDPA has no softcap, sink, fp8 or LSE output:
  the first three are outside its declared domain (the runner skips them before calling); what
  a domain cannot say raises ``NotImplementedError`` at run time (rows with no visible key: SDPA
  gives NaN there where FA's convention is 0; bottom-right causal masks on flash and cudnn;
  efficient and cudnn off CUDA, ``audits.peers.sdpa_unavailable``), and ``return_lse`` yields
  ``None``.
* ``flex``: PyTorch's ``flex_attention`` as a peer (compiled on CUDA, eager and forward-only on
  the CPU), with the mods (``numerics.mods``) in flex's own form; no sink, no fp8.
* ``MODEL:knob=value[,knob=value...]``, MODEL one of the models above: that model with
  ``FA4Numerics`` fields set after production's choice for the call (:data:`VARIANT_KNOBS`, e.g.
  ``fa4-model:poly_degree=5``): a variant to gate, judged as its model is and bounded with its
  own numerics (:func:`model_overrides`).
* ``fa4@DIR``: production FA4 from another installation, a release installed with ``pip
  install --no-deps --target DIR flash-attn-4==VERSION``; called only in a worker process, which
  puts DIR first on ``sys.path`` before it imports ``flash_attn`` (the audit's own process never
  imports it: arch and domain are this GPU's, as for ``fa4``); :func:`kernel_versions` names its
  release without importing it.
* ``module:attr`` or ``path/to/file.py:fn``: any callable with that signature.

Each built-in declares its domain (``fn.fa4_audit_domain``, ``audits.suites.domain``): production's per
GPU architecture (``fa4.refusals.production_domain``), the models' (``_MODEL_DOMAINS``),
SDPA's per backend and flex's (``audits.peers``).  What a kernel must return: ``audits.contract``.

``fa4_numerics(name)`` says which ``FA4Numerics`` family a kernel implements, so the runner
can hold it to ``numerics.forward_bound``; None for the peers.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import math
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from audits.common import UsageError
from audits.peers import flex, sdpa
from audits.suites.domain import Domain, DomainError, domain_of
from fa4.ex2 import DEGREES
from fa4.knobs import SUPPORTED_DTYPES, FA4Numerics
from fa4.production import ProductionUnavailable, flash_attn, flash_attn_varlen, require_production
from fa4.refusals import REFUSALS, production_domain, production_version, refusal_in_call
from fa4.releases import release_note

__all__ = [
    "KERNELS",
    "MODELS",
    "get_kernel",
    "kernel_domain",
    "portable_spec",
    "fa4_numerics",
    "fa4_arch",
    "FA4_NUMERICS_ARCHS",
    "production_arch",
    "cuda_arch",
    "arch_of_capability",
    "claims_nonfinite_inputs",
    "VARLEN_KERNELS",
    "get_varlen_kernel",
    "per_sequence",
    "fa4_varlen_numerics",
    "fa4_varlen_splits",
    "usable_kernels",
    "VARIANT_KNOBS",
    "model_overrides",
    "base_kernel",
    "release_dir",
    "kernel_versions",
    "enter_worker_process",
]


#: the models by name: (FA4Numerics family, its ``mma``)
MODELS = {
    "fa4-model": ("sm100", "exact"),
    "fa4-model-sm90": ("sm90", "exact"),
    "fa4-model-sm90-tc": ("sm90", "tensor_core"),
}


def _model_of(arch: str, mma: str = "exact", overrides: dict | None = None):
    """The model with production's ``arch`` numerics for the inputs and MMA summation ``mma``;
    ``deterministic`` is production's flag (the backward's semaphore-ordered dQ:
    ``FA4Numerics.bwd_deterministic``); ``overrides``: the fields a variant sets over production's
    choice (:func:`model_overrides`)."""

    def run(q, k, v, *, causal=False, window_size=(None, None), return_lse=False, deterministic=False, **kw):
        from fa4.model import attention  # lazy: fa4.model loads numba (~0.2 s)

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
        nm = dataclasses.replace(nm, **{"bwd_deterministic": bool(deterministic), "mma": mma, **(overrides or {})})
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
#: per GPU architecture, evaluated when asked (fa4.refusals.production_domain cites the source)
_production.fa4_audit_domain = production_domain


KERNELS: dict[str, Callable] = {
    "fa4": _production,
    **{name: _model_of(*family) for name, family in MODELS.items()},
    "sdpa-math": sdpa("math"),
    "sdpa-flash": sdpa("flash"),
    "sdpa-efficient": sdpa("efficient"),
    "sdpa-cudnn": sdpa("cudnn"),
    "flex": flex,
}


# ---- model variants: MODEL:knob=value[,knob=value...] ----------------------------------------


def _integer(lo: int, choices: tuple[int, ...] = (), step: int = 1) -> tuple[Callable[[str], int], str]:
    def parse(text: str) -> int:
        v = int(text)
        if v < lo or v % step or (choices and v not in choices):
            raise ValueError(text)
        return v

    if choices:
        return parse, "one of " + ", ".join(map(str, choices))
    return parse, f"a positive multiple of {step}" if step > 1 else f"an integer >= {lo}"


def _number() -> tuple[Callable[[str], float], str]:
    def parse(text: str) -> float:
        v = float(text)
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(text)
        return v

    return parse, "a finite number >= 0"


def _word(*words: str) -> tuple[Callable[[str], str], str]:
    def parse(text: str) -> str:
        if text not in words:
            raise ValueError(text)
        return text

    return parse, "one of " + ", ".join(words)


def _dtype() -> tuple[Callable[[str], torch.dtype], str]:
    names = {str(d).removeprefix("torch."): d for d in SUPPORTED_DTYPES}  # what FA4Numerics takes
    return (lambda text: names[text]), "one of " + ", ".join(names)


#: The knobs a model variant sets (``fa4-model:knob=value,...``): ``FA4Numerics`` fields
#: (``fa4.knobs`` says what each means), each with its parser and the values it accepts; the
#: variant's numerics are checked by ``FA4Numerics`` itself too (e.g. tile_n a multiple of 8).
#: The arch is the model's, the backward's deterministic flag the call's.
VARIANT_KNOBS: dict[str, tuple[Callable[[str], object], str]] = {
    "poly_degree": _integer(1, DEGREES),
    "rescale_threshold": _number(),
    "max_offset": _integer(0),
    "tile_m": _integer(1),
    "tile_n": _integer(8, step=8),
    "exp2": _word("mixed", "emulated", "hardware"),
    "emu_freq": _integer(0),
    "emu_res": _integer(0),
    "emu_start_frg": _integer(0),
    "p_dtype": _dtype(),
    "ds_dtype": _dtype(),
    "bwd_tile_m": _integer(1),
    "bwd_tile_n": _integer(1),
    "masked_exp2": _word("same", "hardware"),
    "mma": _word("exact", "tensor_core"),
}


def _variant_parts(spec: str) -> tuple[str, str] | None:
    """(model, knobs text) of a variant ``MODEL:knobs`` (the part before ':' a model's name:
    never ``module:attr``), None for any other kernel."""
    model, sep, knobs = spec.partition(":")
    return (model, knobs) if sep and model in MODELS else None


@functools.cache
def _parse_variant(spec: str) -> tuple[str, tuple[tuple[str, object], ...]]:
    """(model, its overrides in the order given) of variant ``spec``, checked whole before any
    case runs; ValueError naming the knob or value and what is accepted."""
    model, text = _variant_parts(spec)
    form = f"{model}:knob=value[,knob=value...]"
    overrides: dict[str, object] = {}
    for item in text.split(","):
        name, eq, value = (x.strip() for x in item.partition("="))
        if not eq or not name or not value:
            raise ValueError(f"kernel {spec!r}: {item!r} is not knob=value (a model variant is {form})")
        if name not in VARIANT_KNOBS:
            raise ValueError(f"kernel {spec!r}: unknown knob {name!r}; accepted knobs: {', '.join(VARIANT_KNOBS)}")
        if name in overrides:
            raise ValueError(f"kernel {spec!r}: knob {name!r} given twice")
        parse, accepted = VARIANT_KNOBS[name]
        try:
            overrides[name] = parse(value)
        except (ValueError, KeyError):
            raise ValueError(f"kernel {spec!r}: {name}={value}: expected {accepted}") from None
    arch, mma = MODELS[model]
    try:  # FA4Numerics' own checks, on the model's defaults
        dataclasses.replace(FA4Numerics(arch=arch, mma=mma), **overrides)
    except ValueError as exc:
        raise ValueError(f"kernel {spec!r}: {exc}") from None
    return model, tuple(overrides.items())


def model_overrides(spec: str) -> dict:
    """The ``FA4Numerics`` fields model variant ``spec`` (``MODEL:knob=value,...``) sets over
    production's choice for each call: what its calls run with, and what its bound must analyse
    (``audits.engine.evaluate``); {} for any other kernel.  ValueError for a malformed variant."""
    return {} if _variant_parts(spec) is None else dict(_parse_variant(spec)[1])


def base_kernel(spec: str) -> str:
    """The built-in kernel ``spec`` stands for: a variant's model, ``fa4`` for ``fa4@DIR``,
    else ``spec`` itself.  What holds for a built-in by name holds for these: a variant is judged
    and run as its model, ``fa4@DIR`` as production.  Reads the name only (no check)."""
    if spec.startswith(_RELEASE):
        return "fa4"
    parts = _variant_parts(spec)
    return spec if parts is None else parts[0]


@functools.cache
def _variant_kernel(spec: str, varlen: bool) -> Callable:
    """Variant ``spec``'s fixed-length kernel or (``varlen``) its varlen entry: one object per
    spec, so that a caller can tell a built-in's entry by identity (``audits.engine.worker``)."""
    model, overrides = _parse_variant(spec)
    return (_model_varlen if varlen else _model_of)(*MODELS[model], dict(overrides))


# ---- production from another installation: fa4@DIR -------------------------------------------

_RELEASE = "fa4@"
#: whether this process is a kernel worker (``enter_worker_process``)
_IN_WORKER = False


def release_dir(spec: str) -> Path | None:
    """DIR of a kernel ``fa4@DIR``, resolved (absolute, links followed); None for any other kernel."""
    return Path(spec[len(_RELEASE) :]).resolve() if spec.startswith(_RELEASE) else None


def _release_dist(spec: str) -> Path:
    """The flash-attn-4 dist-info of ``fa4@DIR``'s DIR, once DIR is checked to hold one release:
    the directory, production's ``flash_attn/cute/interface.py`` and exactly one
    ``flash_attn_4-*.dist-info``; ValueError naming DIR, what is missing and how to install it."""
    if spec == _RELEASE:
        raise ValueError(
            "kernel 'fa4@': no directory after '@' (fa4@DIR, DIR made with: pip install --no-deps --target DIR "
            "flash-attn-4==VERSION)"
        )
    root = release_dir(spec)
    fix = f"install one release there with: pip install --no-deps --target {root} flash-attn-4==VERSION"
    if not root.is_dir():
        what = "is not a directory" if root.exists() else "does not exist"
        raise ValueError(f"kernel {spec!r}: {root} {what}; {fix}")
    if not (root / "flash_attn" / "cute" / "interface.py").is_file():
        raise ValueError(f"kernel {spec!r}: {root} holds no flash_attn/cute/interface.py (production's code); {fix}")
    dists = sorted(root.glob("flash_attn_4-*.dist-info"))
    if len(dists) != 1:
        what = (
            f"{len(dists)} flash_attn_4-*.dist-info ({', '.join(d.name for d in dists)}): one release per directory"
            if dists
            else "no flash_attn_4-*.dist-info (the release's metadata)"
        )
        raise ValueError(f"kernel {spec!r}: {root} holds {what}; {fix}")
    return dists[0]


def _dist_version(dist: Path) -> str:
    """The version a dist-info records: its METADATA's ``Version:``, else the one its name carries."""
    try:
        for line in (dist / "METADATA").read_text(errors="replace").splitlines():
            if not line.strip():
                break  # the headers end at the first blank line
            if line.startswith("Version:"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return dist.name.removesuffix(".dist-info").partition("-")[2]


def kernel_versions(spec: str) -> dict[str, str | None] | None:
    """The production packages kernel ``spec`` runs, by distribution, read without importing
    them: for ``fa4@DIR`` the flash-attn-4 release in DIR (and the nvidia-cutlass-dsl DIR holds,
    if any: the worker imports that one too), for ``fa4`` the release installed here (None: none);
    None for any other kernel.  Each kernel's report names its own release
    (``audits.report.header.kernel_environment``).  ValueError for a DIR without one release."""
    if spec == "fa4":
        return {"flash-attn-4": production_version()}
    if release_dir(spec) is None:
        return None
    found: dict[str, str | None] = {"flash-attn-4": _dist_version(_release_dist(spec))}
    cutlass = sorted(release_dir(spec).glob("nvidia_cutlass_dsl-*.dist-info"))
    if len(cutlass) == 1:
        found["nvidia-cutlass-dsl"] = _dist_version(cutlass[0])
    return found


def enter_worker_process() -> None:
    """Mark this process as a kernel worker (``audits.engine.worker.serve`` does so first): only
    there does an ``fa4@DIR`` kernel put DIR on ``sys.path`` and import its ``flash_attn``."""
    global _IN_WORKER
    _IN_WORKER = True


def _use_release(spec: str, root: Path) -> None:
    """Make DIR's release this process's ``flash_attn``: DIR first on ``sys.path`` before
    ``flash_attn.cute`` is imported, so that the import, ``importlib.metadata`` (the refusal
    rules' release, ``fa4.refusals.production_version``) and the compile cache's key all see
    DIR's.  RuntimeError outside a worker, or when this process's ``flash_attn.cute`` is not
    DIR's (imported before, or shadowed by a regular ``flash_attn`` package earlier on the path)."""
    if not _IN_WORKER:
        raise RuntimeError(
            f"kernel {spec!r} runs only in a worker process, which imports flash_attn from {root}; the audit's own "
            "process never does: drop --no-isolate (run), or give --timeout SECONDS"
        )
    loaded = sys.modules.get("flash_attn.cute")
    if loaded is None:
        if sys.path[:1] != [str(root)]:
            sys.path.insert(0, str(root))
            importlib.invalidate_caches()
        found = importlib.util.find_spec("flash_attn.cute")
        where = None if found is None else found.origin
    else:
        where = getattr(loaded, "__file__", None)
    if where is None or not Path(where).resolve().is_relative_to(root):
        raise RuntimeError(
            f"kernel {spec!r}: this process's flash_attn.cute is {where}, not {root}'s (imported before {root} was "
            "put first on sys.path, or a flash_attn package with an __init__.py elsewhere on the path shadows it)"
        )


@functools.cache
def _release_kernel(spec: str, varlen: bool) -> Callable:
    """``fa4@DIR``'s fixed-length kernel or (``varlen``) varlen entry: production's adapter
    behind :func:`_use_release`, with production's refusal rules, domain and arch (this GPU's)."""
    entry = _production_varlen if varlen else _production
    root = release_dir(spec)

    def run(q, k, v, **kw):
        _use_release(spec, root)
        return entry(q, k, v, **kw)

    run.__name__ = f"{entry.__name__}_at_{root.name}"
    for attr in ("fa4_audit_refusals", "fa4_audit_refusal", "fa4_audit_domain", "fa4_audit_arch", "fa4_audit_contract"):
        if hasattr(entry, attr):
            setattr(run, attr, getattr(entry, attr))
    run.fa4_audit_release = root
    return run


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
    numerics (held to the forward-pass bound), a variant's with its overrides; None for the others."""
    arch = fa4_arch(name)
    if arch is None:
        return None
    over = model_overrides(name)
    return lambda q, k, v, causal, window: dataclasses.replace(
        FA4Numerics.for_inputs(arch, q, k, v, causal, window), **over
    )


#: what a user kernel may declare as ``fn.fa4_audit_numerics``: it implements FA4's numerics of
#: that architecture (production's per-call tables: tiles, lazy rescaling, exp2), so it is held
#: to FA4's per-element bound rather than a peer's generic one (a fork of FA4, a wrapper of the
#: model); the FA4Numerics families
FA4_NUMERICS_ARCHS = ("sm90", "sm100")


def fa4_arch(name: str) -> str | None:
    """The FA4Numerics family of a built-in FA4 kernel (production, ``fa4@DIR`` included: this
    machine's GPU's; a variant: its model's), or of a user kernel that declares one
    (``fn.fa4_audit_numerics``, :data:`FA4_NUMERICS_ARCHS`; anything else there is a ValueError)."""
    base = base_kernel(name)
    if base == "fa4":  # on this machine's GPU generation
        return production_arch()
    if base in MODELS:
        return MODELS[base][0]
    if base in KERNELS or ":" not in base:
        return None
    arch = getattr(get_kernel(base), "fa4_audit_numerics", None)
    if arch is not None and arch not in FA4_NUMERICS_ARCHS:
        raise ValueError(
            f"kernel {name!r}: fa4_audit_numerics = {arch!r}; accepted: {', '.join(FA4_NUMERICS_ARCHS)} (the FA4 "
            "numerics it implements), or leave it unset to be judged as a generic flash-attention kernel"
        )
    return arch


def fa4_varlen_numerics(name: str):
    """Callable (q, k, v, causal, window, *, num_splits, page_size, pack_gqa, max_seqlen_q,
    block_sparse=None) -> the FA4Numerics of one sequence (batch-1 tensors) of a varlen call with
    packed queries, as the kernel's varlen entry chooses them (``fa4.varlen``: SM100 without
    2-CTA for packed queries, splits and pages other than 128; tiles from ``max_seqlen_q``; the
    interleave of packed GQA; tiles fitted to a sparse block); ``page_size`` 0: no page table;
    ``pack_gqa`` None: the default (on for GQA); a variant's overrides on top.  None for kernels
    that do not implement FA4's numerics."""
    from fa4.varlen import packs_gqa, sequence_numerics  # lazy: fa4.varlen loads fa4.model (numba)

    arch = fa4_arch(name)
    if arch is None:
        return None
    over = model_overrides(name)

    def nm(q, k, v, causal, window, *, num_splits: int, page_size: int, pack_gqa, max_seqlen_q: int, block_sparse=None):
        pack = packs_gqa(pack_gqa, q.shape[2], k.shape[2])
        seq = sequence_numerics(
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
        return dataclasses.replace(seq, **over)

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
    sms = torch.cuda.get_device_properties(0).multi_processor_count if base_kernel(name) == "fa4" else 148
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
        raise ValueError(
            f"unknown kernel {spec!r}; accepted: {', '.join(KERNELS)}, MODEL:knob=value[,...] (a model variant), "
            "fa4@DIR (production from DIR), module:attr or path/to/file.py:fn"
        )
    return mod, attr


def get_kernel(spec: str) -> Callable:
    """A kernel by name, a model variant (``MODEL:knob=value,...``), ``fa4@DIR`` (DIR checked,
    nothing imported from it), ``module:attr`` (importable from the current directory or
    sys.path) or ``path/to/file.py:fn`` (any directory); ``ValueError`` naming what was wrong and
    what is accepted."""
    if spec in KERNELS:
        return KERNELS[spec]
    if spec.startswith(_RELEASE):
        _release_dist(spec)
        return _release_kernel(spec, False)
    if _variant_parts(spec) is not None:
        return _variant_kernel(spec, False)
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
    ``module:attr`` and relative file paths as the absolute path of the module's file, DIR of
    ``fa4@DIR`` absolute."""
    if spec in KERNELS:
        return spec
    get_kernel(spec)  # loads it, or says why not
    if spec.startswith(_RELEASE):
        return f"{_RELEASE}{release_dir(spec)}"
    if _variant_parts(spec) is not None:
        return spec
    mod, attr = _split_spec(spec)
    if mod.endswith(".py"):
        return f"{Path(mod).resolve()}:{attr}"
    f = getattr(sys.modules[mod], "__file__", None)
    return f"{Path(f).resolve()}:{attr}" if f else spec


def usable_kernels(specs: list[str], *, domains: bool = True) -> list[str]:
    """The kernels named (duplicates dropped), each loadable, the production kernel only where
    it can run, and (``domains``) each declaring a well-formed domain: otherwise a ``UsageError``
    (exit 2, with the install hint), never an error verdict per case.  ``domains=False`` where
    the caller resolves the domains next (the case selection, which reports a malformed one alike).
    ``fa4@DIR``: DIR holds one release (nothing imported from it here), CUDA is visible, and no
    two such kernels share DIR's name (each kernel's report directory, ``audits.engine.run.kernel_dir``).
    A production release outside the verified ones (``fa4.releases.release_note``) is said on stderr."""
    kernels = list(dict.fromkeys(specs))
    for kern in kernels:
        try:
            get_kernel(kern)
            if ":" in kern and base_kernel(kern) == kern:  # a user kernel: its fa4_audit_numerics, if any
                fa4_arch(kern)
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
    if "fa4" in kernels:
        try:
            require_production()
        except ProductionUnavailable as exc:
            raise UsageError(f"--kernel fa4 is the production kernel, which cannot run here: {exc}") from exc
    _usable_releases([k for k in kernels if release_dir(k) is not None])
    for kern in kernels if domains else ():  # a malformed declaration is a usage error before any case runs
        try:
            kernel_domain(kern)
        except DomainError as exc:
            raise UsageError(str(exc)) from exc
    for kern in kernels:
        if base_kernel(kern) == "fa4" and (note := release_note((kernel_versions(kern) or {}).get("flash-attn-4"))):
            print(f"{kern}: note: {note}", file=sys.stderr)
    return kernels


def _usable_releases(specs: list[str]) -> None:
    """``fa4@DIR`` kernels can run here (CUDA) and have report directories of their own."""
    if specs and not torch.cuda.is_available():
        raise UsageError(
            f"--kernel {specs[0]} is production FA4, which cannot run here: no CUDA device is visible to torch "
            f"(torch {torch.__version__})"
        )
    named: dict[str, str] = {}
    for spec in specs:
        name = release_dir(spec).name
        if name in named:
            same = release_dir(named[name]) == release_dir(spec)
            raise UsageError(
                f"kernels {named[name]} and {spec}: "
                + ("the same directory twice: name it once" if same else f"two directories named {name!r}")
                + f", whose reports would share OUT/fa4@{name}: give each release a directory of its own name"
            )
        named[name] = spec


def kernel_domain(spec: str) -> Domain:
    """The domain the kernel ``spec`` declares (``audits.suites.domain.domain_of``; production's for
    this machine's GPU), resolved now: the runner resolves it once per kernel and run."""
    return domain_of(get_kernel(spec))


# ---- the varlen contract (docs/varlen.md) ----------------------------------------------------


def _model_varlen(arch: str, mma: str = "exact", overrides: dict | None = None) -> Callable:
    def run(q, k, v, **kw):
        from fa4.varlen import varlen_attention  # lazy: numba

        if arch == "sm90" and q.dtype.itemsize == 1:
            raise NotImplementedError("the SM90 path supports only bf16 and fp16 (flash_fwd.py _check_type)")
        return varlen_attention(q, k, v, arch=arch, mma=mma, overrides=overrides, **kw)

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
    """The varlen entry of kernel ``spec``: the built-ins' (:data:`VARLEN_KERNELS`; a variant's
    and ``fa4@DIR``'s alike), or a user callable that declares the varlen contract
    (``fn.fa4_audit_contract = "varlen"``); None for a fixed-length kernel (audited on varlen cases
    only per sequence, when asked)."""
    if spec in VARLEN_KERNELS:
        return VARLEN_KERNELS[spec]
    if spec in KERNELS:
        return None
    if spec.startswith(_RELEASE):
        _release_dist(spec)
        return _release_kernel(spec, True)
    if _variant_parts(spec) is not None:
        return _variant_kernel(spec, True)
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
