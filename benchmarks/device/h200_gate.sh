#!/usr/bin/env bash
# The release gate on production FA4, both supported releases side by side in one device call
# (issue 33's measurement): 4.0.0b40 (the staged .fa4dev/site.tar.xz) and 4.0.0b36 (its wheel in
# .fa4dev/versions/, installed with pip --target ahead of b40 on its processes' path: the releases
# are pure Python and share the compiler). For each, concurrently: `smoke --backward`, then
# `release` (forward), with `--known fa4`, the shipped known defects; each release its own compile
# cache. Everything stops by LIMIT seconds (default 540); a run stopped there reports what it ran.
# Reports come back small (md, json.xz) in $OUT/reports.tgz. Device tool, carry [".fa4dev"].
# MODE=rest (carry [".fa4dev", ".gate-state"] too): release's cases that a first call left unrun,
# read from its partial reports .gate-state/<release>/report.json.xz, as a case file.
set -uo pipefail
. benchmarks/device/h200_env.sh
nvidia-smi -L
mkdir -p /tmp/b36
python -m pip install --quiet --no-deps --no-index --target /tmp/b36 .fa4dev/versions/flash_attn_4-4.0.0b36-py3-none-any.whl
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
LIMIT=${LIMIT:-540}
START=$SECONDS
gate() {  # release, extra PYTHONPATH entry
  local rel=$1 pre=$2 R=/tmp/gate/$1
  mkdir -p $R
  (
    export PYTHONPATH=$pre$PYTHONPATH FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4cache-$rel
    python -c "import importlib.metadata as m; print('$rel: flash-attn-4', m.version('flash-attn-4'))"
    local steps=("smoke-backward --suite smoke --backward --jobs 3" "release --suite release --jobs 5")
    if [ "${MODE:-all}" = rest ]; then  # release's selection (fa4's domain on this GPU) less the cases run
      python - "$rel" <<'PY'
import json, sys
from audits.suites.case import cases_from_file
from audits.suites.selection import select_cases
rel = sys.argv[1]
done = {c.name for c in cases_from_file(f".gate-state/{rel}/report.json.xz")}
rest = [c.as_dict() for c in select_cases(suite="release", kernels=["fa4"]).cases if c.name not in done]
json.dump(rest, open(f"/tmp/gate/{rel}-rest.json", "w"))
print(f"{rel}: {len(done)} release cases run before, {len(rest)} left")
PY
      steps=("release-rest --case-file /tmp/gate/$rel-rest.json --jobs 5")
    fi
    for step in "${steps[@]}"; do
      set -- $step
      local name=$1; shift
      local left=$((LIMIT - (SECONDS - START)))
      local t0=$SECONDS
      timeout -s INT $left python -m audits run --kernel fa4 --device cuda --known fa4 --quiet --out $R/$name "$@" 2>&1 \
        | grep -v "Warning\|LayoutEnum" | tail -30
      echo "$rel $name: exit ${PIPESTATUS[0]} in $((SECONDS - t0)) s"
    done
  ) > /tmp/gate/$rel.log 2>&1
}
mkdir -p /tmp/gate
gate b40 "" &
gate b36 "/tmp/b36:" &
wait
cat /tmp/gate/b40.log /tmp/gate/b36.log | tee $OUT/log.txt
(cd /tmp/gate && find . -name report.json -exec xz -kf {} \; && tar czf $OUT/reports.tgz --exclude=jobs --exclude=repro \
  --exclude=maps --exclude='*.html' --exclude='*.junit.xml' --exclude='report.json' --exclude='journal.jsonl' --exclude='*.log' .)
ls -la $OUT
