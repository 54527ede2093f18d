"""Speed of the bit-for-bit exp2 sweep on a GPU: all 2**32 float32 inputs through the production
device function and through the model, compared bit for bit (not a test; needs CUDA and the
production package).

    python benchmarks/ex2_gpu.py [--degree 3] [--chunk-log2 28] [--out bench.json]

Timed with CUDA events after a warm-up pass that includes CuTe-DSL compilation (reported
separately).  Inputs are generated on the GPU from integer bit patterns, so nothing crosses PCIe.
Prints and writes: total seconds, and per stage (input generation, production kernel, model,
comparison), plus the mismatch count (must be 0).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fa4.ex2 import ex2_emulation  # noqa: E402
from fa4.production import ex2_kernel  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--degree", type=int, default=3)
    ap.add_argument("--chunk-log2", type=int, default=28)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    chunk = 1 << args.chunk_log2
    t0 = time.perf_counter()
    prod = ex2_kernel("scalar", args.degree)
    prod(torch.zeros(chunk, device=dev))  # compile for this grid size
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - t0

    def gen(start: int) -> torch.Tensor:
        return torch.arange(start, start + chunk, dtype=torch.int64, device=dev).to(torch.int32).view(torch.float32)

    # warm-up of the model's kernels on one chunk that has every input class
    ex2_emulation(gen(0x80000000 - chunk // 2), args.degree)
    torch.cuda.synchronize()
    ev = {k: [torch.cuda.Event(enable_timing=True) for _ in range(2)] for k in ("gen", "prod", "model", "cmp")}
    tot = dict.fromkeys(ev, 0.0)
    mism = torch.zeros((), dtype=torch.int64, device=dev)
    start_all = torch.cuda.Event(enable_timing=True)
    end_all = torch.cuda.Event(enable_timing=True)
    start_all.record()
    for s in range(0, 1 << 32, chunk):
        ev["gen"][0].record()
        x = gen(s)
        ev["gen"][1].record()
        ev["prod"][0].record()
        yp = prod(x)
        ev["prod"][1].record()
        ev["model"][0].record()
        ym = ex2_emulation(x, args.degree)
        ev["model"][1].record()
        ev["cmp"][0].record()
        mism += (yp.view(torch.int32) != ym.view(torch.int32)).sum()
        ev["cmp"][1].record()
        torch.cuda.synchronize()
        for k, (a, b) in ev.items():
            tot[k] += a.elapsed_time(b) / 1e3
    end_all.record()
    torch.cuda.synchronize()
    total = start_all.elapsed_time(end_all) / 1e3
    res = {
        "gpu": torch.cuda.get_device_name(),
        "degree": args.degree,
        "inputs": 1 << 32,
        "chunk": chunk,
        "mismatches": int(mism),
        "seconds_total": total,
        "seconds_by_stage": tot,
        "compile_seconds": compile_s,
    }
    print(json.dumps(res, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0 if res["mismatches"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
