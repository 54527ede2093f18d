"""How Hopper's tensor cores sum a dot product, as measured on the H200 (``benchmarks/experiments/mma_probe.py``,
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
Measured on the H200 (``benchmarks/experiments/mma_probe.py``, Triton 3.6 ``tl.dot``, bf16 and fp16, K = 16 to
128): the crafted probes give 2 extra bits, one block of all 16 products with C in it, and
truncation for both the alignment and the final rounding — the parameters Khattak & Mikaitis
(arXiv 2512.07004) publish for H100 through ``wmma``.  With a product's exponent taken as the sum
of the input exponents (step 2), 100 % of 196,608 random outputs of three exponent spreads and
every probe match; with the renormalised product's exponent, 81-99 %
(``tests/test_tensor_core.py`` replays a recorded subset).  ``tc_dot`` evaluates it in float64,
which holds every intermediate exactly: products of 8- or 11-bit significands, and 17 terms that
are multiples of the quantum below 2**27 of it each, so their sum is exact in any order.  On the
CPU a compiled loop (numba) does it per output without materialising the broadcast operands,
about 40x faster than the torch form (8 x 512 x 512 outputs of K = 128: 0.97 s against 38 s on
this 2-core machine, 2026-12-01) and equal to it in every bit (``tests/test_tensor_core.py``).
"""

from __future__ import annotations

import math
import threading

import numba
import numpy as np
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
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor | None = None,
    *,
    block: int = TC_BLOCK,
    extra_bits: int = TC_EXTRA_BITS,
) -> torch.Tensor:
    """``c + sum_k a[..., k] b[..., k]`` as the tensor cores compute it (module doc): a and b of
    a 16-bit (or 8-bit) float dtype, broadcast together, reduced over their last dimension in
    blocks of ``block`` in order; c float32 (zeros when None).  Returns float32.  On the CPU a
    compiled loop (:func:`_tc_compiled`) computes the same bits without materialising the
    broadcast; elsewhere (CUDA, more than four broadcast dims), the torch form (:func:`_chunk`
    per block), which also recomputes the compiled loop's non-finite outputs."""
    shape = torch.broadcast_shapes(a.shape[:-1], b.shape[:-1])
    if c is not None:
        c = c.float().expand(shape)
    if a.device.type == "cpu" and _FAST_CPU and 1 <= len(shape) <= 4 and a.shape[-1] == b.shape[-1]:
        return _tc_compiled(a, b, c, shape, block, extra_bits)
    a, b = torch.broadcast_tensors(a.double(), b.double())
    acc = torch.zeros(a.shape[:-1], dtype=torch.float32, device=a.device) if c is None else c.clone()
    return _chunks(acc, a, b, block, extra_bits)


def _chunks(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, block: int, extra_bits: int) -> torch.Tensor:
    """The torch form: float64 a, b (..., K) in instructions of ``block`` into float32 ``acc``."""
    for k0 in range(0, a.shape[-1], block):
        acc = _chunk(acc, a[..., k0 : k0 + block], b[..., k0 : k0 + block], extra_bits)
    return acc


def _tc_compiled(a, b, c, shape, block: int, extra_bits: int) -> torch.Tensor:
    """:func:`tc_dot` on the CPU through :data:`_compiled`: the inputs as float64 with their
    broadcast dims as zero strides (numpy views, no copy), padded to 4 leading dims.  Outputs
    with a non-finite product or accumulator are flagged and taken from the torch form."""
    pad = (1,) * (4 - len(shape))

    def view(t: torch.Tensor) -> torch.Tensor:  # (1.., *shape, K), broadcast dims as zero strides
        return t.expand(*shape, t.shape[-1]).reshape(*pad, *shape, t.shape[-1])

    a64, b64 = a.double(), b.double()
    ab = [view(t).numpy() for t in (a64, b64, _exponent(a64), _exponent(b64))]
    cn = (torch.zeros(shape) if c is None else c).reshape(*pad, *shape).numpy()
    out = torch.empty(shape, dtype=torch.float32)
    bad = torch.zeros(shape, dtype=torch.bool)
    with _COMPILED_LOCK:  # numba's workqueue threading layer, where it is the one in use, takes one caller at a time
        _compiled(*ab, cn, out.view(*pad, *shape).numpy(), bad.view(*pad, *shape).numpy(), block, extra_bits)
    if bool(bad.any()):
        idx = bad.nonzero(as_tuple=True)
        acc = torch.zeros_like(out[idx]) if c is None else c[idx].clone()
        ab, bb = (t.expand(*shape, t.shape[-1])[idx] for t in (a64, b64))
        out[idx] = _chunks(acc, ab, bb, block, extra_bits)
    return out


#: CPU: the compiled loop; tests turn it off to compare its bits with the torch form's
_FAST_CPU = True
_COMPILED_LOCK = threading.Lock()
_FLT_MAX = float(np.finfo(np.float32).max)


@numba.njit(fastmath=False, cache=True, nogil=True)
def _exp_of(x: float) -> int:
    """floor(log2|x|) of a nonzero finite float64 (``_exponent``)."""
    return math.frexp(x)[1] - 1


@numba.njit(fastmath=False, cache=True, nogil=True)
def _rz32(x: float) -> float:
    """float64 -> float32 rounded toward zero (``rz_to_f32``, finite x): truncation to the
    float32 grid (ulp 2**(e - 23), at least 2**-149), the float32 maximum beyond it."""
    if x == 0.0:
        return x
    ulp = math.ldexp(1.0, max(_exp_of(x) - 23, -149))
    y = math.trunc(x / ulp) * ulp
    return math.copysign(_FLT_MAX, x) if abs(y) > _FLT_MAX else y


@numba.njit(fastmath=False, cache=True, nogil=True, parallel=True)
def _compiled(a, b, ea, eb, c, out, bad, block, extra_bits):
    """Per output: the k16 instructions of ``_chunk`` in order, the accumulator carried.
    a, b: (d0, d1, d2, d3, K) float64 (zero strides where broadcast), ea, eb their
    ``_exponent`` (int64); c: (d0..d3) float32.  The quantum is a power of two, so
    multiplying by its inverse is the same exact scaling as dividing by it."""
    d0, d1, d2, d3, kk = a.shape
    for flat in numba.prange(d0 * d1 * d2 * d3):
        i3 = flat % d3
        i2 = (flat // d3) % d2
        i1 = (flat // (d3 * d2)) % d1
        i0 = flat // (d3 * d2 * d1)
        acc = np.float32(c[i0, i1, i2, i3])
        for k0 in range(0, kk, block):
            k1 = min(k0 + block, kk)
            cd = float(acc)
            if not math.isfinite(cd):
                bad[i0, i1, i2, i3] = True
                break
            emax = _exp_of(cd) if cd != 0.0 else -(2**20)
            finite = True
            for k in range(k0, k1):
                if not math.isfinite(a[i0, i1, i2, i3, k] * b[i0, i1, i2, i3, k]):
                    finite = False
                emax = max(emax, ea[i0, i1, i2, i3, k] + eb[i0, i1, i2, i3, k])
            if not finite:
                bad[i0, i1, i2, i3] = True
                break
            if emax < -(2**19):
                emax = 0
            q = math.ldexp(1.0, emax - 23 - extra_bits)
            iq = math.ldexp(1.0, 23 + extra_bits - emax)
            s = 0.0
            for k in range(k0, k1):
                s += math.trunc(a[i0, i1, i2, i3, k] * b[i0, i1, i2, i3, k] * iq) * q
            s += math.trunc(cd * iq) * q
            acc = np.float32(_rz32(s))
        out[i0, i1, i2, i3] = acc
