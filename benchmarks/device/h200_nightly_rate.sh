#!/usr/bin/env bash
# How fast production's SM90 nightly with --backward goes on one H200 (issue 24, item 7): the
# `nightly` suite on `fa4` with --backward, 14 jobs sharing production's compile cache, stopped
# by --budget MINUTES (a partial report, exit 3). The run order is stratified
# (audits/engine/shards.run_order), so the finished prefix samples the whole suite; the rate it
# gives, and the share of cases production refuses at once, extrapolate to the whole nightly.
# Device call (carry [".fa4dev"]):  bash benchmarks/device/h200_nightly_rate.sh
set -uo pipefail
. benchmarks/device/h200_env.sh
mkdir -p "$OUT"
log=$OUT/nightly-rate.txt
export FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4cache PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
R=/tmp/nightly
t0=$(date +%s)
python -m audits run --kernel fa4 --suite nightly --backward --device cuda --jobs ${JOBS:-14} \
  --budget ${BUDGET:-7} --out $R --overwrite --quiet 2>&1 | grep -v "Warning\|LayoutEnum\|aux_data\|exe_args\|reproduce:\|why:" \
  | tail -12 | tee -a "$log"
echo "nightly --backward: exit ${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s (jobs ${JOBS:-14}, budget ${BUDGET:-7} min)" | tee -a "$log"
python - "$R" <<'PY' | tee -a "$log"
import collections, glob, json, sys
from pathlib import Path
recs = {}
for j in glob.glob(f"{sys.argv[1]}/jobs/*/journal.jsonl") + glob.glob(f"{sys.argv[1]}/journal.jsonl"):
    for line in Path(j).read_text().splitlines():
        r = json.loads(line)
        if "case" in r and "verdict" in r:
            recs[r["case"]] = r
v = collections.Counter(r["verdict"] for r in recs.values())
secs = sum(r.get("seconds") or 0 for r in recs.values())
ran = [r for r in recs.values() if r["verdict"] not in ("skipped", "out-of-domain")]
print(f"finished cases {len(recs)}: {dict(v)}; seconds summed {secs:.0f} (ran {len(ran)}: {sum(r.get('seconds') or 0 for r in ran):.0f} s)")
PY
(cd $R && tar czf $OUT/nightly-rate.tgz --exclude=jobs --exclude=repro --exclude='*.html' --exclude='*.junit.xml' . 2>/dev/null)
ls -la $OUT
