"""Two source trees of fa4-audit on the same run: the same results, and how their speed compares
(not a test).

    python benchmarks/same_results.py --base /tmp/base --cand . --rounds 3 -- \
        --kernel fa4-model --suite smoke

Runs ``python -m audits run ARGS`` from each tree (the tree first on ``PYTHONPATH``, so the
installed package is not what runs), alternating base and candidate ``--rounds`` times so that a
noisy machine slows both alike, and reports the median wall time of each and their ratio.  Then it
compares the reports' case records field for field, every field but the time a case took
(``seconds``) and a traceback's frames (its last line, the exception, is compared): a refactor
that keeps the behaviour leaves every metric, verdict, reason and reproducer identical.  Exit 0
when the records agree, 1 when any differs (the first differences are printed).  Writes
OUT/same_results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

#: record fields that legitimately differ between two runs of the same code
VOLATILE = ("seconds", "call_seconds")  # audits.report.records.TIMING_FIELDS, at any depth


def run_once(tree: Path, argv: list[str], out: Path) -> float:
    """Wall seconds of one ``run`` from ``tree`` into ``out`` (its exit code 0 or 1: a verdict)."""
    path = os.pathsep.join(p for p in (str(tree.resolve()), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    cmd = [sys.executable, "-m", "audits", "run", *argv, "--out", str(out), "--overwrite", "--quiet"]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if p.returncode not in (0, 1):
        sys.exit(f"{tree}: run exited {p.returncode}:\n{p.stderr[-2000:]}")
    return dt


def reports(out: Path) -> dict[str, dict]:
    """Each kernel's report under ``out`` (one ``report.json``, or one per kernel directory)."""
    return {str(p.parent.relative_to(out)): json.loads(p.read_text()) for p in sorted(out.rglob("report.json"))}


def _strip(value):
    if isinstance(value, dict):
        # a traceback names the tree's own files and lines: compare its last line, the exception
        return {
            k: (v.strip().splitlines()[-1] if k == "traceback" and isinstance(v, str) and v.strip() else _strip(v))
            for k, v in value.items()
            if k not in VOLATILE
        }
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


def differences(base: dict[str, dict], cand: dict[str, dict]) -> list[str]:
    """Where the two runs' case records differ (kernels, cases, then fields), in words."""
    if sorted(base) != sorted(cand):
        return [f"kernels differ: {sorted(base)} vs {sorted(cand)}"]
    out = []
    for kern in base:
        b = {c["case"]: _strip(c) for c in base[kern]["cases"]}
        c = {c["case"]: _strip(c) for c in cand[kern]["cases"]}
        if list(b) != list(c):
            out.append(f"{kern}: cases differ: {len(b)} vs {len(c)}, {len(set(b) ^ set(c))} not in both")
            continue
        for name in b:
            for field in sorted(set(b[name]) | set(c[name])):
                if b[name].get(field) != c[name].get(field):
                    out.append(f"{kern} / {name}: {field}: {b[name].get(field)!r:.200} vs {c[name].get(field)!r:.200}")
        if _strip(base[kern]["summary"]) != _strip(cand[kern]["summary"]):
            out.append(f"{kern}: the summaries differ")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", type=Path, required=True, help="the baseline source tree")
    ap.add_argument("--cand", type=Path, default=Path("."), help="the candidate source tree (default: .)")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each tree, alternating (default 3)")
    ap.add_argument("--out", type=Path, default=Path("reports/same-results-latest"))
    ap.add_argument("run_args", nargs=argparse.REMAINDER, help="-- then the arguments of `fa4-audit run`")
    args = ap.parse_args()
    argv = [a for a in args.run_args if a != "--"]
    times = {"base": [], "cand": []}
    for i in range(args.rounds):
        for side, tree in (("base", args.base), ("cand", args.cand)):
            dt = run_once(tree, argv, args.out.resolve() / side)
            times[side].append(dt)
            print(f"round {i + 1}: {side} {dt:.1f} s", flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    diff = differences(reports(args.out / "base"), reports(args.out / "cand"))
    result = {
        "run": argv,
        "seconds": times,
        "median_s": med,
        "ratio_cand_over_base": med["cand"] / med["base"],
        "differences": diff[:50],
        "n_differences": len(diff),
    }
    (args.out / "same_results.json").write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"median: base {med['base']:.1f} s, candidate {med['cand']:.1f} s (ratio {result['ratio_cand_over_base']:.3f})"
    )
    print("records identical" if not diff else f"{len(diff)} differences; first: " + "\n  ".join(diff[:10]))
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
