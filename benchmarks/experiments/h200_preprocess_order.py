"""Which order of a preprocess thread's 16 products (D = rowsum(O * dO), head dim 256: two chunks
of 8 columns per thread) reproduces production's deterministic SM90 backward on the H200 (not a
test; 2026-12-01, ``reports/h200/bitexact-2026-12-01/preprocess_order.json``).  Production's
preprocess folds them element-major (0, 128, 1, 129, ...: its sm_90a PTX); the model had them
chunk-major.  Each order is patched into ``fa4.model_bwd.row_dot`` and the gradients of
``fa4-model-sm90-tc`` compared with production's, counting differing dq, dk, dv elements.

    OUT=DIR python benchmarks/experiments/h200_preprocess_order.py
"""

import json
import os
import sys

import torch

sys.path.insert(0, ".")
import fa4.model_bwd as mb  # noqa: E402
from audits.kernels import get_kernel  # noqa: E402
from audits.suites.cases import Case  # noqa: E402
from audits.suites.inputs import make_inputs  # noqa: E402


def row_dot_order(order):
    def f(out, do, hdimv_multiple):
        dv = out.shape[-1]
        dvp = -(-dv // hdimv_multiple) * hdimv_multiple
        gk = next(g for g in (128, 64, 32, 16) if dvp % g == 0)
        prod_ = torch.nn.functional.pad(out.float() * do.float(), (0, dvp - dv))
        per = prod_.reshape(*prod_.shape[:-1], dvp // gk, gk // 8, 8).transpose(-3, -2)  # (..., thread, chunk, 8)
        per = per.reshape(*per.shape[:-2], -1)[..., order]
        acc = per[..., 0].clone()
        for i in range(1, per.shape[-1]):
            acc = acc + per[..., i]
        return mb.butterfly(acc)

    return f


def grads(fn, x: dict, do: torch.Tensor) -> tuple:
    q, k, v = (x[n].detach().clone().requires_grad_(True) for n in ("q", "k", "v"))
    out = fn(q, k, v, deterministic=True, return_lse=True, **x["kw"])[0]
    return torch.autograd.grad(out, [q, k, v], do)


#: positions in a thread's (chunk-major) 16 products; "interleaved" is production's element-major
ORDERS = {
    "chunk0_then_chunk1": list(range(16)),
    "interleaved": [c * 8 + e for e in range(8) for c in range(2)],
    "chunk1_then_chunk0": list(range(8, 16)) + list(range(8)),
    "reversed": list(range(15, -1, -1)),
    "pairs": [c * 8 + 2 * p + h for p in range(4) for c in range(2) for h in range(2)],
}


def main() -> None:
    from flash_attn.cute import flash_attn_func as prod

    res = {}
    cases = {
        # d256: h200_backward.py's d256 case
        "d256": Case("bfloat16", 256, 256, 2, 4, 4, 128, 256, seed=10),
        "d256b": Case("bfloat16", 256, 256, 2, 4, 4, 256, 384, seed=21),
    }
    for name, c in cases.items():
        x = make_inputs(c, device="cuda")
        g = torch.Generator().manual_seed(c.seed + 1000)
        do = torch.randn(2, c.seqlen_q, 4, 256, generator=g).bfloat16().cuda()
        pg = grads(prod, x, do)
        for oname, order in ORDERS.items():
            mb.row_dot = row_dot_order(torch.tensor(order))
            mg = grads(get_kernel("fa4-model-sm90-tc"), x, do)
            res[f"{name}/{oname}"] = [int((a != b).sum()) for a, b in zip(pg, mg, strict=True)]  # dq, dk, dv
            print(name, oname, res[f"{name}/{oname}"], flush=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "preprocess_order.json"), "w") as fh:
        json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
