#!/usr/bin/env bash
# Device call (carry [".fa4dev"]), 2026-12-01 session: MUFU by inline PTX against production's MUFU
# calls (all 2^32 inputs), the fidelity audit with the measured tensor-core summation and MUFU
# (three configurations, same run), the invariance audit of production on more smoke cases, and
# the release suite's varlen cases through the runner.  Results in $OUT.
#   bash benchmarks/device/h200_final.sh
set -uo pipefail
. benchmarks/device/h200_env.sh
nvidia-smi -L
step() { local t0=$(date +%s); timeout "$1" "${@:2}"; echo "[$2 ${*:3:3}] exit $? after $(( $(date +%s) - t0 )) s"; }
step ${L1:-100} python benchmarks/experiments/mufu_check.py --out $OUT/mufu_check.json 2>&1 | tail -6
step ${L2:-90} python -m audits fidelity --device cuda --mma tensor_core --out $OUT/fidelity-tc --quiet 2>&1 | tail -3
step ${L3:-70} python -m audits fidelity --device cuda --mma exact --out $OUT/fidelity-exact --quiet 2>&1 | tail -3
FA4_AUDIT_MUFU=model step ${L4:-70} python -m audits fidelity --device cuda --mma tensor_core --out $OUT/fidelity-tc-cpu-mufu --quiet 2>&1 | tail -3
step ${L5:-120} python -m audits invariance --kernel fa4 --suite smoke --case "${INV_CASES:-*}" --device cuda \
  --out $OUT/invariance-fa4 2>&1 | tail -14
python -c "import json; from audits.suites.cases import suite
print(''.join(json.dumps(c.as_dict()) + chr(10) for c in suite('release') if c.varlen), end='')" > /tmp/varlen.jsonl
step ${L6:-90} python -m audits run --kernel fa4 --kernel fa4-model-sm90 --case-file /tmp/varlen.jsonl \
  --device cuda --jobs 6 --out /tmp/varlen-release --quiet 2>&1 | grep -v "reproduce:" | tail -8
(cd /tmp/varlen-release 2>/dev/null && tar czf $OUT/varlen-release.tgz --exclude=repro --exclude='*.html' --exclude=jobs .)
ls -la $OUT
