"""The forward model's speed on CPU (not a test): ``fa4.model.attention`` with production's SM100
numerics (the default) and SM90 numerics, against torch's float32 SDPA
(``scaled_dot_product_attention`` on the same inputs cast to float32) and the FP64 reference
(``numerics.reference.attention_reference``), same shape, same run.  Interleaved repeats, medians;
the machines are shared and noisy, so the ratio is the figure to read.  Besides wall time each
call's process CPU time is recorded (both sides use torch's default thread count): its ratio
holds up better than the wall-time one when other processes load the cores.  Goal (issue 16):
the SM100 model within 4x SDPA fp32 at b1 h8 s2048 d128 bf16.

    python benchmarks/model_cpu.py [--shape b,h,s,d] [--causal both|yes|no] [--repeat 5]
                                   [--out reports/bench/model_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _callables(q, k, v, causal: bool) -> dict:
    from fa4.model import FA4Numerics, attention
    from numerics.call import AttentionCall
    from numerics.reference import attention_reference

    nm100 = FA4Numerics.for_inputs("sm100", q, k, v, causal)
    nm90 = FA4Numerics.for_inputs("sm90", q, k, v, causal)
    qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k, v))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return {
        "model_sm100": lambda: attention(q, k, v, causal=causal, return_lse=True, numerics=nm100),
        "model_sm90": lambda: attention(q, k, v, causal=causal, return_lse=True, numerics=nm90),
        "sdpa_fp32": lambda: sdpa(qf, kf, vf, is_causal=causal),
        "reference_fp64": lambda: attention_reference(q, k, v, call=AttentionCall(causal=causal), return_lse=True),
    }


def measure(shape: tuple[int, int, int, int], causal: bool, repeat: int) -> dict:
    b, h, s, d = shape
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, generator=g).bfloat16() for _ in range(3))
    fns = _callables(q, k, v, causal)
    for fn in fns.values():  # warm-up: numba's compiled loops, allocator, MKL threads
        fn()
    wall = {name: [] for name in fns}
    cpu = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():  # interleaved, so that load drifts hit all alike
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    med = {n: statistics.median(x) for n, x in wall.items()}
    med_cpu = {n: statistics.median(x) for n, x in cpu.items()}
    return {
        "shape": {"batch": b, "heads": h, "seqlen": s, "head_dim": d, "dtype": "bfloat16", "causal": causal},
        "seconds": wall,
        "median_s": med,
        "median_cpu_s": med_cpu,
        "ratio_to_sdpa_fp32": {n: med[n] / med["sdpa_fp32"] for n in fns if n != "sdpa_fp32"},
        "cpu_ratio_to_sdpa_fp32": {n: med_cpu[n] / med_cpu["sdpa_fp32"] for n in fns if n != "sdpa_fp32"},
        "ratio_to_reference_fp64": {n: med[n] / med["reference_fp64"] for n in ("model_sm100", "model_sm90")},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", help="batch,heads,seqlen,head_dim (repeatable; default 1,8,2048,128)")
    ap.add_argument("--causal", default="both", choices=("both", "yes", "no"))
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default=None, help="also write the figures as JSON here")
    args = ap.parse_args()
    shapes = [tuple(int(x) for x in s.split(",")) for s in (args.shape or ["1,8,2048,128"])]
    causals = {"both": (True, False), "yes": (True,), "no": (False,)}[args.causal]
    runs = []
    for shape in shapes:
        for causal in causals:
            r = measure(shape, causal, args.repeat)
            runs.append(r)
            tag = "x".join(map(str, shape)) + (" causal" if causal else "")
            ratios = ", ".join(f"{n} {x:.2f}x" for n, x in r["ratio_to_sdpa_fp32"].items())
            cpu = ", ".join(f"{n} {x:.2f}x" for n, x in r["cpu_ratio_to_sdpa_fp32"].items())
            print(f"{tag}: SDPA fp32 {r['median_s']['sdpa_fp32'] * 1e3:.1f} ms; wall ratio {ratios}")
            print(f"{' ' * len(tag)}  cpu-time ratio {cpu}")
    res = {
        "torch": torch.__version__, "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
        "load_average": os.getloadavg(), "repeat": args.repeat, "goal_ratio_sm100": 4.0, "runs": runs,
    }  # fmt: skip
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
