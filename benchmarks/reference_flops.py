"""Achieved FLOP rate of the FP64 attention reference on a GPU (not a test; needs CUDA).

    python benchmarks/reference_flops.py [--out reference_flops.json]

For each shape, ``numerics.reference.attention_reference`` (float64, no mask) is timed with
``triton.testing.do_bench`` (median, after warm-up).  FLOPs counted are the two matrix products
only, 2*b*h*sq*sk*(d+dv); the elementwise softmax is overhead against that count.  Baselines in
the same run: cuBLAS DGEMM (``torch.matmul`` float64, n = 8192) and the datasheet FP64 Tensor
Core peak of the H200 SXM (67 TFLOP/s, NVIDIA H200 datasheet; the NVL part is 60).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from numerics.reference import attention_reference  # noqa: E402

H200_FP64_TENSOR_PEAK = 67e12  # FLOP/s, NVIDIA H200 SXM datasheet
SHAPES = [  # (b, h, sq, sk, d)
    (1, 8, 4096, 4096, 128),
    (1, 4, 8192, 8192, 128),
    (1, 4, 8192, 8192, 256),
    (2, 16, 2048, 2048, 128),
    (4, 8, 1024, 1024, 64),
]


def bench(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=50, rep=300, return_mode="median") / 1e3  # seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.float64)
    dgemm = 2 * n**3 / bench(lambda: a @ a)
    a = None  # free it before the attention shapes
    rows = []
    g = torch.Generator(device=dev).manual_seed(0)
    for b, h, sq, sk, d in SHAPES:
        q = torch.randn(b, sq, h, d, device=dev, generator=g).bfloat16()
        k = torch.randn(b, sk, h, d, device=dev, generator=g).bfloat16()
        v = torch.randn(b, sk, h, d, device=dev, generator=g).bfloat16()
        t = bench(functools.partial(attention_reference, q, k, v))
        flops = 2 * b * h * sq * sk * (d + d)
        rows.append(
            {
                "shape": dict(b=b, h=h, sq=sq, sk=sk, d=d),
                "seconds": t,
                "tflops": flops / t / 1e12,
                "of_peak": flops / t / H200_FP64_TENSOR_PEAK,
                "of_dgemm": flops / t / dgemm,
            }
        )
        print(
            f"b{b} h{h} {sq}x{sk} d{d}: {t * 1e3:.2f} ms, {flops / t / 1e12:.1f} TFLOP/s = "
            f"{rows[-1]['of_peak']:.0%} of the 67 TFLOP/s peak, {rows[-1]['of_dgemm']:.0%} of measured DGEMM"
        )
        q = k = v = None
        torch.cuda.empty_cache()
    res = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "dgemm_tflops": dgemm / 1e12,
        "dgemm_of_peak": dgemm / H200_FP64_TENSOR_PEAK,
        "peak_tflops": H200_FP64_TENSOR_PEAK / 1e12,
        "shapes": rows,
    }
    print(f"DGEMM n={n}: {dgemm / 1e12:.1f} TFLOP/s = {dgemm / H200_FP64_TENSOR_PEAK:.0%} of peak")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
