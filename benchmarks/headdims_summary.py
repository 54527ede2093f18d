"""Summarise a head-dim sweep run directory (benchmarks/h200_headdims.sh): per kernel, per head
dim x dtype x mask, the verdict, the worst error/bound of the output and of each gradient, the
FA-criterion excess per gradient, and the case's seconds (its compile included: each case of
the sweep is its own compile key).  Usage: python benchmarks/headdims_summary.py RUN_DIR"""

import json
import sys
from pathlib import Path


def _tight(x: dict | None) -> float:
    b = (x or {}).get("bound") or {}
    t = b.get("tightness")
    return float("nan") if t is None else t


def _fa_excess(g: dict | None) -> float:
    """max_abs / (2 x lowprec_max_abs + rounding): FA's own test criterion (> 1 fails it)."""
    fa = (g or {}).get("fa_criterion") or {}
    if not fa or fa.get("lowprec_max_abs") is None:
        return float("nan")
    return fa["max_abs"] / (2 * fa["lowprec_max_abs"] + fa.get("rounding", 0.0) + 1e-30)


def main(run_dir: str) -> None:
    for rep in sorted(Path(run_dir).glob("*/report.json")) or sorted(Path(run_dir).glob("report.json")):
        r = json.loads(rep.read_text())
        print(f"== {r['kernel']}: {r['summary']['verdicts']}")
        total = 0.0
        for c in r["cases"]:
            cfg, bw = c["config"], c.get("backward") or {}
            grads = bw.get("grads") or {}
            total += c.get("seconds") or 0.0
            t = " ".join(
                f"{g}={_tight(grads.get(g)):.3g}/{_fa_excess(grads.get(g)):.3g}" if grads.get(g) else f"{g}=-"
                for g in ("dq", "dk", "dv")
            )
            why = "" if c["verdict"] == "pass" else " | " + "; ".join(c.get("reasons") or [])[:160]
            mask = "causal" if cfg["causal"] else "full  "
            print(
                f"  {cfg['dtype'][:4]} d{cfg['d']:<3} h{cfg['heads_q']}k{cfg['heads_kv']} {mask} {c['verdict']:<7} "
                f"out={_tight(c):.3g} {t}  bwd={bw.get('status')} {c.get('seconds', 0):.1f}s{why}"
            )
        print(f"  cases {len(r['cases'])}, seconds summed over cases {total:.0f}")


if __name__ == "__main__":
    main(sys.argv[1])
