#!/usr/bin/env bash
# Device call (carry [".fa4dev"]): the wgmma summation probe (issue 16), the split-KV combine
# against production's combine kernel, and the varlen model against production with the
# fixed-length baseline (issue 15).  Results in $OUT.
#   bash benchmarks/device/h200_probes.sh
set -uo pipefail
. benchmarks/device/h200_env.sh
nvidia-smi -L
t0=$(date +%s)
timeout ${LIMIT1:-120} python benchmarks/experiments/mma_probe.py --out $OUT/mma_probe.pt 2>&1 | grep -v "^.*random" | tail -120
echo "mma probe exit ${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
timeout ${LIMIT2:-120} python benchmarks/experiments/combine_fidelity.py --out $OUT/combine.json 2>&1 | tail -8
echo "combine exit ${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
timeout ${LIMIT3:-240} python benchmarks/experiments/varlen_fidelity.py --max-cases ${CASES:-12} --out $OUT/varlen-fidelity.json 2>&1 | tail -14
echo "varlen fidelity exit ${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s"
ls -la $OUT
