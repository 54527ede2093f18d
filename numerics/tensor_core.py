"""How Hopper's tensor cores sum a dot product, as measured on the H200 (``benchmarks/mma_probe.py``,
``docs/tensor-cores.md``): ``wgmma ... .f32.bf16.bf16`` / ``.f32.f16.f16`` with a float32
accumulator C, for each k16 instruction:

1. the 16 products ``a_k b_k`` are formed exactly;
2. the products and C are aligned to the largest exponent among them (``emax``), keeping
   ``extra_bits`` bits below float32's 24-bit significand: each is truncated toward zero to a
   multiple of ``2**(emax - 23 - extra_bits)``.  A product's exponent here is the *sum of its
   inputs' exponents* — the product's significand, in [1, 4), is not renormalised first — and
   C's is its own;
3. the aligned terms are added exactly;
4. the sum is normalised and truncated toward zero to float32.

A K-long dot is ceil(K / 16) such instructions in order, each taking the previous result as C.
Measured on the H200 (``benchmarks/mma_probe.py``, Triton 3.6 ``tl.dot``, bf16 and fp16, K = 16 to
128): the crafted probes give 2 extra bits, one block of all 16 products with C in it, and
truncation for both the alignment and the final rounding — the parameters Khattak & Mikaitis
(arXiv 2512.07004) publish for H100 through ``wmma``; on random inputs of three exponent spreads
that model matched only 81-99 % of the outputs until the product exponent was taken as the sum
of the input exponents; then 100 % of 196,608 random outputs and every probe match
(``tests/test_tensor_core.py`` replays a recorded subset).  ``tc_dot`` evaluates it on the
CPU (float64 holds every intermediate exactly: products of 8- or 11-bit significands, 17 terms of
at most 26 significant bits each).
"""

from __future__ import annotations

import torch

__all__ = ["tc_dot", "rz_to_f32", "TC_BLOCK", "TC_EXTRA_BITS"]

#: products summed per alignment block (one k16 wgmma instruction), measured
TC_BLOCK = 16
#: bits kept below the float32 significand when aligning, measured (bf16, fp16)
TC_EXTRA_BITS = 2


def rz_to_f32(x: torch.Tensor) -> torch.Tensor:
    """float64 -> float32 rounded toward zero (non-finite values as they are)."""
    y = x.float()
    over = y.double().abs() > x.abs()
    fix = torch.nextafter(y, torch.zeros_like(y))
    return torch.where(over & torch.isfinite(x), fix, y)


def _exponent(x: torch.Tensor) -> torch.Tensor:
    """floor(log2|x|) as int64 (x != 0), a very small value for zeros (they never set emax)."""
    _, e = torch.frexp(torch.where(x != 0, x, torch.ones_like(x)))
    return torch.where(x != 0, e.to(torch.int64) - 1, torch.full_like(e, -(2**20), dtype=torch.int64))


def _chunk(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, extra_bits: int) -> torch.Tensor:
    """One instruction: float32 ``c`` (...), float64 inputs a, b (..., <=16) -> float32.  A
    product's alignment exponent is the sum of its inputs' exponents (its significand lies in
    [1, 4): the hardware does not renormalise it before aligning); C's is its own."""
    prods = a * b
    emax = torch.maximum((_exponent(a) + _exponent(b)).amax(-1), _exponent(c.double()))
    emax = torch.where(emax < -(2**19), torch.zeros_like(emax), emax)  # all zero: any quantum
    quantum = torch.ldexp(torch.ones_like(prods[..., 0]), emax - 23 - extra_bits)
    aligned = torch.trunc(prods / quantum.unsqueeze(-1)) * quantum.unsqueeze(-1)
    cc = torch.trunc(c.double() / quantum) * quantum
    out = rz_to_f32(aligned.sum(-1) + cc)
    finite = torch.isfinite(prods).all(-1) & torch.isfinite(c)
    return torch.where(finite, out, (prods.sum(-1) + c.double()).float())  # NaN/inf: IEEE semantics


def tc_dot(
    a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None = None, *, block: int = TC_BLOCK,
    extra_bits: int = TC_EXTRA_BITS,
) -> torch.Tensor:  # fmt: skip
    """``c + sum_k a[..., k] b[..., k]`` as the tensor cores compute it (module doc): a and b of
    a 16-bit (or 8-bit) float dtype, broadcast together, reduced over their last dimension in
    blocks of ``block`` in order; c float32 (zeros when None).  Returns float32."""
    a, b = torch.broadcast_tensors(a.double(), b.double())
    acc = torch.zeros(a.shape[:-1], dtype=torch.float32, device=a.device) if c is None else c.float()
    for k0 in range(0, a.shape[-1], block):
        acc = _chunk(acc, a[..., k0 : k0 + block], b[..., k0 : k0 + block], extra_bits)
    return acc
