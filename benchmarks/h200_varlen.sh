#!/usr/bin/env bash
# Device call (carry [".fa4dev"]): issue 15 on the H200 in one call.
#  1. the split-KV combine model against production's combine kernel, bit for bit
#     (benchmarks/combine_fidelity.py -> $OUT/combine.json);
#  2. the release suite's varlen cases (as a case file) through production's varlen entry
#     (its SM90 path) and the SM90 model -> $OUT/varlen-release.tgz;
#  3. the invariance audit of production, its model and the SDPA backends on the smoke suite
#     -> $OUT/invariance.tgz.
#   bash benchmarks/h200_varlen.sh
set -uo pipefail
. benchmarks/h200_env.sh
nvidia-smi -L
t0=$(date +%s)
timeout ${LIMIT1:-150} python benchmarks/combine_fidelity.py --out $OUT/combine.json 2>&1 | tail -8
echo "combine exit ${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s"
R=/tmp/varlen-release
t1=$(date +%s)
# the release suite's varlen cases as a case file (a domain-built suite would rebuild the cases)
python -c "import json; from audits.cases import suite
print(''.join(json.dumps(c.as_dict()) + chr(10) for c in suite('release') if c.varlen), end='')" > /tmp/varlen.jsonl
wc -l /tmp/varlen.jsonl
timeout ${LIMIT2:-200} python -m audits run --kernel fa4 --kernel fa4-model-sm90 --case-file /tmp/varlen.jsonl \
  --device cuda --jobs ${JOBS:-6} --out $R --quiet 2>&1 | grep -v "reproduce:" | tail -25
echo "varlen release exit ${PIPESTATUS[0]} after $(( $(date +%s) - t1 )) s"
(cd $R && tar czf $OUT/varlen-release.tgz --exclude=repro --exclude='*.html' .)
I=/tmp/invariance
t2=$(date +%s)
timeout ${LIMIT3:-180} python -m audits invariance --kernel fa4 --kernel sdpa-math --kernel sdpa-flash \
  --kernel sdpa-efficient --kernel sdpa-cudnn --suite smoke --device cuda --out $I 2>&1 | tail -30
echo "invariance exit ${PIPESTATUS[0]} after $(( $(date +%s) - t2 )) s"
(cd $I && tar czf $OUT/invariance.tgz .)
ls -la $OUT
