#!/usr/bin/env bash
# The H200 half of a refactor's check: production FA4 and the SM90 model get the same case records
# (every metric, verdict, reason) from the candidate tree as from a baseline tree
# (benchmarks/same_results.py; default: smoke, forward, production and the SM90 model; other `run`
# arguments after the script's name replace them). Device tool, carry [".fa4dev", ".base"],
# where .base holds the baseline:  mkdir .base && git archive BASE fa4 numerics audits | tar x -C .base
# (.base ignored through .git/info/exclude). The baseline runs first, so the candidate meets a warm
# compile cache: compare the records here, the speed on the CPU (docs/performance.md).
set -uo pipefail
. benchmarks/device/h200_env.sh
nvidia-smi -L
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4-cache
[ $# -gt 0 ] || set -- --kernel fa4 --kernel fa4-model-sm90 --suite smoke --device cuda
timeout 540 python benchmarks/same_results.py --base .base --cand . --rounds 1 --out /tmp/same -- "$@" 2>&1 | tee $OUT/same.txt
cp /tmp/same/same_results.json $OUT/ 2>/dev/null
