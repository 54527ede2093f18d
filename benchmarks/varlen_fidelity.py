"""The varlen model (``fa4.varlen.varlen_attention``, SM90 numerics) against production's
``flash_attn_varlen_func`` on the H200, bit for bit, on the varlen cases of the smoke and
release suites that production's SM90 path runs (bf16/fp16, no split-KV): per case the share of
outputs and LSE values identical, and the largest distance in output steps.

    python benchmarks/varlen_fidelity.py --out reports/h200/varlen/fidelity.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from audits.cases import suite
from audits.inputs import make_varlen_inputs
from fa4.production import flash_attn_varlen
from fa4.varlen import varlen_attention
from numerics.fp import step_distance


def _one(case) -> dict:
    x = make_varlen_inputs(case, device="cuda")
    po, pl = flash_attn_varlen(x["q"], x["k"], x["v"], return_lse=True, **x["kw"])
    mo, ml = varlen_attention(x["q"], x["k"], x["v"], return_lse=True, arch="sm90", **x["kw"])
    cu = x["kw"]["cu_seqlens_q"].tolist()
    rows = torch.zeros(po.shape[0], dtype=torch.bool, device=po.device)
    for a, b in zip(cu[:-1], cu[1:]):
        rows[a:b] = True  # every packed row belongs to a sequence here (no seqused_q)
    po, mo, pl, ml = po[rows], mo[rows], pl[:, rows], ml[:, rows]
    same_o = po.view(torch.int16) == mo.view(torch.int16)
    same_l = pl.view(torch.int32) == ml.view(torch.int32)
    steps = step_distance(po, mo)
    return {
        "case": case.name,
        "outputs": same_o.numel(),
        "out_identical": int(same_o.sum()),
        "lse_identical": int(same_l.sum()),
        "lse_values": same_l.numel(),
        "max_steps": int(steps.max()) if steps.numel() else 0,
        "beyond_1_step": int((steps > 1).sum()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    t0 = time.perf_counter()
    cases = [c for s in ("smoke", "release") for c in suite(s) if c.varlen and c.num_splits == 1]
    cases = [c for c in cases if c.dtype in ("bfloat16", "float16") and not c.family.startswith("nan_inf")]
    recs = []
    for c in cases:
        recs.append(_one(c))
        r = recs[-1]
        print(f"{r['out_identical'] / r['outputs']:.5%} out, {r['lse_identical'] / r['lse_values']:.4%} lse  {c.name}")
    tot = {
        k: sum(r[k] for r in recs) for k in ("outputs", "out_identical", "lse_values", "lse_identical", "beyond_1_step")
    }
    summary = {
        **tot,
        "cases": len(recs),
        "fraction_identical": tot["out_identical"] / max(tot["outputs"], 1),
        "lse_fraction_identical": tot["lse_identical"] / max(tot["lse_values"], 1),
        "max_steps": max((r["max_steps"] for r in recs), default=0),
    }
    doc = {
        "what": "fa4.varlen (sm90) vs production flash_attn_varlen_func, bitwise",
        "device": torch.cuda.get_device_name(),
        "summary": summary,
        "cases": recs,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
