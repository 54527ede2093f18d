#!/usr/bin/env bash
# One device call for the model issue: SM90 model vs production on the H200, and MUFU.EX2 vs the
# model's hardware exp2 over all 2^32 inputs.  Usage (device tool, carry [".fa4dev"]):
#   bash benchmarks/device/h200_fidelity.sh
set -uo pipefail
. benchmarks/device/h200_env.sh
nvidia-smi -L
python -m audits fidelity --device cuda --mufu --out $OUT/fidelity --quiet 2>&1 | tail -20
