"""The GPU's own transcendental approximations (MUFU) for the model when it runs on CUDA: one
small elementwise Triton kernel per instruction, each a single inline PTX instruction, so the
model reproduces production's values exactly where production uses them:

* ``ex2.approx.ftz.f32`` — the forward's hardware exp2 (``cute.math.exp2(..., fastmath=True)``),
  the accumulator rescale, the sink, the combine's weights, the backward's P;
* ``lg2.approx.ftz.f32`` — the LSE (``cute.math.log2(..., fastmath=True)``) and the combine's log;
* ``rcp.approx.ftz.f32`` — the final normalisation (``cute.arch.rcp_approx``);
* ``tanh.approx.f32`` — softcap (``cute.math.tanh(..., fastmath=True)``).

On the CPU (or without Triton) each is its correctly rounded stand-in (``fa4.primitives``): the
distance is measured, e.g. MUFU.EX2 against the stand-in over all 2**32 inputs on the H200: at
most 2 float32 ULP, 95.60 % identical (``docs/model-and-fidelity.md``).  ``available(device)``
says which applies; ``FA4_AUDIT_MUFU=model`` forces the stand-ins on CUDA too.
"""

from __future__ import annotations

import functools
import os

import torch

__all__ = ["OPS", "available", "apply"]

#: the PTX of each operation ($0 the result, $1 the input)
OPS = {
    "ex2": "ex2.approx.ftz.f32 $0, $1;",
    "lg2": "lg2.approx.ftz.f32 $0, $1;",
    "rcp": "rcp.approx.ftz.f32 $0, $1;",
    "tanh": "tanh.approx.f32 $0, $1;",
}
_BLOCK = 1024


def available(device: torch.device | str) -> bool:
    """Whether :func:`apply` runs the hardware instructions for tensors on ``device``: CUDA,
    Triton importable, and not ``FA4_AUDIT_MUFU=model``."""
    if torch.device(device).type != "cuda" or os.environ.get("FA4_AUDIT_MUFU") == "model":
        return False
    return _kernel() is not None


@functools.cache
def _kernel():
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def mufu(X, Y, n, ASM: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(X + offs, mask=mask, other=0.0)
        y = tl.inline_asm_elementwise(ASM, "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)
        tl.store(Y + offs, y, mask=mask)

    return mufu, triton


def apply(op: str, x: torch.Tensor) -> torch.Tensor:
    """MUFU instruction ``op`` (a key of :data:`OPS`) on a float32 CUDA tensor, elementwise."""
    if op not in OPS:
        raise ValueError(f"unknown MUFU operation {op!r}; accepted: {', '.join(OPS)}")
    if x.dtype != torch.float32 or not x.is_cuda:
        raise TypeError(f"x must be a float32 CUDA tensor, got {x.dtype} on {x.device}")
    kern, triton = _kernel()
    flat = x.contiguous().view(-1)
    out = torch.empty_like(flat)
    n = flat.numel()
    if n:
        kern[(triton.cdiv(n, _BLOCK),)](flat, out, n, ASM=OPS[op], BLOCK=_BLOCK)
    return out.view(x.shape)
