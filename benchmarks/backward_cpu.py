"""The backward model's speed on CPU (not a test): the backward of ``fa4.model.attention``
(``torch.autograd.grad`` on its graph, the forward run untimed beforehand) against torch's
float32 SDPA backward on the same shape, in the same run, medians of interleaved repeats (the
ratio is the stable figure on a noisy machine).  Goal (issue 12): within 6x.  The forward
times are reported beside it.

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

    def model():
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
        return (qq, kk, vv), attention(qq, kk, vv, causal=True), do

    def sdpa():
        qq, kk, vv = (t.float().transpose(1, 2).clone().requires_grad_(True) for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
        return (qq, kk, vv), out, do.float().transpose(1, 2)

    times = {"model_fwd": [], "model_bwd": [], "sdpa_fp32_fwd": [], "sdpa_fp32_bwd": []}
    for _ in range(args.repeat):
        for name, fwd in (("model", model), ("sdpa_fp32", sdpa)):
            t0 = time.perf_counter()
            leaves, out, grad = fwd()
            t1 = time.perf_counter()
            torch.autograd.grad(out, leaves, grad)
            times[f"{name}_fwd"].append(t1 - t0)
            times[f"{name}_bwd"].append(time.perf_counter() - t1)
    med = {k: statistics.median(v) for k, v in times.items()}
    res = {
        "shape": {"batch": b, "heads": h, "seqlen": s, "head_dim": d, "dtype": "bfloat16", "causal": True},
        "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "seconds": times, "median_s": med,
        "ratio_bwd_model_to_sdpa": med["model_bwd"] / med["sdpa_fp32_bwd"],
        "ratio_fwd_model_to_sdpa": med["model_fwd"] / med["sdpa_fp32_fwd"],
        "goal_ratio_bwd": 6.0,
    }  # fmt: skip
    print(json.dumps(res, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
