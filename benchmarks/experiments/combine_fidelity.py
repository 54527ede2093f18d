"""The split-KV combine model (``fa4.varlen.combine``) against production's combine kernel
(``flash_attn.cute.flash_attn_combine``, ``flash_fwd_combine.py``), bit for bit, on a GPU.

The combine kernel is architecture-generic (cp.async, no wgmma/tcgen05), so it runs on the H200
although production's SM90 forward refuses split-KV: this measures the combine's arithmetic that
the SM100 split path relies on.  Partials are drawn per row: LSEs spread over a few nats (and
some far apart, some -inf: empty splits), O ~ N(0, 1) float32.  Each variant of
``fa4.varlen.CombineOps`` is evaluated with production's MUFU functions (``fa4.production.
ex2_kernel``: ``ex2.approx.ftz``, ``lg2.approx.ftz``, ``rcp.approx.ftz``) so that a mismatch
is the arithmetic's structure, and once with the CPU model's correctly rounded stand-ins.

    python benchmarks/experiments/combine_fidelity.py --out reports/h200/combine/combine.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path

import torch

from fa4.varlen import CombineOps, combine

CHUNK = 1 << 20


def _mufu(variant: str):
    """Production's MUFU function ``variant`` on float32 CUDA tensors of any size (fixed-size
    chunks: the probe kernel compiles per grid size)."""
    from fa4.production import ex2_kernel

    k = ex2_kernel(variant)

    def run(x: torch.Tensor) -> torch.Tensor:
        flat = x.contiguous().view(-1)
        out = torch.empty_like(flat)
        for i in range(0, flat.numel(), CHUNK):
            part = flat[i : i + CHUNK]
            pad = torch.zeros(CHUNK, dtype=torch.float32, device=x.device)
            pad[: part.numel()] = part
            out[i : i + CHUNK] = k(pad)[: part.numel()]
        return out.view(x.shape)

    return run


def _partials(splits: int, rows: int, heads: int, dv: int, g: torch.Generator, dev):
    """(o_partial (S, 1, rows, H, dv), lse_partial (S, 1, rows, H), rows contiguous), the
    layout production's forward hands its combine: LSEs ~ 5 + 3 N(0,1), a tenth of
    the rows spread 60 nats (weights below 2**-126 flush), a fifth of the splits empty (-inf),
    one row in 64 with every split empty."""
    lse = 5 + 3 * torch.randn(splits, heads, rows, generator=g)
    far = torch.rand(1, 1, rows, generator=g) < 0.1
    lse = torch.where(far, lse * 20, lse)
    lse = torch.where(torch.rand(splits, heads, rows, generator=g) < 0.2, torch.full_like(lse, -math.inf), lse)
    lse[:, :, ::64] = -math.inf
    o = torch.randn(splits, rows, heads, dv, generator=g)
    # the forward writes lse_partial as (S, B, H, seqlen) and hands the combine its transpose
    # (interface.py: ``lse_partial.transpose(-1, -2)``): the sequence dimension stays contiguous
    return o.unsqueeze(1).to(dev), lse.unsqueeze(1).to(dev).transpose(-1, -2)


def _compare(got: tuple, want: tuple) -> dict:
    o, lse = (t.contiguous() for t in got)
    po, plse = (t.contiguous() for t in want)
    ob = o.view(torch.int16) != po.view(torch.int16)
    lb = lse.view(torch.int32) != plse.view(torch.int32)
    return {
        "out_mismatches": int(ob.sum()),
        "out_total": ob.numel(),
        "lse_mismatches": int(lb.sum()),
        "lse_total": lb.numel(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, default=2048)
    args = ap.parse_args()
    from flash_attn.cute.interface import flash_attn_combine

    dev = torch.device("cuda")
    mufu = dict(exp2=_mufu("hardware"), lg2=_mufu("lg2"), rcp=_mufu("rcp"))
    variants = {
        "model (production MUFU)": CombineOps(**mufu),
        "model (CPU stand-ins)": CombineOps(),
        "scale two roundings": CombineOps(**mufu, scale_fma=False),
        "lse two roundings": CombineOps(**mufu, lse_fma=False),
        "inv rcp.approx": CombineOps(**mufu, inv="rcp"),
    }
    results, t0 = [], time.perf_counter()
    g = torch.Generator().manual_seed(0)
    for splits in (2, 3, 4, 5, 8, 13, 16, 33):
        for dv in (64, 128):
            for dt in (torch.bfloat16, torch.float16):
                o, lse = _partials(splits, args.rows, 4, dv, g, dev)
                po, plse = flash_attn_combine(o, lse, out_dtype=dt, return_lse=True)
                plse = plse.float()
                for name, ops in variants.items():
                    mo, ml = combine(o, lse.contiguous(), dt, ops)
                    rec = {"splits": splits, "dv": dv, "dtype": str(dt).removeprefix("torch."), "variant": name}
                    results.append({**rec, **_compare((mo, ml), (po, plse))})
    summary = {}
    for r in results:
        s = summary.setdefault(r["variant"], {"out_mismatches": 0, "out_total": 0, "lse_mismatches": 0, "lse_total": 0})
        for key in s:
            s[key] += r[key]
    for s in summary.values():
        s["out_identical"] = 1 - s["out_mismatches"] / s["out_total"]
        s["lse_identical"] = 1 - s["lse_mismatches"] / s["lse_total"]
    doc = {
        "what": "fa4.varlen.combine vs production flash_attn_combine, bitwise",
        "device": torch.cuda.get_device_name(),
        "variants": {
            k: dataclasses.asdict(dataclasses.replace(v, exp2=None, lg2=None, rcp=None)) for k, v in variants.items()
        },
        "summary": summary,
        "cases": results,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    for k, s in summary.items():
        print(f"{k:28s} out identical {s['out_identical']:.6%}  lse identical {s['lse_identical']:.6%}")


if __name__ == "__main__":
    main()
