"""The failing cases of committed reports, as a case file for ``fa4-audit run --case-file``:
the H200 re-run that gives committed reports their diagnoses (benchmarks/device/h200_diagnose.sh)
runs exactly these cases again (same configuration and seed, so the same inputs).
Usage: python benchmarks/maintenance/failing_cases.py OUT.json REPORT [REPORT ...]
REPORT: a ``report.json`` (``.xz`` too) or a directory holding ``*/report.json*``."""

import json
import sys
from pathlib import Path

from audits.common import read_bytes
from audits.report.schema import FAILING


def failing_configs(paths: list[str]) -> list[dict]:
    """Each failing case's configuration once (by case name), in the order first met."""
    seen: dict[str, dict] = {}
    for p in map(Path, paths):
        files = sorted(p.glob("*/report.json*")) or sorted(p.glob("report.json*")) if p.is_dir() else [p]
        for f in files:
            for c in json.loads(read_bytes(f))["cases"]:
                if c["verdict"] in FAILING:
                    seen.setdefault(c["case"], c["config"])
    return list(seen.values())


if __name__ == "__main__":
    out, *reports = sys.argv[1:]
    cfgs = failing_configs(reports)
    Path(out).write_text(json.dumps(cfgs) + "\n")
    print(f"{out}: {len(cfgs)} failing cases of {len(reports)} report(s)")
