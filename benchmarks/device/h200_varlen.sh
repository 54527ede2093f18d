#!/usr/bin/env bash
# Device call (carry [".fa4dev"]): issue 15 on the H200 in one call.
#  1. the split-KV combine model against production's combine kernel, bit for bit
#     (benchmarks/experiments/combine_fidelity.py -> $OUT/combine.json);
#  2. the release suite's varlen cases (as a case file) through production's varlen entry
#     (its SM90 path) and the SM90 model -> $OUT/varlen-release.tgz;
#  3. the varlen model against production bit for bit (benchmarks/experiments/varlen_fidelity.py);
#  4. the invariance audit of production (its model's prediction beside it) and of the SDPA
#     backends on the smoke suite's bf16 d64 cases -> $OUT/invariance.tgz.
#   bash benchmarks/device/h200_varlen.sh
set -uo pipefail
. benchmarks/device/h200_env.sh
nvidia-smi -L
t0=$(date +%s)
timeout ${LIMIT1:-150} python benchmarks/experiments/combine_fidelity.py --out $OUT/combine.json 2>&1 | tail -8
echo "combine exit ${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s"
R=/tmp/varlen-release
t1=$(date +%s)
# the release suite's varlen cases as a case file (a domain-built suite would rebuild the cases)
python -c "import json; from audits.suites.cases import suite
print(''.join(json.dumps(c.as_dict()) + chr(10) for c in suite('release') if c.varlen), end='')" > /tmp/varlen.jsonl
wc -l /tmp/varlen.jsonl
timeout ${LIMIT2:-200} python -m audits run --kernel fa4 --kernel fa4-model-sm90 --case-file /tmp/varlen.jsonl \
  --device cuda --jobs ${JOBS:-6} --out $R --quiet 2>&1 | grep -v "reproduce:" | tail -25
echo "varlen release exit ${PIPESTATUS[0]} after $(( $(date +%s) - t1 )) s"
(cd $R && tar czf $OUT/varlen-release.tgz --exclude=repro --exclude='*.html' .)
t3=$(date +%s)
timeout ${LIMIT4:-120} python benchmarks/experiments/varlen_fidelity.py --out $OUT/varlen-fidelity.json 2>&1 | tail -4
echo "varlen fidelity exit ${PIPESTATUS[0]} after $(( $(date +%s) - t3 )) s"
I=/tmp/invariance
t2=$(date +%s)
timeout ${LIMIT3:-150} python -m audits invariance --kernel fa4 --suite smoke --case "${INV_CASES:-bf16-d64-*}" \
  --device cuda --out $I/fa4 2>&1 | tail -20
echo "invariance fa4 exit ${PIPESTATUS[0]} after $(( $(date +%s) - t2 )) s"
t2=$(date +%s)
timeout ${LIMIT5:-100} python -m audits invariance --kernel sdpa-math --kernel sdpa-flash --kernel sdpa-efficient \
  --kernel sdpa-cudnn --suite smoke --case "${INV_CASES:-bf16-d64-*}" --device cuda --out $I/sdpa 2>&1 | tail -20
echo "invariance sdpa exit ${PIPESTATUS[0]} after $(( $(date +%s) - t2 )) s"
(cd $I && tar czf $OUT/invariance.tgz .)
ls -la $OUT
