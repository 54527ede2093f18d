"""The backward model's speed on CPU (not a test): gradients of ``fa4.model.attention`` against
torch's float32 SDPA backward on the same shape, in the same run (medians of interleaved
repeats; the ratio is the stable figure on a noisy machine).  Goal: within 6x.

    python benchmarks/backward_cpu.py [--shape b,h,s,d] [--repeat 3] [--out FILE.json]
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


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    from fa4.model import attention

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="1,8,2048,128", help="batch,heads,seqlen,head_dim (default 1,8,2048,128)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    b, h, s, d = (int(x) for x in args.shape.split(","))
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(b, s, h, d, generator=g).bfloat16() for _ in range(4))

    def model_bwd():
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
        out = attention(qq, kk, vv, causal=True)
        torch.autograd.grad(out, (qq, kk, vv), do)

    def model_fwd():
        attention(q, k, v, causal=True)

    def sdpa_bwd():
        qq, kk, vv = (t.float().transpose(1, 2).clone().requires_grad_(True) for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
        torch.autograd.grad(out, (qq, kk, vv), do.float().transpose(1, 2))

    times = {"model_fwd_bwd": [], "model_fwd": [], "sdpa_fp32_fwd_bwd": []}
    for _ in range(args.repeat):
        times["model_fwd_bwd"].append(_time(model_bwd))
        times["model_fwd"].append(_time(model_fwd))
        times["sdpa_fp32_fwd_bwd"].append(_time(sdpa_bwd))
    med = {k: statistics.median(v) for k, v in times.items()}
    model_bwd_only = med["model_fwd_bwd"] - med["model_fwd"]
    res = {
        "shape": {"batch": b, "heads": h, "seqlen": s, "head_dim": d, "dtype": "bfloat16", "causal": True},
        "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "seconds": times, "median_s": med,
        "ratio_fwd_bwd_model_to_sdpa": med["model_fwd_bwd"] / med["sdpa_fp32_fwd_bwd"],
        "model_bwd_only_s": model_bwd_only, "goal_ratio": 6.0,
    }  # fmt: skip
    print(json.dumps(res, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
