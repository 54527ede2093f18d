#!/usr/bin/env bash
# Device call on the 2-GPU kind (device tool: kind nvidia-h200-x2, carry [".fa4dev"]): issue 17's
# measurement, not run yet (that kind was not lent on 2026-12-01).  The forward `release` of
# production fa4 with --jobs 8 on one GPU (--gpus 0), then on both (--gpus 0,1), back to back on
# the same host, each with a cold compile cache of its own (compilation is part of a real run);
# per-GPU utilisation sampled every second by nvidia-smi.  Writes $OUT/multigpu.json with `gpus`
# (per configuration: GPUs, wall seconds, exit code, mean utilisation per GPU) and `speedup`
# (1-GPU wall / 2-GPU wall; the goal is >= 1.7), and both runs' reports.
#   bash benchmarks/device/h200_multigpu.sh          (SUITE, JOBS override the defaults)
set -uo pipefail
. benchmarks/device/h200_env.sh
nvidia-smi -L
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
SUITE=${SUITE:-release}; JOBS=${JOBS:-8}
one() {  # $1: label, $2: --gpus
  export FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4cache-$1
  nvidia-smi --query-gpu=index,utilization.gpu --format=csv,noheader,nounits -l 1 > "$OUT/util-$1.csv" &
  local smi=$! t0 t1 rc
  t0=$(date +%s.%N)
  python -m audits run --kernel fa4 --suite "$SUITE" --device cuda --jobs "$JOBS" --gpus "$2" \
    --out "/tmp/mg-$1" --quiet > "$OUT/run-$1.txt" 2>&1
  rc=$?
  t1=$(date +%s.%N)
  kill "$smi"
  echo "$1 $2 $rc $t0 $t1" >> "$OUT/times.txt"
  (cd "/tmp/mg-$1" && tar czf "$OUT/reports-$1.tgz" --exclude=jobs --exclude=repro --exclude='*.html' .)
}
one 1gpu 0
one 2gpu 0,1
python - <<'PY'
import collections, json, os
out = os.environ.get("OUT", "/tmp/out")
conf = {}
for line in open(f"{out}/times.txt"):
    label, gpus, rc, t0, t1 = line.split()
    util = collections.defaultdict(list)
    for row in open(f"{out}/util-{label}.csv"):
        i, u = (x.strip() for x in row.split(","))
        util[i].append(float(u))
    conf[label] = {"gpus": gpus.split(","), "wall_s": float(t1) - float(t0), "exit": int(rc),
                   "mean_utilisation_pct": {i: sum(v) / len(v) for i, v in util.items()}}
res = {"suite": os.environ.get("SUITE", "release"), "jobs": int(os.environ.get("JOBS", "8")), "gpus": conf,
       "speedup": conf["1gpu"]["wall_s"] / conf["2gpu"]["wall_s"]}
json.dump(res, open(f"{out}/multigpu.json", "w"), indent=1)
print(json.dumps(res, indent=1))
PY
ls -la "$OUT"
