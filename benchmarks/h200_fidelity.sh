#!/usr/bin/env bash
# One device call for the model issue: SM90 model vs production on the H200, and MUFU.EX2 vs the
# model's hardware exp2 over all 2^32 inputs.  Usage (device tool, carry [".fa4dev"]):
#   bash benchmarks/h200_fidelity.sh
set -uo pipefail
mkdir -p /tmp/site && tar xJf .fa4dev/site.tar.xz -C /tmp/site
export PYTHONPATH=$PWD:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD/.fa4dev/extra
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
nvidia-smi -L
python -m audits fidelity --device cuda --mufu --out $OUT/fidelity --quiet 2>&1 | tail -20
