#!/usr/bin/env bash
# Issue 34's measurement: `fa4-audit compare` of production 4.0.0b36 (the baseline: its wheel in
# .fa4dev/versions/, installed with pip --target into /tmp/b36 and run as `fa4@/tmp/b36`) against
# 4.0.0b40 (the staged .fa4dev/site.tar.xz, `fa4`), the same inputs handed to both, each release in
# its own worker process. The two releases share one compile cache: each keys its kernels by a
# hash of its own sources (flash_attn/cute/cache_utils.py _compute_source_fingerprint, in both).
# STEPS (default "smoke-backward head-dims-backward"; also "release", "release-rest", and the two
# backward steps with "-deterministic": the atomics' run-to-run variation removed) run one after
# another, each under what is left of LIMIT seconds (default 540); a step stopped there reports
# what it ran. release-rest (carry [".fa4dev", ".cmp-state"]): release's cases a first call left
# unrun, read from its partial candidate report .cmp-state/release/report.json.xz, as a case file.
# Reports come back small (md, json.xz) in $OUT/reports.tgz with the log. Device tool, carry [".fa4dev"].
set -uo pipefail
. benchmarks/device/h200_env.sh
nvidia-smi -L
mkdir -p /tmp/b36
python -m pip install --quiet --no-deps --no-index --target /tmp/b36 .fa4dev/versions/flash_attn_4-4.0.0b36-py3-none-any.whl
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
export FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4cache
LIMIT=${LIMIT:-540}
JOBS=${JOBS:-8}
START=$SECONDS
mkdir -p /tmp/cmp
{
for step in ${STEPS:-smoke-backward head-dims-backward}; do
  case $step in
    smoke-backward) args="--suite smoke --backward" ;;
    head-dims-backward) args="--suite head-dims --backward" ;;
    release) args="--suite release" ;;
    smoke-backward-deterministic) args="--suite smoke --backward --deterministic" ;;
    head-dims-backward-deterministic) args="--suite head-dims --backward --deterministic" ;;
    release-rest)
      python - <<'PY'
import json
from audits.suites.case import cases_from_file
from audits.suites.selection import select_cases
done = {c.name for c in cases_from_file(".cmp-state/release/report.json.xz")}
rest = [c.as_dict() for c in select_cases(suite="release", kernels=["fa4"]).cases if c.name not in done]
json.dump(rest, open("/tmp/cmp/release-rest.json", "w"))
print(f"release: {len(done)} cases compared before, {len(rest)} left")
PY
      args="--case-file /tmp/cmp/release-rest.json" ;;
    *) echo "unknown step $step"; continue ;;
  esac
  left=$((LIMIT - (SECONDS - START)))
  t0=$SECONDS
  timeout -s INT $left python -m audits compare --kernel fa4@/tmp/b36 --kernel fa4 --device cuda --known fa4 \
    --jobs $JOBS --quiet --time-calls --out /tmp/cmp/$step $args 2>&1 | grep -v "Warning\|LayoutEnum" | tail -40
  echo "$step: exit ${PIPESTATUS[0]} in $((SECONDS - t0)) s"
done
say_compile_cache
} 2>&1 | tee $OUT/log.txt
(cd /tmp/cmp && find . -name report.json -exec xz -kf {} \; && xz -kf */compare.json && tar czf $OUT/reports.tgz \
  --exclude=jobs --exclude=repro --exclude=maps --exclude='*.html' --exclude='*.junit.xml' --exclude='report.json' \
  --exclude='compare.json' --exclude='journal.jsonl' --exclude='*.log' --exclude='*-rest.json' .)
ls -la $OUT
