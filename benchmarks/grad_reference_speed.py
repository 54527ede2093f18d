"""The FP64 gradient reference's cost (not a test): ``numerics.grad_reference.
attention_grad_reference`` on a device, against torch's float32 SDPA forward + backward on the
same shape in the same run (the ratio is the stable figure), with its peak memory.

    python benchmarks/grad_reference_speed.py [--device cuda] [--repeat 3] [--out FILE.json]

Shapes (b, sq, sk, hq, hk, d, causal): a GQA causal training shape, a long non-causal one and a
very long causal one.  Times are medians of ``--repeat`` runs after one warm-up, synchronized.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = [(1, 4096, 4096, 16, 4, 128, True), (2, 8192, 8192, 16, 16, 128, False), (1, 16384, 16384, 8, 8, 128, True)]


def _timed(fn, device: str, repeat: int) -> list[float]:
    fn()
    out = []
    for _ in range(repeat):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def _one(shape, device: str, repeat: int) -> dict:
    from numerics.call import AttentionCall
    from numerics.grad_reference import attention_grad_reference

    b, sq, sk, hq, hk, d, causal = shape
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(b, sq, hq, d, generator=g, device=device).bfloat16()
    k, v = (torch.randn(b, sk, hk, d, generator=g, device=device).bfloat16() for _ in range(2))
    do = torch.randn(b, sq, hq, d, generator=g, device=device).bfloat16()

    def ref():
        attention_grad_reference(q, k, v, do, call=AttentionCall(causal=causal))

    def sdpa():
        leaves = [t.float().transpose(1, 2).requires_grad_(True) for t in (q, k, v)]
        out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=hq != hk)
        torch.autograd.grad(out, leaves, do.float().transpose(1, 2))

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t_ref = _timed(ref, device, repeat)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
    t_sdpa = _timed(sdpa, device, repeat)
    med_ref, med_sdpa = statistics.median(t_ref), statistics.median(t_sdpa)
    return {
        "shape": dict(zip(("batch", "seqlen_q", "seqlen_k", "heads_q", "heads_kv", "head_dim", "causal"), shape)),
        "reference_s": t_ref, "sdpa_fp32_fwd_bwd_s": t_sdpa, "reference_median_s": med_ref,
        "sdpa_median_s": med_sdpa, "ratio": med_ref / med_sdpa, "reference_peak_gib": peak,
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--shapes", type=int, default=len(SHAPES), help="run the first N shapes (CPU: 1)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    res = {"device": name, "torch": torch.__version__, "runs": []}
    for shape in SHAPES[: args.shapes]:
        res["runs"].append(_one(shape, args.device, args.repeat))
        print(json.dumps(res["runs"][-1]), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
