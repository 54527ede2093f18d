"""Give committed reports the diagnoses of an H200 re-run of their failing cases
(benchmarks/device/h200_diagnose.sh ran them again: same configurations and seeds, so the same
inputs).  For each failing case of the committed report that the re-run has with the same result
(:func:`_measured`: largest errors, non-finite and violation counts), the re-run's ``diagnosis``
and error-map data (``maps/<case>.npz``) are taken, with the re-run's verdict beside the
committed one (``rediagnosed``); a case whose result differs is said in report.md, not taken;
the separators are computed from the committed cases (they need the verdicts only); then the
report is written again (``audits.report.build.write_report``: report.md, maps/*.png of the
worst cases) and its JSON compressed as committed (``report.json.xz``).
Usage: python benchmarks/maintenance/rediagnose.py COMMITTED_DIR RERUN_KERNEL_DIR|- [--date YYYY-MM-DD] [--how TEXT]
(``-``: no re-run; the report gets its separators only, its failing cases no diagnosis)."""

import json
import lzma
import shutil
import sys
import tempfile
from pathlib import Path

from PIL import Image

from audits.common import read_bytes
from audits.report.build import validate_report, write_report
from audits.report.schema import FAILING
from audits.verdict.separators import separators

#: maps rendered into a committed report (PNG only: the SVGs and the npz data stay out of the repo)
MAPS = 1


def _measured(rec: dict) -> tuple:
    """What a case's diagnosis rests on, as the record states it: the status, the largest errors
    and the counts of non-finite values and bound violations of the output, LSE and gradients.
    A re-run's diagnosis is taken only where these are the same (the same result again)."""
    out, lse, b = rec.get("out") or {}, rec.get("lse") or {}, rec.get("bound") or {}
    grads = ((rec.get("backward") or {}).get("grads")) or {}
    return (
        rec.get("status"),
        out.get("max_abs"), out.get("nonfinite_where_ref_finite"), lse.get("nonfinite_where_ref_finite"),
        b.get("violations"), b.get("lse_violations"),
        *((n, g.get("max_abs"), (g.get("bound") or {}).get("violations")) for n, g in sorted(grads.items())),
    )  # fmt: skip


def rediagnose(committed: Path, rerun: Path | None, *, when: str, how: str) -> dict:
    """Patch the committed report in ``committed`` with the diagnoses of ``rerun``; counts."""
    src = committed / "report.json.xz" if (committed / "report.json.xz").exists() else committed / "report.json"
    rep = validate_report(json.loads(read_bytes(src)), str(src))  # older reports upgraded to today's schema
    new = {} if rerun is None else {c["case"]: c for c in json.loads(read_bytes(rerun / "report.json"))["cases"]}
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
            if _measured(r) != _measured(c):  # another result: its diagnosis is not this case's
                counts["changed"].append(f"{c['case']}: {_measured(c)} then, {_measured(r)} now")
                continue
            c["diagnosis"] = r.get("diagnosis", {})
            c["rediagnosed"] = {"on": when, "verdict": r["verdict"]}
            counts["diagnosed"] += 1
            counts["same_verdict"] += r["verdict"] == c["verdict"]
            if r.get("error_map") and (rerun / r["error_map"]).exists():
                shutil.copy(rerun / r["error_map"], out / r["error_map"])
                c["error_map"] = r["error_map"]
        rep["diagnosis"] = separators(rep["cases"], arch=(rep.get("coverage") or {}).get("arch"))
        rep["rediagnosed"] = {"on": when, **{k: v for k, v in counts.items() if k != "changed"},
                              "changed": counts["changed"]}  # fmt: skip
        paths = write_report(rep, out, maps=MAPS)
        md = paths["md"].read_text()
        said = (
            f"Diagnoses ({when}): {counts['diagnosed']} of the {counts['failing']} failing cases were run again "
            f"{how} and gave the same result (largest errors, non-finite and violation counts), "
            f"{counts['same_verdict']} the same verdict"
            + (
                f"; {len(counts['changed'])} gave another result, not taken: {'; '.join(counts['changed'])}"
                if counts["changed"]
                else ""
            )
            + "; the others have no diagnosis. Separators: from the committed verdicts."
        )
        if rerun is None:
            said = f"Separators ({when}): from the committed verdicts; no failing case was run again (no diagnosis)."
        (committed / "report.md").write_text(md.rstrip("\n") + "\n\n" + said + "\n")
        if src.suffix == ".xz":
            (committed / "report.json.xz").write_bytes(lzma.compress(paths["json"].read_bytes(), preset=9))
        else:
            shutil.copy(paths["json"], committed / "report.json")
        pngs = sorted((out / "maps").glob("*.png"))
        if pngs:
            (committed / "maps").mkdir(exist_ok=True)
            for p in pngs:  # 128 colours (the colour scale's own steps are fewer): a third of the bytes
                Image.open(p).convert("RGB").quantize(colors=128).save(committed / "maps" / p.name, optimize=True)
    return counts


if __name__ == "__main__":
    args = sys.argv[1:]
    opt = {k: args[args.index(k) + 1] for k in ("--date", "--how") if k in args}
    when, how = opt.get("--date", "2026-12-01"), opt.get("--how", "on the H200 (benchmarks/device/h200_diagnose.sh)")
    committed, rerun = map(Path, [a for a in args if not a.startswith("--") and a not in opt.values()][:2])
    res = rediagnose(committed, None if str(rerun) == "-" else rerun, when=when, how=how)
    print(
        f"{committed}: {res['diagnosed']} of {res['failing']} failing cases diagnosed from {rerun}; "
        f"{res['same_verdict']} with the same verdict; changed: {res['changed'] or 'none'}"
    )
