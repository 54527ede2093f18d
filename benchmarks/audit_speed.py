"""The audit's own speed: cases per second of ``fa4-audit run`` on a suite, from a cold and
then a warm compile cache (not a test).

    python benchmarks/audit_speed.py --kernel fa4 --suite release --device cuda --jobs 8 \
        --cold-limit 300 --warm-limit 150 --out DIR

Cold: a fresh, empty flash-attn-4 persistent compile cache (FLASH_ATTENTION_CUTE_DSL_CACHE_DIR)
and fresh processes, so every compile key compiles.  Warm: the same command again into a new
output directory with the cache the cold run filled.  Each phase runs under a wall-clock limit;
the rate is (cases finished) / (seconds), both read from the journals, so a phase cut short still
gives an honest rate of what it did.  Baseline cited for comparison: FA's own test suite on the
same H200, 37 cases in 170 s from a cold cache (as FA's own test file runs them; docs/h200-results.md).  Writes
DIR/speed.json; the cold run's directory holds a complete, resumable audit (DIR/cold).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FA_TESTS_CASES_PER_S = 37 / 170  # FA's test_flash_attn_output, cold cache, H200 (docs/h200-results.md)


def finished(out: Path) -> int:
    """Cases journaled under ``out`` (with --jobs, the jobs' journals; the parent keeps none),
    read as ``--resume`` reads them (a torn last line does not count)."""
    from audits.engine.journal import read_records as read_journal

    return sum(len(read_journal(j)) for j in out.rglob("journal.jsonl"))


def phase(name: str, argv: list[str], out: Path, limit: float, env: dict) -> dict:
    cmd = [sys.executable, "-m", "audits", "run", *argv, "--out", str(out), "--quiet"]
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        rc = p.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGTERM)  # the run and its jobs; journals keep what finished
        p.wait()
        rc = None
    dt = time.perf_counter() - t0
    n = finished(out)
    res = {"phase": name, "seconds": dt, "cases": n, "cases_per_s": n / dt, "exit_code": rc, "complete": rc is not None}
    print(
        f"{name}: {n} cases in {dt:.0f} s = {n / dt:.2f} cases/s"
        + ("" if rc is not None else f" (stopped at the {limit:.0f} s limit)"),
        flush=True,
    )
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernel", default="fa4")
    ap.add_argument("--suite", default="release")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--cold-limit", type=float, default=300)
    ap.add_argument("--warm-limit", type=float, default=150)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    cache = out / "compile-cache"
    cache.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED": "1",
        "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR": str(cache),
    }
    argv = ["--kernel", args.kernel, "--suite", args.suite, "--device", args.device, "--jobs", str(args.jobs)]
    res = {
        "kernel": args.kernel,
        "suite": args.suite,
        "jobs": args.jobs,
        "baseline_fa_tests_cases_per_s": FA_TESTS_CASES_PER_S,
    }
    res["cold"] = phase("cold", argv, out / "cold", args.cold_limit, env)
    res["warm"] = phase("warm", argv, out / "warm", args.warm_limit, env)
    for k in ("cold", "warm"):
        res[k]["vs_fa_tests"] = res[k]["cases_per_s"] / FA_TESTS_CASES_PER_S
    (out / "speed.json").write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
