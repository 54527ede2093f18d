"""Rebuild the journals of a cut-short ``--jobs`` release run from its committed reports (not a
test), so that a later device session resumes it (``run --resume``) instead of starting over: the
journals themselves live in an ignored folder of one machine, the reports are in the repository.

    python benchmarks/maintenance/release_state_from_reports.py [--reports reports/h200/release-backward]
        [--kernels fa4,fa4-model-sm90] [--jobs 8] [--out .release-state/bwd.tgz]

Each job's journal gets the header its ``run --shard I/N --shard-by key`` child writes
(``journal.run_identity``: kernel, suite, seed, thresholds, the shard's cases, the backward
options) and the report's records of that shard; records the audit itself failed (``--resume``
redoes them) are kept out.  The archive holds ``jobs/I/<kernel>/journal.jsonl``, the layout
``benchmarks/device/h200_release_backward.sh`` unpacks.
"""

from __future__ import annotations

import argparse
import io
import json
import lzma
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from audits.engine import journal  # noqa: E402
from audits.engine.backward import BackwardOptions  # noqa: E402
from audits.engine.run import is_audit_error  # noqa: E402
from audits.engine.shards import shard_cases  # noqa: E402
from audits.suites.cases import release_suite  # noqa: E402
from audits.verdict.gate import load_thresholds  # noqa: E402


def journals(report: dict, kernel: str, jobs: int, backward) -> dict[str, str]:
    """``{"jobs/I/<kernel>/journal.jsonl": text}`` for the report's records of each shard."""
    records = {c["case"]: c for c in report["cases"] if not is_audit_error(c)}
    th = load_thresholds()
    out = {}
    for i in range(jobs):
        shard = shard_cases(release_suite(), i, jobs, by="key")
        head = journal.run_identity(
            kernel=kernel, suite="release", seed=0, thresholds=th, cases=shard, backward=backward
        )
        lines = [head] + [records[c.name] for c in shard if c.name in records]
        out[f"jobs/{i}/{kernel}/journal.jsonl"] = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in lines)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reports", default=str(ROOT / "reports" / "h200" / "release-backward"))
    ap.add_argument("--kernels", default="fa4,fa4-model-sm90")
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--out", default=str(ROOT / ".release-state" / "bwd.tgz"))
    args = ap.parse_args()
    files = {}
    for kernel in args.kernels.split(","):
        rep = json.loads(lzma.open(Path(args.reports) / kernel / "report.json.xz").read())
        files.update(journals(rep, kernel, args.jobs, BackwardOptions(repeat=2)))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(args.out, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    n = sum(t.count("\n") - 1 for t in files.values())
    print(f"{len(files)} journals, {n} records: {args.out}")


if __name__ == "__main__":
    main()
