"""Compile production's SM100 forward kernel (``FlashAttentionForwardSm100``) to sm_100a PTX
without a Blackwell GPU — and, opt-in, without any GPU.

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

One compile per process: the DSL reads its target when first imported and the dump's file name
does not encode the whole configuration.  Run as::

    python -m fa4.sm100_compile CONFIG_JSON OUT.ptx [--no-driver]

CONFIG_JSON: {"dtype": "bfloat16", "d": 128, "dv": 128, "batch": 1, "heads_q": 2, "heads_kv":
2, "seqlen_q": 128, "seqlen_k": 128, "causal": false, "window": [null, null], "softcap": 0.0,
"sink": false} (an ``audits.cases.Case`` as a dict).  Writes OUT.ptx and OUT.ptx.json (what
production chose: kernel class and its attributes).  Exit 3 when production refuses the
configuration (message on stderr), 1 on any other failure.
"""

import glob
import json
import os
import shutil
import sys
import tempfile

from fa4.production import refusal_of

__all__ = ["main"]

REFUSED = 3


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


def _record_choices(interface, chosen: dict) -> None:
    """Wrap ``interface.cute.compile`` to record the kernel production builds into ``chosen``."""
    compile_og = interface.cute.compile

    def record(*args, **kw):  # passes through unchanged; records what production built
        obj = args[0]
        chosen["kernel_class"] = type(obj).__name__
        chosen["attributes"] = {
            k: v for k, v in vars(obj).items() if isinstance(v, (bool, int, float, str, type(None)))
        }
        return compile_og(*args, **kw)

    interface.cute.compile = record


def _call_on_fake_tensors(fa, cfg: dict) -> Exception | None:
    """``flash_attn_func`` on FakeTensors shaped by ``cfg``; the exception it raised, if any."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    dt = getattr(torch, cfg["dtype"])
    kw = dict(causal=cfg["causal"], window_size=tuple(cfg["window"]), softcap=cfg["softcap"], return_lse=True)
    err = None
    with FakeTensorMode():
        q = torch.empty(cfg["batch"], cfg["seqlen_q"], cfg["heads_q"], cfg["d"], dtype=dt, device="cuda")
        k = torch.empty(cfg["batch"], cfg["seqlen_k"], cfg["heads_kv"], cfg["d"], dtype=dt, device="cuda")
        v = torch.empty(cfg["batch"], cfg["seqlen_k"], cfg["heads_kv"], cfg["dv"], dtype=dt, device="cuda")
        if cfg["sink"]:
            kw["learnable_sink"] = torch.empty(cfg["heads_q"], dtype=torch.float32, device="cuda")
        try:
            fa.flash_attn_func(q, k, v, **kw)
        except Exception as exc:  # launch failures are expected on a non-Blackwell GPU
            err = exc
    return err


def _no_ptx(err: Exception | None, dump: str) -> int:
    """No forward kernel PTX was written: say why on stderr; REFUSED or 1."""
    shutil.rmtree(dump, ignore_errors=True)
    msg = f"{type(err).__name__}: {err}" if err is not None else "no forward kernel PTX was written"
    rule = refusal_of(err) if err is not None else None  # fa4.production.REFUSALS: documented refusals only
    refused = rule is not None
    print(
        (f"production refuses this configuration ({rule.source}): " if refused else "compile failed: ")
        + msg.strip().splitlines()[-1][:500],
        file=sys.stderr,
    )
    return REFUSED if refused else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 1
    cfg, out, no_driver = json.loads(argv[0]), argv[1], "--no-driver" in argv[2:]
    dump = tempfile.mkdtemp(prefix="fa4-sm100-ptx-")
    _configure_environment(dump)
    if no_driver:
        _stub_hardware_info()
    import flash_attn.cute as fa
    from flash_attn.cute import interface

    chosen = {}
    _record_choices(interface, chosen)
    err = _call_on_fake_tensors(fa, cfg)
    ptx = [
        p
        for p in glob.glob(os.path.join(dump, "**", "*.ptx"), recursive=True)
        if "FlashAttention" in os.path.basename(p)
    ]
    if not ptx:
        return _no_ptx(err, dump)
    ptx.sort(key=os.path.getmtime)
    shutil.copyfile(ptx[-1], out)
    chosen["launch_error"] = None if err is None else f"{type(err).__name__}: {str(err)[:300]}"
    chosen["config"] = cfg
    with open(out + ".json", "w") as fh:
        json.dump(chosen, fh, indent=1, default=str)
    shutil.rmtree(dump, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
