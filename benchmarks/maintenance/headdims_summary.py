"""Summarise a head-dim sweep run directory (benchmarks/device/h200_headdims.sh): per kernel, per head
dim x dtype x mask, the verdict, the worst error/bound of the output and of each gradient, the
case's seconds (its compile included: each case of the sweep is its own compile key) and the
gate's reasons (FA's criterion among them, as ``audits.verdict.gate`` judges it).  RUN_DIR holds
``KERNEL/report.json`` or ``report.json`` (``.xz`` too: the committed reports).
Usage: python benchmarks/maintenance/headdims_summary.py RUN_DIR"""

import json
import sys
from pathlib import Path

from audits.common import read_bytes


def _tight(x: dict | None) -> float:
    b = (x or {}).get("bound") or {}
    t = b.get("tightness")
    return float("nan") if t is None else t


def main(run_dir: str) -> None:
    d = Path(run_dir)
    for rep in sorted(d.glob("*/report.json*")) or sorted(d.glob("report.json*")):
        r = json.loads(read_bytes(rep))
        print(f"== {r['kernel']}: {r['summary']['verdicts']}")
        total = 0.0
        for c in r["cases"]:
            cfg, bw = c["config"], c.get("backward") or {}
            grads = bw.get("grads") or {}
            total += c.get("seconds") or 0.0
            t = " ".join(f"{g}={_tight(grads.get(g)):.3g}" if grads.get(g) else f"{g}=-" for g in ("dq", "dk", "dv"))
            why = "" if c["verdict"] == "pass" else " | " + "; ".join(c.get("reasons") or [])[:160]
            mask = "causal" if cfg["causal"] else "full  "
            print(
                f"  {cfg['dtype'][:4]} d{cfg['d']:<3} h{cfg['heads_q']}k{cfg['heads_kv']} {mask} {c['verdict']:<7} "
                f"out={_tight(c):.3g} {t}  bwd={bw.get('status')} {c.get('seconds', 0):.1f}s{why}"
            )
        print(f"  cases {len(r['cases'])}, seconds summed over cases {total:.0f}")


if __name__ == "__main__":
    main(sys.argv[1])
