#!/usr/bin/env bash
# Device call (carry [".fa4dev"]), 2026-12-01, second session: issue 16's remaining figures —
# the forward fidelity audit with the softcap division (fa4.primitives.div_rn) and the SM90
# sink fold corrected, the GPU tests (fa4-model-sm90-tc on the recorded production samples, every
# bit), the backward fidelity with each MMA mode, and the smoke suite's time with each mode on
# the H200 (part 1); the GPU tests' log and the backward fidelity with deterministic=True on
# both sides (part 2: the atomics' order out of the comparison; run again after the
# preprocess-order fix of benchmarks/experiments/h200_preprocess_order.py).  Results in $OUT.
#   bash benchmarks/device/h200_bitexact.sh 1|2
set -uo pipefail
. benchmarks/device/h200_env.sh
nvidia-smi -L
step() { local t0=$(date +%s); timeout "$1" "${@:2}"; echo "[$2 ${*:3:3}] exit $? after $(( $(date +%s) - t0 )) s"; }
if [ "${1:-1}" = 2 ]; then
  step 150 python -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider > $OUT/pytest_gpu.txt 2>&1
  tail -4 $OUT/pytest_gpu.txt
  step 150 python benchmarks/experiments/h200_backward.py --model fa4-model-sm90-tc --deterministic --out $OUT/backward-tc-det \
    > $OUT/backward-tc-det.log 2>&1
  tail -c 3000 $OUT/backward-tc-det.log
  exit 0
fi
step ${L1:-120} python -m audits fidelity --device cuda --mma tensor_core --out $OUT/fidelity-tc --quiet 2>&1 | tail -3
step ${L2:-150} python -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider 2>&1 | tail -12
step ${L3:-150} python benchmarks/experiments/h200_backward.py --model fa4-model-sm90-tc --out $OUT/backward-tc 2>&1 | tail -12
step ${L4:-100} python benchmarks/experiments/h200_backward.py --model fa4-model-sm90 --out $OUT/backward-exact 2>&1 | tail -12
step ${L5:-200} python benchmarks/smoke_cpu.py --device cuda --repeat 1 \
  --kernels fa4-model-sm90-tc,fa4-model-sm90 --out $OUT/smoke_modes_h200.json 2>&1 | tail -25
ls -la $OUT
