"""The varlen model (``fa4.varlen.varlen_attention``, SM90 numerics) against production's
```flash_attn_varlen_func`` on the H200, bit for bit, on the varlen cases of the smoke and
release suites that production's SM90 path runs (bf16/fp16, no split-KV, finite inputs): per case
the share of outputs and LSE values identical, beside the same two computed per sequence by the
fixed-length entries (the model's fixed-length tie, and production's varlen-vs-fixed invariance).

    python benchmarks/experiments/varlen_fidelity.py --out reports/h200/varlen/fidelity.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from audits.suites.cases import suite
from audits.suites.inputs import make_varlen_inputs
from fa4.production import flash_attn_varlen
from fa4.varlen import varlen_attention
from numerics.fp import step_distance


def _same(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    w = torch.int16 if a.dtype.itemsize == 2 else torch.int32
    return a.contiguous().view(w) == b.contiguous().view(w)


def _fixed(x: dict, case, fn) -> tuple[torch.Tensor, torch.Tensor]:
    """``fn`` (a fixed-length call) on each sequence alone, packed back like the varlen output."""
    outs, lses = [], []
    kw = {k: x["kw"][k] for k in ("causal", "window_size", "softcap", "learnable_sink") if k in x["kw"]}
    for q, k, v in x["parts"]:
        if q.shape[1] == 0:
            continue
        o, lse = fn(q, k, v, return_lse=True, **kw)
        outs.append(o[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


def _one(case) -> dict:
    """Production varlen, the varlen model, and both fixed-length per sequence (the baseline:
    the model's fixed-length tie to production on the same sequences)."""
    from fa4.model import FA4Numerics, attention
    from fa4.production import flash_attn

    x = make_varlen_inputs(case, device="cuda")
    po, pl = flash_attn_varlen(x["q"], x["k"], x["v"], return_lse=True, **x["kw"])
    mo, ml = varlen_attention(x["q"], x["k"], x["v"], return_lse=True, arch="sm90", **x["kw"])
    fo, fl = _fixed(x, case, flash_attn)

    def model_fixed(q, k, v, **kw):
        nm = FA4Numerics.for_inputs("sm90", q, k, v, kw["causal"], kw["window_size"])
        return attention(q, k, v, numerics=nm, **kw)

    bo, bl = _fixed(x, case, model_fixed)
    rows = torch.zeros(po.shape[0], dtype=torch.bool, device=po.device)
    cu = x["kw"]["cu_seqlens_q"].tolist()
    for a, b in zip(cu[:-1], cu[1:]):
        rows[a:b] = True  # every packed row belongs to a sequence here (no seqused_q)
    po, mo, pl, ml = po[rows], mo[rows], pl[:, rows], ml[:, rows]
    frac = lambda m: round(float(m.float().mean()), 6) if m.numel() else 1.0
    return {
        "case": case.name,
        "outputs": po.numel(),
        "model_vs_production": {"out": frac(_same(mo, po)), "lse": frac(_same(ml, pl))},
        "model_vs_production_fixed": {"out": frac(_same(bo, fo)), "lse": frac(_same(bl, fl))},
        "production_varlen_vs_fixed": {"out": frac(_same(po, fo)), "lse": frac(_same(pl, fl))},
        "model_varlen_vs_fixed": {"out": frac(_same(mo, bo)), "lse": frac(_same(ml, bl))},
        "max_steps_model_vs_production": int(step_distance(po, mo).max()) if po.numel() else 0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-cases", type=int, default=12)
    args = ap.parse_args()
    t0 = time.perf_counter()
    cases = [c for s in ("smoke", "release") for c in suite(s) if c.varlen and c.num_splits == 1]
    cases = [c for c in cases if c.dtype in ("bfloat16", "float16") and not c.family.startswith("nan_inf")]
    recs = []
    for c in cases[: args.max_cases]:
        recs.append(_one(c))
        print(json.dumps(recs[-1]))
        _write(args.out, recs, t0)


def _write(out: str, recs: list, t0: float) -> None:
    """The report so far (rewritten after each case: a time limit keeps what was measured)."""
    keys = ("model_vs_production", "model_vs_production_fixed", "production_varlen_vs_fixed", "model_varlen_vs_fixed")
    summary = {"cases": len(recs)}
    for k in keys:  # output-weighted means
        n = sum(r["outputs"] for r in recs) or 1
        summary[k] = {f: sum(r[k][f] * r["outputs"] for r in recs) / n for f in ("out", "lse")}
    doc = {
        "what": "fa4.varlen (sm90) vs production flash_attn_varlen_func, bitwise",
        "device": torch.cuda.get_device_name(),
        "summary": summary,
        "cases": recs,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(out).with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(out)


if __name__ == "__main__":
    main()
