"""Probe how the H200's tensor cores sum: ``wgmma.mma_async ... .f32.bf16.bf16`` (and f16), the
instruction production's SM90 forward issues for S = Q K^T and O += P V, driven through Triton's
``tl.dot`` with a float32 accumulator (one warpgroup, 64-row tiles: Triton lowers it to
``wgmma.mma_async.sync.aligned.m64nNk16``; the PTX is saved and checked for it).

Each output is ``D[i, j] = C[i, j] + sum_k A[i, k] B[k, j]`` over K = 16..128 (1..8 chained k16
instructions).  Two kinds of rows (the method of Fasi, Higham, Mikaitis & Pranesh 2021):

* crafted probes (``PROBES``): with B = 1, a row's products are its A values; C and A are chosen
  so that the result tells the number of alignment bits kept below the largest exponent, the
  rounding of shifted-out bits and of the normalised sum, the block of products summed together
  and whether C joins the first block's alignment;
* random rows (A, B of several exponent spreads, C random), kept to validate the fitted model on
  the CPU afterwards (``numerics.tensor_core``), since each device call is precious.

    python benchmarks/experiments/mma_probe.py --out $OUT/mma_probe.pt
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

ROWS = 64  # one wgmma M tile per program


@triton.jit
def _mma(A, B, C, D, K: tl.constexpr, N: tl.constexpr):
    pid = tl.program_id(0)
    rm = tl.arange(0, 64)
    rk = tl.arange(0, K)
    rn = tl.arange(0, N)
    a = tl.load(A + pid * 64 * K + rm[:, None] * K + rk[None, :])
    b = tl.load(B + pid * K * N + rk[:, None] * N + rn[None, :])
    c = tl.load(C + pid * 64 * N + rm[:, None] * N + rn[None, :])
    d = tl.dot(a, b, c)
    tl.store(D + pid * 64 * N + rm[:, None] * N + rn[None, :], d)


def _probes(k: int) -> list[tuple[str, float, dict]]:
    """(name, C, {slot: value}) with B = 1.  Powers of two are exact in bf16 and fp16 down to
    2**-24 (fp16's subnormals; beyond it only bf16 rows are meaningful)."""
    p = []
    for t in range(22, 31):  # n = 2**(t-23) products of 2**-t sum to 2**-23 = one ulp of 1
        n = 1 << max(t - 23, 0) if t >= 23 else 1
        if n <= 16:
            p.append((f"bits t={t} x{n}", 1.0, {1 + i: 2.0**-t for i in range(n)}))
    p.append(("round: 1 + 2^-24 + 2^-25", 1.0, {1: 2.0**-24, 2: 2.0**-25}))  # 0.75 ulp: RN up, RZ down
    p.append(("round: 1 - 2^-25", 1.0, {1: -(2.0**-25)}))  # tie below 1: RZ 1-2^-24, RN-even 1
    p.append(("round: -1 - 2^-24 - 2^-25", -1.0, {1: -(2.0**-24), 2: -(2.0**-25)}))
    p.append(("round: 1 + 2^-23 + 2^-24", 1.0, {1: 2.0**-23, 2: 2.0**-24}))  # 1.5 ulp: RN-even 2 ulp, RZ 1
    for lo in (1, 2, 4, 8):  # big product in slot 0, eight 2^-26 in slots from `lo`: same block or not
        p.append((f"block: 1 at 0, 8x2^-26 at {lo}..", 0.0, {0: 1.0, **{lo + i: 2.0**-26 for i in range(8)}}))
    p.append(("acc: C=1, 8x2^-26", 1.0, {i: 2.0**-26 for i in range(8)}))  # C aligned with the products?
    p.append(("acc: C=1, 16x2^-27", 1.0, {i: 2.0**-27 for i in range(16)}))
    if k >= 32:  # the second instruction: the big value now sits in the accumulator
        p.append(("chain: 1 at 0, 8x2^-26 at 16..", 0.0, {0: 1.0, **{16 + i: 2.0**-26 for i in range(8)}}))
        p.append(("chain: 8x2^-26 at 0, 1 at 16", 0.0, {16: 1.0, **{i: 2.0**-26 for i in range(8)}}))
    p.append(("cancel: C=1, -1 at 0, 2^-30 at 1", 1.0, {0: -1.0, 1: 2.0**-30}))
    p.append(("cancel: 1, -1, 2^-30 (C=0)", 0.0, {0: 1.0, 1: -1.0, 2: 2.0**-30}))
    return [(n, c, {s: v for s, v in slots.items() if s < k}) for n, c, slots in p]


def _random(k: int, dt: torch.dtype, g: torch.Generator, progs: int):
    """A, B, C of several exponent spreads: N(0,1) scaled by 2**U[-s, s] per element."""
    out = []
    for spread in (0, 4, 12):
        a = torch.randn(progs * ROWS, k, generator=g) * 2.0 ** torch.randint(
            -spread, spread + 1, (progs * ROWS, k), generator=g
        )
        b = torch.randn(progs, k, 64, generator=g) * 2.0 ** torch.randint(
            -spread, spread + 1, (progs, k, 64), generator=g
        )
        c = torch.randn(progs * ROWS, 64, generator=g) * 2.0 ** torch.randint(
            -spread, spread + 1, (progs * ROWS, 64), generator=g
        )
        out.append((a.to(dt), b.to(dt), c.float()))
    return out


def _launch(a, b, c, k: int):
    progs = a.shape[0] // ROWS
    d = torch.empty_like(c)
    res = _mma[(progs,)](a, b, c, d, K=k, N=64, num_warps=4)
    return d, res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    results, ptx = [], {}
    for dt in (torch.bfloat16, torch.float16):
        for k in (16, 32, 64, 128):
            probes = _probes(k)
            a = torch.zeros(ROWS, k)
            c = torch.zeros(ROWS, 64)
            for i, (_, cval, slots) in enumerate(probes):
                c[i] = cval
                for s, v in slots.items():
                    a[i, s] = v
            b = torch.ones(1, k, 64)
            sets = [("probe", a.to(dt), b.to(dt), c)] + [("random", *t) for t in _random(k, dt, g, 4)]
            for kind, aa, bb, cc in sets:
                d, res = _launch(aa.to(dev), bb.to(dev).contiguous(), cc.to(dev), k)
                name = f"{str(dt).removeprefix('torch.')}-k{k}"
                asm = getattr(res, "asm", {}).get("ptx", "")
                ptx[name] = [ln.strip() for ln in asm.splitlines() if "wgmma" in ln or "mma" in ln][:12]
                results.append({"dtype": str(dt), "k": k, "kind": kind, "a": aa, "b": bb, "c": cc, "d": d.cpu(),
                                "names": [n for n, _, _ in probes] if kind == "probe" else None})  # fmt: skip
            for i, (n, _, _) in enumerate(probes):
                v = results[-4]["d"][i, 0].item()
                print(f"{name:14s} {n:34s} {float.hex(v)}")
    torch.save({"results": results, "ptx": ptx, "device": torch.cuda.get_device_name(),
                "triton": triton.__version__}, args.out)  # fmt: skip
    for name, lines in ptx.items():
        print(name, lines[:2])


if __name__ == "__main__":
    main()
