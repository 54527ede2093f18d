"""Production's head-dim backward defect, the tensors themselves (issue 35, docs/h200-results.md
"Causes on real kernels"): for each case of benchmarks/device/headdims_minimal.json, flash-attn-4's
gradients (fa4, CUDA) and the FP64 ones (numerics.grad_reference) into $OUT/headdim_grads.pt, to
read what the wrong rows hold (zero, another tile's values, shifted columns) offline.

    python benchmarks/device/h200_headdim_dq.py   # on the H200, after benchmarks/device/h200_env.sh

KERNEL and DEVICE (default fa4, cuda) pick another kernel and device (the model on the CPU: a dry run).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from audits.kernels import get_kernel
from audits.suites.cases import Case
from audits.suites.inputs import make_grad_output, make_inputs
from numerics.call import AttentionCall
from numerics.grad_reference import attention_grad_reference


def main() -> int:
    out = Path(os.environ.get("OUT", "/tmp/out"))
    fn, device = get_kernel(os.environ.get("KERNEL", "fa4")), os.environ.get("DEVICE", "cuda")
    saved = {}
    for cfg in json.loads(Path("benchmarks/device/headdims_minimal.json").read_text()):
        case = Case(**cfg)
        x = make_inputs(case, device=device)
        do, _ = make_grad_output(case, device=device)
        leaves = {n: x[n].detach().clone().requires_grad_(True) for n in ("q", "k", "v")}
        try:
            o, _lse = fn(leaves["q"], leaves["k"], leaves["v"], return_lse=True, **x["kw"])
            got = torch.autograd.grad(o, list(leaves.values()), do)
        except Exception as exc:  # d104 / d112 without a mask do not compile (docs/h200-results.md)
            print(f"{case.name}: {type(exc).__name__}: {str(exc)[:120]}")
            continue
        call = AttentionCall.from_kwargs(**x["kw"])
        ref = attention_grad_reference(x["q"], x["k"], x["v"], do, call=call)
        rec = {"config": cfg}
        for n, g in zip(("dq", "dk", "dv"), got):
            rec[n] = g.detach().cpu()
            rec[f"ref_{n}"] = ref[n].detach().cpu()
        dq, r = rec["dq"].double(), rec["ref_dq"]
        half = case.seqlen_q // 2
        print(
            f"{case.name}: dq rows 0..{half - 1} max|err| {float((dq[:, :half] - r[:, :half]).abs().max()):.3g}, "
            f"rows {half}.. max|err| {float((dq[:, half:] - r[:, half:]).abs().max()):.3g}, "
            f"exactly zero there {float((rec['dq'][:, half:] == 0).double().mean()):.3f}"
        )
        saved[case.name] = rec
    torch.save(saved, out / "headdim_grads.pt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
