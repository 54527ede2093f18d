"""fa4.mufu (Triton inline PTX) against production's own MUFU calls (``fa4.production.ex2_kernel``:
CuTe-DSL ``cute.math.exp2/log2/tanh(fastmath=True)``, ``cute.arch.rcp_approx``) over all 2**32
float32 bit patterns, bit for bit (NaN payloads included).

    python benchmarks/experiments/mufu_check.py --out reports/h200/mufu_check.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from fa4.mufu import apply
from fa4.production import ex2_kernel

CHUNK = 1 << 26
VARIANTS = {"ex2": "hardware", "lg2": "lg2", "rcp": "rcp", "tanh": "tanh"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--log2-inputs", type=int, default=32)
    args = ap.parse_args()
    res = {}
    for op, variant in VARIANTS.items():
        t0, prod, diff = time.perf_counter(), ex2_kernel(variant), 0
        for start in range(0, 1 << args.log2_inputs, CHUNK):
            bits = torch.arange(start, start + CHUNK, dtype=torch.int64, device="cuda")
            x = (bits - (1 << 32) * (bits >= (1 << 31))).to(torch.int32).view(torch.float32)
            diff += int((apply(op, x).view(torch.int32) != prod(x).view(torch.int32)).sum())
        res[op] = {"inputs": 1 << args.log2_inputs, "differing": diff, "seconds": round(time.perf_counter() - t0, 1)}
        print(op, res[op], flush=True)
    doc = {"what": "fa4.mufu vs production's MUFU calls, all float32 inputs", "device": torch.cuda.get_device_name(),
           "results": res}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
