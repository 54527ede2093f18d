"""Triton's fused-attention tutorial, audited as a third-party kernel (issue 35's H200 measurement).

The tutorial (``python/tutorials/06-fused-attention.py`` of https://github.com/triton-lang/triton)
is public and is never copied into this repository: it is loaded at run time from the file named
by ``FA4_AUDIT_TRITON_TUTORIAL`` (default ``.triton-tutorial/06-fused-attention.py`` at the
repository root, a git-ignored folder).  To get it::

    git clone https://github.com/triton-lang/triton /tmp/triton
    git -C /tmp/triton show 003da478d84f5bb0f51b3988cf0ea0bbe60282b7:python/tutorials/06-fused-attention.py \\
        > .triton-tutorial/06-fused-attention.py

That revision's Hopper path (``_attn_fwd_tma``, taken when Triton has tensor descriptors and the
GPU is SM90 or newer) addresses the flattened ``(Z·H·N_CTX, HEAD_DIM)`` tensors at row
``off_z + off_h·N_CTX`` where the layout puts head ``off_h`` of batch ``off_z`` at
``(off_z·H + off_h)·N_CTX``: batch ``z >= 1`` reads and writes ``z`` rows below batch 0's rows of
the same head, and its own rows of ``o = torch.empty_like(q)`` are never written.  The tutorial's
own test runs ``Z = 1``, where the two agree.  The LSE (``M``) is addressed by ``off_hz·N_CTX``,
correctly: only the output moves.

This adapter gives the tutorial's forward the audited-callable contract (fa4-audit's README):
``(b, s, h, d)`` tensors are made ``(Z, H, N_CTX, HEAD_DIM)``-contiguous, the autograd
``Function``'s forward is called directly with a context that keeps what it saves (its ``M``,
the row's ``max + log2(sum)`` in log2 units, is the LSE times ``log2 e``), and the result is
laid out back.  The autotuner is pinned to one of the tutorial's own configurations (128 query
rows, 64 keys, 3 stages, 4 warps): every case then runs the same compiled kernel, without a
benchmark sweep per shape (the tutorial's comment says the same of its tuning).

**Without a GPU**, with ``TRITON_INTERPRET=1`` (Triton's interpreter, ``pip install triton``), the
tutorial runs on the CPU as it would on SM90: the interpreter is given a driver whose target is
``cuda`` at capability 9.0 and whose torch device is the CPU, and ``torch.cuda.get_device_capability``
answers ``(9, 0)`` while the tutorial is imported and called (its ``keep_tma`` filter at import and
its ``supports_tma`` test in ``forward`` read it), so that it takes ``_attn_fwd_tma``, the path
with the batch offset.  The interpreter runs the programs one at a time in grid order, so
batch 1's programs, after batch 0's, win every row both write: one outcome of the race the GPU
runs (docs/diagnosis.md, "the batch stride"); its arithmetic is numpy's, not the GPU's.

The domain declared is what the tutorial's forward supports: fp16 (it stores the output as fp16),
``d = dv`` (its assertion) limited to 64 and 128 here (each head dim is a compile), equal
sequence lengths in multiples of 128 (its loads and LSE stores are unmasked), equal head counts
(its descriptors span ``q``'s shape for ``k`` and ``v`` too), causal or not; no window, softcap or
sink, no backward audited.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
from pathlib import Path
from types import ModuleType
from unittest import mock

import torch

#: where the tutorial is read from unless FA4_AUDIT_TRITON_TUTORIAL names another file
DEFAULT_PATH = Path(__file__).resolve().parent.parent / ".triton-tutorial" / "06-fused-attention.py"
#: the one configuration the autotuner is pinned to (one of the tutorial's own: BLOCK_M 128,
#: BLOCK_N 64, 3 stages, 4 warps; its keep_tma filter drops 8 warps for this tile on SM90)
PINNED = {"BLOCK_M": 128, "BLOCK_N": 64, "num_stages": 3, "num_warps": 4}

_module: ModuleType | None = None


def tutorial_path() -> Path:
    """The tutorial file this process loads (``FA4_AUDIT_TRITON_TUTORIAL`` or the default)."""
    return Path(os.environ.get("FA4_AUDIT_TRITON_TUTORIAL") or DEFAULT_PATH)


def load_tutorial() -> ModuleType:
    """The tutorial imported from :func:`tutorial_path` once per process, its autotuner pinned."""
    global _module
    if _module is not None:
        return _module
    path = tutorial_path()
    if not path.is_file():
        raise FileNotFoundError(
            f"Triton's fused-attention tutorial is not at {path} (FA4_AUDIT_TRITON_TUTORIAL or "
            f"the default {DEFAULT_PATH}); it is loaded at run time, not shipped: see the "
            "docstring of examples/triton_tutorial.py for the git commands that fetch it"
        )
    spec = importlib.util.spec_from_file_location("triton_fused_attention_tutorial", path)
    module = importlib.util.module_from_spec(spec)
    if interpreted():
        _activate_interpreter_driver()
    try:
        with _as_sm90():
            spec.loader.exec_module(module)
    except RuntimeError as exc:  # the tutorial asks Triton's driver for the GPU as it is imported
        if torch.cuda.is_available() or interpreted():
            raise
        raise RuntimeError(
            f"Triton's fused-attention tutorial could not be imported ({exc}): there is no CUDA device, and it runs "
            "without one only in Triton's interpreter: set TRITON_INTERPRET=1 (examples/triton_tutorial.py)"
        ) from exc
    import triton

    tuned = module._attn_fwd_tma
    block = {key: PINNED[key] for key in ("BLOCK_M", "BLOCK_N")}
    config = triton.Config(block, num_stages=PINNED["num_stages"], num_warps=PINNED["num_warps"],
                           pre_hook=module._tma_pre_hook)  # fmt: skip
    tuned.configs = [config]
    _module = module
    return module


def interpreted() -> bool:
    """Whether the tutorial runs in Triton's interpreter on the CPU: ``TRITON_INTERPRET=1`` (Triton's
    own switch, read when the tutorial's ``@triton.jit`` functions are made) and no CUDA device."""
    return os.environ.get("TRITON_INTERPRET") == "1" and not torch.cuda.is_available()


def _activate_interpreter_driver() -> None:
    """Make Triton's active driver one the tutorial's import-time queries can ask: without a GPU no
    backend is active (``triton.runtime.driver`` raises "0 active drivers"), and the tutorial asks
    the driver for its torch device (``DEVICE``) and its target's backend (``is_hip``, ``is_cuda``)
    before any kernel runs.  The target is SM90's, the GPU the tutorial's TMA path was audited on."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase

    class Sm90Interpreter(DriverBase):
        @classmethod
        def is_active(cls) -> bool:
            return True

        def get_current_target(self) -> GPUTarget:
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self) -> torch.device:
            return torch.device("cpu")

        def map_python_to_cpp_type(self, ty: str) -> str:
            raise NotImplementedError("the interpreter compiles nothing")

        def get_benchmarker(self):
            raise NotImplementedError("the adapter pins the autotuner to one configuration: nothing is benchmarked")

    triton.runtime.driver.set_active(Sm90Interpreter())


def _as_sm90() -> contextlib.AbstractContextManager:
    """Under the interpreter, ``torch.cuda.get_device_capability`` answers ``(9, 0)`` inside the
    block (a CPU build of torch raises there) and is restored after it; otherwise nothing changes."""
    if not interpreted():
        return contextlib.nullcontext()
    return mock.patch.object(torch.cuda, "get_device_capability", lambda device=None: (9, 0))


class _Saved:
    """The autograd context the tutorial's ``_attention.forward`` writes to: what it saves is kept
    (``q, k, v, o, M``), the rest of its attributes land on the instance."""

    saved: tuple[torch.Tensor, ...] = ()

    def save_for_backward(self, *tensors: torch.Tensor) -> None:
        self.saved = tensors


def attention(q, k, v, *, softmax_scale=None, causal=False, window_size=(None, None), softcap=0.0,
              learnable_sink=None, return_lse=False):  # fmt: skip
    """The audited-callable contract on the tutorial's forward (its domain: module docstring)."""
    if window_size not in ((None, None), (-1, -1)) or softcap or learnable_sink is not None:
        raise NotImplementedError("the Triton tutorial has no local window, softcap or learnable sink")
    module = load_tutorial()
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    zhnd = [t.transpose(1, 2).contiguous() for t in (q, k, v)]
    ctx = _Saved()
    with _as_sm90():
        o = module._attention.forward(ctx, *zhnd, bool(causal), scale)
    out = o.transpose(1, 2)
    if not return_lse:
        return out
    lse = ctx.saved[4] * math.log(2.0)  # M = log2 of the row's sum of exp: times ln 2 to natural
    return out, lse


attention.fa4_audit_domain = {
    "dtypes": ["float16"],
    "head_dims": [[64, 64], [128, 128]],
    "seqlen_multiple": 128,
    "equal_seqlens": True,
    "causal": True,
    "local": False,
    "softcap": False,
    "sink": False,
    "gqa": False,
    "backward": False,
    "deterministic": False,
}
