"""Compile production's SM100 forward kernel (``FlashAttentionForwardSm100``), or its backward
kernels (``--backward``), to sm_100a PTX without a Blackwell GPU — and, opt-in, without any GPU.

Production decides everything: ``flash_attn.cute.flash_attn_func`` is called on torch
FakeTensors on device ``cuda`` under ``FakeTensorMode``.  ``interface._flash_attn_fwd``
recognises fake mode (``testing.is_fake_mode``), skips its ``is_cuda`` check and the launch, and
only compiles — so tile sizes, q_stage, 2-CTA, pack_gqa and the exp2 interleave are production's
own choices for that call.  ``CUTE_DSL_ARCH=sm_100a`` sets the target, ``FLASH_ATTENTION_ARCH
=sm_100`` the code path, ``CUTE_DSL_KEEP_PTX=1`` / ``CUTE_DSL_DUMP_DIR`` keep the PTX.

Without a GPU (``--no-driver``) one more thing is needed: ``cutlass.utils.HardwareInfo`` asks
the CUDA driver for the SM count (``tile_scheduler.py`` ``StaticPersistentTileScheduler
.get_grid_shape``, host-side grid size ``min(#SMs, #tiles)``).  It is replaced by a stand-in
answering ``FLASH_ATTENTION_NUM_SMS`` (148, B200).  That changes no device code: compiling with
132 and 148 SMs gave byte-identical PTX (2026-11-29, flash-attn-4 4.0.0b36, cutlass-dsl 4.8.1).

The backward (``--backward``): ``interface._flash_attn_bwd`` on FakeTensors with the arguments
``interface.FlashAttnFunc.backward`` passes for that ``flash_attn_func`` call when only ``out``
receives a gradient (``softmax_scale`` None, ``deterministic`` False, ``dlse`` None: the forward
sets ``ctx.set_materialize_grads(False)``), so tiles, 2-CTA and the head-dim-256 kernel are
production's choices.  ``torch.autograd.grad`` itself cannot run here: torch's CPU build aborts
creating the gradient accumulator of a fake CUDA leaf ("PyTorch is not linked with support for
cuda devices").  One call compiles several kernels — ``FlashAttentionBackwardPreprocess``, the
main kernel (``FlashAttentionBackwardSm100``, or ``BlackwellFusedMultiHeadAttentionBackward`` for
(256, 256)) and one ``FlashAttentionBackwardPostprocess`` per distinct postprocess (dQ; dK / dV
with GQA) — and the dump's file name is the same for two postprocesses, so each compile's PTX is
taken from the dump as soon as that compile returns (``_capture_compiles``); OUT.ptx holds them
all, each after a ``// fa4-audit kernel: CLASS`` line.

One compile per process: the DSL reads its target when first imported and the dump's file name
does not encode the whole configuration.  Run as::

    python -m fa4.sm100_compile CONFIG_JSON OUT.ptx [--no-driver] [--backward]

CONFIG_JSON: {"dtype": "bfloat16", "d": 128, "dv": 128, "batch": 1, "heads_q": 2, "heads_kv":
2, "seqlen_q": 128, "seqlen_k": 128, "causal": false, "window": [null, null], "softcap": 0.0,
"sink": false} (an ``audits.suites.cases.Case`` as a dict; its mod keys ``score_mod``, ``mask_mod``,
``block_sparse``, present only when set, are built as the audit's calls build them and passed on
as FakeTensors: ``_real_mods``, ``_fake_mods``).  Writes OUT.ptx and OUT.ptx.json (what
production chose: kernel class, its attributes and, read after the compile, its ``mods``
(``MOD_ATTRIBUTES``); for the backward also ``kernels``, every compiled object in order).
Exit 3 when production refuses the configuration (message on stderr), 1 on any other failure.
"""

import glob
import json
import os
import shutil
import sys
import tempfile

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fa4.mods import build_mods, production_kwargs
from fa4.refusals import refusal_of

__all__ = ["main", "KERNEL_MARK", "AUX_KERNELS", "MOD_ATTRIBUTES"]

REFUSED = 3
#: the line before each kernel's PTX in a backward OUT.ptx
KERNEL_MARK = "// fa4-audit kernel: "
#: the backward's helper kernels (``flash_bwd_preprocess.py``, ``flash_bwd_postprocess.py``)
AUX_KERNELS = ("FlashAttentionBackwardPreprocess", "FlashAttentionBackwardPostprocess")


def _stub_hardware_info() -> None:
    import cutlass.utils
    import cutlass.utils.hardware_info as hwi

    class HostGridHardwareInfo:
        """Stand-in for ``cutlass.utils.HardwareInfo`` (needs libcuda): only the SM count, which
        sizes the host-side launch grid, is answered."""

        def __init__(self, device_id: int = 0):
            self.device_id = device_id

        def get_device_multiprocessor_count(self) -> int:
            return int(os.environ["FLASH_ATTENTION_NUM_SMS"])

        def get_max_active_clusters(self, cluster_size, stream=None):
            raise RuntimeError("get_max_active_clusters needs the CUDA driver (not reached by the forward pass)")

    cutlass.utils.HardwareInfo = HostGridHardwareInfo
    hwi.HardwareInfo = HostGridHardwareInfo
    from flash_attn.cute import tile_scheduler

    tile_scheduler.HardwareInfo = HostGridHardwareInfo


def _configure_environment(dump: str) -> None:
    """Target sm_100a / the SM100 code path and keep the PTX in ``dump`` (before the DSL is imported)."""
    os.environ.update(
        CUTE_DSL_ARCH="sm_100a",
        FLASH_ATTENTION_ARCH="sm_100",
        CUTE_DSL_KEEP_PTX="1",
        CUTE_DSL_DUMP_DIR=dump,
        CUTE_DSL_DISABLE_FILE_CACHING="1",
        FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED="0",
    )
    os.environ.setdefault("FLASH_ATTENTION_NUM_SMS", "148")


def _take_ptx(dump: str) -> str | None:
    """The PTX files the DSL has written into ``dump`` (oldest first, concatenated), removed from it."""
    paths = sorted(glob.glob(os.path.join(dump, "**", "*.ptx"), recursive=True), key=os.path.getmtime)
    texts = []
    for p in paths:
        with open(p) as fh:
            texts.append(fh.read())
        os.remove(p)
    return "".join(texts) or None


#: the kernel attributes that record a compile's mods (``FlashAttentionForwardSm100.__init__`` /
#: ``__call__``, ``FlashAttentionBackwardSm100.__init__`` / ``__call__``), read after the compile
MOD_ATTRIBUTES = ("score_mod", "score_mod_bwd", "mask_mod", "use_block_sparsity", "has_aux_tensors")


def _mod_attributes(obj) -> dict:
    """The mod attributes a compiled object holds (:data:`MOD_ATTRIBUTES`, after its compile,
    when ``use_block_sparsity`` is set): a callable by its ``__name__`` (the library forms'
    names, ``fa4.mods``; production's softcap ``scoremod_premask_fn``), None, or a scalar."""
    got = {}
    for name in MOD_ATTRIBUTES:
        if name in vars(obj):
            v = vars(obj)[name]
            got[name] = v if v is None or isinstance(v, (bool, int)) else getattr(v, "__name__", type(v).__name__)
    return got


def _capture_compiles(interface, dump: str) -> list[dict]:
    """Wrap ``interface.cute.compile`` (passing through unchanged): for each object production
    compiles, in order, its class, scalar attributes and the PTX the compile dumped."""
    compiled = []
    compile_og = interface.cute.compile

    def record(*args, **kw):
        obj = args[0]
        entry = {
            "kernel_class": type(obj).__name__,
            "attributes": {k: v for k, v in vars(obj).items() if isinstance(v, (bool, int, float, str, type(None)))},
        }
        compiled.append(entry)
        try:
            return compile_og(*args, **kw)
        finally:
            entry["ptx"] = _take_ptx(dump)
            entry["mods"] = _mod_attributes(obj)

    interface.cute.compile = record
    return compiled


def _fake_inputs(cfg: dict) -> tuple:
    """q, k, v and the learnable sink (or None) shaped by ``cfg``, on device cuda (call inside a FakeTensorMode)."""
    dt = getattr(torch, cfg["dtype"])
    b, sq, sk, hq, hk = cfg["batch"], cfg["seqlen_q"], cfg["seqlen_k"], cfg["heads_q"], cfg["heads_kv"]
    q = torch.empty(b, sq, hq, cfg["d"], dtype=dt, device="cuda")
    k = torch.empty(b, sk, hk, cfg["d"], dtype=dt, device="cuda")
    v = torch.empty(b, sk, hk, cfg["dv"], dtype=dt, device="cuda")
    sink = torch.empty(hq, dtype=torch.float32, device="cuda") if cfg["sink"] else None
    return q, k, v, sink


def _real_mods(cfg: dict) -> dict:
    """Production's mod keywords for ``cfg``'s library mods (keys ``score_mod``, ``mask_mod``,
    ``block_sparse``, present only when set: ``audits.suites.cases.Case.as_dict``), built on the CPU
    exactly as the audit's calls build them (``fa4.mods.build_mods`` with the case's batch, heads,
    lengths and seed, then ``fa4.mods.production_kwargs``): ``score_mod`` / ``score_mod_bwd``,
    ``mask_mod``, ``aux_tensors``, ``aux_scalars``, ``block_sparse_tensors`` /
    ``block_sparse_tensors_bwd``; {} without mods.  Call after the DSL's environment is set (the forms import it)."""
    names = {k: cfg[k] for k in ("score_mod", "mask_mod") if cfg.get(k)}
    if cfg.get("block_sparse"):
        names["block_sparse"] = tuple(cfg["block_sparse"])
    if not names:
        return {}

    kw = build_mods(
        **names,
        batch=cfg["batch"],
        heads_q=cfg["heads_q"],
        seqlen_q=cfg["seqlen_q"],
        seqlen_k=cfg["seqlen_k"],
        seed=cfg.get("seed", 0),
    )
    return production_kwargs(kw)


def _fake_like(t):
    """A FakeTensor on device cuda of ``t``'s shape, stride and dtype (inside a FakeTensorMode)."""
    return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="cuda")


def _fake_mods(mods: dict) -> dict:
    """``mods`` (:func:`_real_mods`) with every tensor — each aux tensor, each tensor field of a
    ``BlockSparseTensorsTorch`` — replaced by a FakeTensor like it (call inside the FakeTensorMode
    that makes q, k, v): production compiles on shapes, strides and dtypes, and launches nothing."""
    out = dict(mods)
    if out.get("aux_tensors") is not None:
        out["aux_tensors"] = [_fake_like(t) for t in out["aux_tensors"]]
    for key in ("block_sparse_tensors", "block_sparse_tensors_bwd"):
        bs = out.get(key)
        if bs is not None:  # a NamedTuple (block_sparsity.BlockSparseTensorsTorch)
            out[key] = bs._replace(**{f: _fake_like(v) for f, v in bs._asdict().items() if isinstance(v, torch.Tensor)})
    return out


def _call_on_fake_tensors(fa, cfg: dict, mods: dict) -> Exception | None:
    """``flash_attn_func`` on FakeTensors shaped by ``cfg``, with ``mods`` (:func:`_real_mods`:
    every keyword of them, as ``fa4.production.flash_attn`` passes them); the exception it raised,
    if any."""
    kw = dict(causal=cfg["causal"], window_size=tuple(cfg["window"]), softcap=cfg["softcap"], return_lse=True)
    with FakeTensorMode():
        q, k, v, sink = _fake_inputs(cfg)
        if sink is not None:
            kw["learnable_sink"] = sink
        try:
            fa.flash_attn_func(q, k, v, **kw, **_fake_mods(mods))
        except Exception as exc:  # launch failures are expected on a non-Blackwell GPU
            return exc
    return None


def _call_backward_on_fake_tensors(interface, cfg: dict, mods: dict) -> Exception | None:
    """``interface._flash_attn_bwd`` on FakeTensors as ``interface.FlashAttnFunc.backward`` calls
    it for ``flash_attn_func(q, k, v, causal, window_size, softcap, learnable_sink, **mods)`` with a
    gradient on ``out`` only: the mods as the forward's context keeps them (score_mod,
    score_mod_bwd, mask_mod, the saved aux tensors, aux_scalars, ``block_sparse_tensors`` = the
    call's ``block_sparse_tensors_bwd``); the exception it raised, if any."""
    with FakeTensorMode():
        q, k, v, sink = _fake_inputs(cfg)
        out = torch.empty(*q.shape[:-1], cfg["dv"], dtype=q.dtype, device="cuda")
        lse = torch.empty(cfg["batch"], cfg["heads_q"], cfg["seqlen_q"], dtype=torch.float32, device="cuda")
        window = tuple(cfg["window"])
        fm = _fake_mods(mods)
        bwd_mods = {k: fm.get(k) for k in ("score_mod", "score_mod_bwd", "mask_mod", "aux_tensors", "aux_scalars")}
        try:
            interface._flash_attn_bwd(
                q,
                k,
                v,
                out,
                torch.empty_like(out),
                lse,
                None,
                cfg["causal"],
                cfg["softcap"],
                window_size_left=window[0],
                window_size_right=window[1],
                deterministic=False,
                **bwd_mods,
                block_sparse_tensors=fm.get("block_sparse_tensors_bwd"),
                learnable_sink=sink,
            )
        except Exception as exc:
            return exc
    return None


def _no_ptx(err: Exception | None, dump: str) -> int:
    """No kernel PTX was written: say why on stderr; REFUSED or 1."""
    shutil.rmtree(dump, ignore_errors=True)
    msg = f"{type(err).__name__}: {err}" if err is not None else "no kernel PTX was written"
    rule = refusal_of(err) if err is not None else None  # fa4.refusals.REFUSALS: documented refusals only
    refused = rule is not None
    print(
        (f"production refuses this configuration ({rule.source}): " if refused else "compile failed: ")
        + msg.strip().splitlines()[-1][:500],
        file=sys.stderr,
    )
    return REFUSED if refused else 1


def _kernels_text(compiled: list[dict], backward: bool) -> tuple[str, dict] | None:
    """OUT.ptx's text and the main kernel's record: the forward kernel's PTX (the last
    ``FlashAttention*`` compile), or every backward compile's PTX after its ``KERNEL_MARK`` line;
    None when a PTX is missing."""
    if not backward:
        fwd = [c for c in compiled if "FlashAttention" in c["kernel_class"] and c["ptx"]]
        return (fwd[-1]["ptx"], fwd[-1]) if fwd else None
    main = [c for c in compiled if c["kernel_class"] not in AUX_KERNELS]
    if not main or any(c["ptx"] is None for c in compiled):
        return None
    return "".join(f"{KERNEL_MARK}{c['kernel_class']}\n{c['ptx']}" for c in compiled), main[0]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 1
    cfg, out, no_driver, backward = json.loads(argv[0]), argv[1], "--no-driver" in argv[2:], "--backward" in argv[2:]
    dump = tempfile.mkdtemp(prefix="fa4-sm100-ptx-")
    _configure_environment(dump)
    if no_driver:
        _stub_hardware_info()
    # lazy: the production package (optional, GPU extra); the DSL reads its target when first imported
    import flash_attn.cute as fa
    from flash_attn.cute import interface

    compiled = _capture_compiles(interface, dump)
    try:
        mods = _real_mods(cfg)
    except Exception as exc:  # a bad mod name or block (ValueError from fa4.mods): a failure, never a refusal
        return _no_ptx(exc, dump)
    call = _call_backward_on_fake_tensors if backward else _call_on_fake_tensors
    err = call(interface, cfg, mods) if backward else call(fa, cfg, mods)
    got = _kernels_text(compiled, backward)
    if got is None or (backward and err is not None):  # the backward launches nothing: any exception is a failure
        return _no_ptx(err, dump)
    text, main_kernel = got
    with open(out, "w") as fh:
        fh.write(text)
    chosen = {k: main_kernel[k] for k in ("kernel_class", "attributes", "mods")}
    if backward:
        chosen["kernels"] = [{k: c[k] for k in ("kernel_class", "attributes", "mods")} for c in compiled]
    chosen["launch_error"] = None if err is None else f"{type(err).__name__}: {str(err)[:300]}"
    chosen["config"] = cfg
    with open(out + ".json", "w") as fh:
        json.dump(chosen, fh, indent=1, default=str)
    shutil.rmtree(dump, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
