#!/usr/bin/env bash
# Device calls for the backward release audit on the H200 (device tool, carry [".fa4dev", ".release-state"]).
#   bash benchmarks/device/h200_release_backward.sh
# production fa4 (its SM90 backward) and fa4-model-sm90 on `release --backward`, resuming from
# .release-state/bwd.tgz (the journals of earlier calls), for at most LIMIT seconds; then, when
# DET=1, a --deterministic run of fa4 on the causal and local cases of one family.  Journals
# come back in $OUT/bwd.tgz (copy it to .release-state/ for the next call), reports in
# $OUT/reports-<STATE>.tgz.  KERNELS overrides the kernels (e.g. the SDPA backends in a later call), CASES
# narrows the suite to a glob over case names, STATE names the journal archive (default bwd.tgz:
# another STATE keeps another run's journals apart).
# On a fresh machine, rebuild .release-state/bwd.tgz from the committed reports first:
#   python benchmarks/maintenance/release_state_from_reports.py
set -uo pipefail
. benchmarks/device/h200_env.sh
nvidia-smi -L
KERNELS=${KERNELS:---kernel fa4 --kernel fa4-model-sm90}
STATE=${STATE:-bwd.tgz}
R=/tmp/release-${STATE%.tgz}
mkdir -p $R
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4cache
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
[ -f .release-state/$STATE ] && tar xzf .release-state/$STATE -C $R
t0=$(date +%s)
timeout ${LIMIT:-420} python -m audits run $KERNELS --suite release --backward --device cuda --jobs ${JOBS:-8} --resume \
  ${CASES:+--case "$CASES"} \
  --out $R --quiet 2>&1 | grep -v "Warning\|LayoutEnum\|aux_data\|exe_args" | tail -30
echo "release --backward exit ${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s"
if [ "${DET:-0}" = 1 ]; then
  D=/tmp/release-bwd-det
  timeout ${DET_LIMIT:-120} python -m audits run --kernel fa4 --suite release --backward --deterministic --repeat 3 \
    --case "${DET_CASES:-bf16-*-causal-*normal-seed0}" --device cuda --jobs 4 --out $D --quiet 2>&1 | grep -v "Warning\|LayoutEnum\|aux_data\|exe_args" | tail -12
  (cd $D && tar czf $OUT/det.tgz --exclude=jobs --exclude=repro --exclude='*.html' --exclude='*.junit.xml' .)
fi
(cd $R && tar czf $OUT/reports-${STATE%.tgz}.tgz --exclude=jobs --exclude=repro --exclude='*.html' --exclude='*.junit.xml' .)
(cd $R && find jobs -name journal.jsonl | tar czf $OUT/$STATE -T -)
ls -la $OUT
