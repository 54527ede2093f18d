"""CPU speed of the exp2 model (not a test).

    python benchmarks/ex2_cpu.py [--exhaustive] [--out FILE]

1. ``fa4.ex2.ex2_emulation`` on 2**24 float32 inputs against ``torch.exp2`` on the same inputs,
   measured in the same run, interleaved, median of repeats (the ratio is what is reported: the
   machines are noisy).  Goal: ratio <= 5.
2. With ``--exhaustive``: the full 2**32 sweep of ``fa4-audit ex2 --exhaustive`` for degree 3,
   wall-clock.  Goal: <= 3 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from audits.checks.ex2.sweep import sweep_ex2  # noqa: E402
from fa4.ex2 import ex2_emulation, ex2_emulation_2  # noqa: E402


def _median_time(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--exhaustive", action="store_true")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    x = (torch.rand(1 << 24, generator=g) * 40 - 30).float()
    cases = {
        "torch.exp2": lambda: torch.exp2(x),
        "ex2_emulation deg3": lambda: ex2_emulation(x, 3),
        "ex2_emulation deg5": lambda: ex2_emulation(x, 5),
        "ex2_emulation_2 deg3": lambda: ex2_emulation_2(x, 3),
    }
    for fn in cases.values():  # warm-up (numba compilation, caches)
        fn()
    times = {k: [] for k in cases}
    for _ in range(args.reps):  # interleaved so that machine noise hits all alike
        for k, fn in cases.items():
            times[k] += _median_time(fn, 1)
    med = {k: statistics.median(v) for k, v in times.items()}
    res = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads",
        "inputs": x.numel(),
        "median_seconds": med,
        "ratio_to_torch_exp2": {k: v / med["torch.exp2"] for k, v in med.items() if k != "torch.exp2"},
    }
    if args.exhaustive:
        t = time.perf_counter()
        r = sweep_ex2(degree=3, exhaustive=True)
        res["exhaustive_sweep_deg3_seconds"] = time.perf_counter() - t
        res["exhaustive_sweep_deg3_max_rel"] = r["classes"]["normal"]["max_rel_error"]
    print(json.dumps(res, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
