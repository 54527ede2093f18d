#!/usr/bin/env bash
# One short device call: the FP64 reference's FLOP rate (benchmarks/reference_flops.py) and the
# GPU tests (pytest -m gpu).  Device tool, carry [".fa4dev"].
set -uo pipefail
. benchmarks/device/h200_env.sh
nvidia-smi -L
python benchmarks/reference_flops.py --out $OUT/reference_flops.json 2>&1 | tail -7
timeout 300 python -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider 2>&1 | tail -5
