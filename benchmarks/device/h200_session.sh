#!/usr/bin/env bash
# One device call: everything the exp2 issue needs from the H200 (the device tool stages the production package first: benchmarks/device/h200_env.sh).
# Usage (device tool, carry [".fa4dev"]):  bash benchmarks/device/h200_session.sh
set -uo pipefail
. benchmarks/device/h200_env.sh
nvidia-smi -L | tee $OUT/gpu.txt
python -c "import torch, flash_attn.cute; print('torch', torch.__version__)" 2>&1 | tail -2
echo "== gpu tests"; python -m pytest -m gpu tests/test_gpu.py -q -p no:cacheprovider 2>&1 | tail -15 | tee $OUT/pytest_gpu.txt
echo "== bench"; python benchmarks/ex2_gpu.py --degree 3 --out $OUT/bench_ex2_gpu.json 2>&1 | tail -30
echo "== exhaustive audit"; python -m audits ex2 --degree all --exhaustive --device cuda --ptx --chunk 67108864 --out $OUT/ex2 --quiet 2>&1 | tail -40
ls -la $OUT $OUT/ex2
