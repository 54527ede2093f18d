"""Exhaustive accuracy of the GPU's MUFU approximations that FA4's forward pass uses, against
float64: ``ex2.approx.ftz`` (every exp2 not emulated), ``lg2.approx.ftz`` (the LSE),
``rcp.approx.ftz`` (the final 1/row_sum) and ``tanh.approx`` (softcap).  All 2**32 float32
inputs, on the GPU, through ``fa4.production`` kernels.  The error bound of the forward pass
(``numerics.forward_bound``) takes its hardware constants from this measurement.
"""

from __future__ import annotations

import torch

from fa4.production import ex2_kernel

__all__ = ["measure_mufu"]


def _stats(name: str, x: torch.Tensor, y: torch.Tensor, acc: dict) -> None:
    xd, yd = x.double(), y.double()
    if name == "ex2":
        exact = torch.exp2(xd)
        dom = (xd >= -126) & (xd < 128)
        err = ((yd - exact) / exact).abs()
        acc["max_rel"] = max(acc.get("max_rel", 0.0), float(torch.where(dom, err, 0).max()))
    elif name == "lg2":
        dom = (xd >= 2.0**-126) & torch.isfinite(xd)
        exact = torch.log2(torch.where(dom, xd, 1.0))
        aerr = torch.where(dom, (yd - exact).abs(), 0)
        acc["max_abs"] = max(acc.get("max_abs", 0.0), float(aerr.max()))
        big = dom & (exact.abs() >= 1)
        acc["max_rel_where_abs_log2_ge_1"] = max(
            acc.get("max_rel_where_abs_log2_ge_1", 0.0), float(torch.where(big, aerr / exact.abs(), 0).max())
        )
    elif name == "rcp":
        dom = (xd.abs() >= 2.0**-126) & (xd.abs() < 2.0**126)
        exact = 1.0 / torch.where(dom, xd, 1.0)
        acc["max_rel"] = max(acc.get("max_rel", 0.0), float(torch.where(dom, ((yd - exact) / exact).abs(), 0).max()))
    elif name == "tanh":
        dom = torch.isfinite(xd)
        exact = torch.tanh(torch.where(dom, xd, 0.0))
        aerr = torch.where(dom, (yd - exact).abs(), 0)
        acc["max_abs"] = max(acc.get("max_abs", 0.0), float(aerr.max()))
        nz = dom & (exact.abs() >= 2.0**-126)
        acc["max_rel"] = max(
            acc.get("max_rel", 0.0), float(torch.where(nz, aerr / exact.abs().clamp(min=2.0**-126), 0).max())
        )


def measure_mufu(device, *, chunk_log2: int = 27) -> dict:
    """Max errors of each MUFU approximation over all 2**32 float32 inputs (domains in the
    result's ``domain`` entries)."""
    ops = {"ex2": "hardware", "lg2": "lg2", "rcp": "rcp", "tanh": "tanh"}
    out = {}
    chunk = 1 << chunk_log2
    for name, variant in ops.items():
        fn = ex2_kernel(variant)
        acc: dict = {}
        for s in range(0, 1 << 32, chunk):
            x = torch.arange(s, s + chunk, dtype=torch.int64, device=device).to(torch.int32).view(torch.float32)
            _stats(name, x, fn(x), acc)
        out[name] = acc
    out["domain"] = {
        "ex2": "x in [-126, 128): relative error",
        "lg2": "normal positive x: absolute error (log2 units); relative where |log2 x| >= 1",
        "rcp": "2**-126 <= |x| < 2**126: relative error",
        "tanh": "finite x: absolute error; relative where |tanh x| >= 2**-126",
    }
    out["inputs"] = 1 << 32
    out["gpu"] = torch.cuda.get_device_name(device)
    return out
