#!/usr/bin/env bash
# One device call: the production kernel (its SM90 path) on the smoke suite, through the runner
# with crash isolation.  Usage (device tool, carry [".fa4dev"]):  bash benchmarks/device/h200_run.sh
set -uo pipefail
. benchmarks/device/h200_env.sh
nvidia-smi -L
time python -m audits run --kernel fa4 --suite smoke --device cuda --out $OUT/fa4-smoke --quiet 2>&1 | grep -v "Warning\|LayoutEnum" | tail -5
rm -rf $OUT/fa4-smoke/repro
