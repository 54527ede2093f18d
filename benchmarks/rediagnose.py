"""Give committed reports the diagnoses of an H200 re-run of their failing cases
(benchmarks/h200_diagnose.sh ran them again: same configurations and seeds, so the same
inputs).  For each failing case of the committed report that the re-run has, the re-run's
``diagnosis`` and error-map data (``maps/<case>.npz``) are taken, with the re-run's verdict
beside the committed one (``rediagnosed``: a case whose verdict changed is said, not hidden);
the separators are computed from the committed cases (they need the verdicts only); then the
report is written again (``audits.runner.report.write_report``: report.md, maps/*.png of the
worst cases) and its JSON compressed as committed (``report.json.xz``).
Usage: python benchmarks/rediagnose.py COMMITTED_DIR RERUN_KERNEL_DIR [--date YYYY-MM-DD]"""

import json
import lzma
import shutil
import sys
import tempfile
from pathlib import Path

from audits.common import read_bytes
from audits.runner.engine import FAILING
from audits.runner.report import write_report
from audits.runner.separators import separators

#: maps rendered into a committed report (PNG only: the SVGs and the npz data stay out of the repo)
MAPS = 4


def rediagnose(committed: Path, rerun: Path, *, when: str) -> dict:
    """Patch the committed report in ``committed`` with the diagnoses of ``rerun``; counts."""
    src = committed / "report.json.xz" if (committed / "report.json.xz").exists() else committed / "report.json"
    rep = json.loads(read_bytes(src))
    new = {c["case"]: c for c in json.loads(read_bytes(rerun / "report.json"))["cases"]}
    counts = {"failing": 0, "diagnosed": 0, "same_verdict": 0, "changed": []}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        (out / "maps").mkdir()
        for c in rep["cases"]:
            if c["verdict"] not in FAILING:
                continue
            counts["failing"] += 1
            r = new.get(c["case"])
            if r is None:
                continue
            c["diagnosis"] = r.get("diagnosis", {})
            c["rediagnosed"] = {"on": when, "verdict": r["verdict"]}
            counts["diagnosed"] += 1
            if r["verdict"] == c["verdict"]:
                counts["same_verdict"] += 1
            else:
                counts["changed"].append(f"{c['case']}: {c['verdict']} -> {r['verdict']}")
            if r.get("error_map") and (rerun / r["error_map"]).exists():
                shutil.copy(rerun / r["error_map"], out / r["error_map"])
                c["error_map"] = r["error_map"]
        rep["diagnosis"] = separators(rep["cases"], arch=(rep.get("coverage") or {}).get("arch"))
        rep["rediagnosed"] = {"on": when, **{k: v for k, v in counts.items() if k != "changed"},
                              "changed": counts["changed"]}  # fmt: skip
        paths = write_report(rep, out, maps=MAPS)
        shutil.copy(paths["md"], committed / "report.md")
        if src.suffix == ".xz":
            (committed / "report.json.xz").write_bytes(lzma.compress(paths["json"].read_bytes(), preset=9))
        else:
            shutil.copy(paths["json"], committed / "report.json")
        pngs = sorted((out / "maps").glob("*.png"))
        if pngs:
            (committed / "maps").mkdir(exist_ok=True)
            for p in pngs:
                shutil.copy(p, committed / "maps" / p.name)
    return counts


if __name__ == "__main__":
    args = sys.argv[1:]
    when = args[args.index("--date") + 1] if "--date" in args else "2026-12-01"
    committed, rerun = map(Path, [a for a in args if not a.startswith("--") and a != when][:2])
    res = rediagnose(committed, rerun, when=when)
    print(
        f"{committed}: {res['diagnosed']} of {res['failing']} failing cases diagnosed from {rerun}; "
        f"{res['same_verdict']} with the same verdict; changed: {res['changed'] or 'none'}"
    )
