"""The smoke suite's wall time (not a test): ``fa4-audit run --suite smoke`` for the FA4 numerics
model, beside ``sdpa-math`` on the same cases in the same session (the machines are noisy: the
ratio to the first kernel's baseline is the stable figure).  Goal: the model's smoke run within
60 s on this machine's 2 cores.  ``--kernels`` / ``--device`` time others, e.g. each MMA mode of
the Hopper model on the H200 (``--device cuda --kernels fa4-model-sm90,fa4-model-sm90-tc``).

    python benchmarks/smoke_cpu.py [--repeat 3] [--device cpu] [--kernels fa4-model,sdpa-math] [--out F]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

KERNELS = ("fa4-model", "sdpa-math")


def once(kernel: str, out: Path, device: str = "cpu") -> float:
    """Seconds of one fresh ``fa4-audit run`` process (start-up and reports included)."""
    cmd = [sys.executable, "-m", "audits", "run", "--quiet", "--kernel", kernel, "--suite", "smoke"]
    cmd += ["--device", device, "--out", str(out)]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if p.returncode not in (0, 1):
        raise SystemExit(f"{kernel}: exit {p.returncode}\n{p.stderr[-2000:]}")
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3, help="interleaved repeats per kernel (default 3)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--kernels", default=",".join(KERNELS), help="comma-separated; the last one is the baseline")
    ap.add_argument("--out", default=None, help="also write the figures as JSON here")
    args = ap.parse_args()
    kernels = args.kernels.split(",")
    times = {k: [] for k in kernels}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeat):
            for k in kernels:  # interleaved, so that load drifts hit all alike
                times[k].append(once(k, Path(tmp) / f"{k}-{i}", args.device))
    med = {k: statistics.median(v) for k, v in times.items()}
    base = kernels[-1]
    res = {
        "suite": "smoke",
        "device": args.device,
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "seconds": times,
        "median_s": med,
        "baseline": base,
        "ratio_to_baseline": {k: med[k] / med[base] for k in kernels},
        "goal_s": 60.0,
    }
    print(json.dumps(res, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
