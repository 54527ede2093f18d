#!/usr/bin/env bash
# Production at every code-path class on the H200 (issue 24): release's class cases
# (audits.suites.cases.class_cases: together they reach every class of fa4.code_paths on SM90 and
# SM100) forward and backward, production `fa4` and the model `fa4-model-sm90`, once plain and
# once with --deterministic, gated with --require-coverage classes.
# Device call (carry [".fa4dev"]):  bash benchmarks/device/h200_classes.sh
set -uo pipefail
. benchmarks/device/h200_env.sh
mkdir -p "$OUT"
log=$OUT/classes-log.txt
export FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4cache PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
python - <<'PY'
import json
from audits.suites.cases import class_cases
json.dump([c.as_dict() for c in class_cases()], open("/tmp/class_cases.json", "w"))
PY
for det in "" "--deterministic"; do
  R=/tmp/classes${det:+-det}
  t0=$(date +%s)
  python -m audits run --kernel fa4 --kernel fa4-model-sm90 --case-file /tmp/class_cases.json --backward $det \
    --require-coverage classes --device cuda --jobs ${JOBS:-10} --out $R --overwrite --quiet 2>&1 \
    | grep -v "Warning\|LayoutEnum\|aux_data\|exe_args\|reproduce:" | tail -40 | tee -a "$log"
  echo "class cases --backward $det: exit ${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s" | tee -a "$log"
  for k in fa4 fa4-model-sm90; do python -m audits coverage $R/$k 2>&1 | tee -a "$log"; done
  python benchmarks/maintenance/headdims_summary.py $R 2>&1 | tee -a "$log"
  (cd $R && tar czf $OUT/classes${det:+-det}.tgz --exclude=jobs --exclude=repro --exclude='*.html' --exclude='*.junit.xml' .)
done
