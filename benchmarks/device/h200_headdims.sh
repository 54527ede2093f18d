#!/usr/bin/env bash
# Production at every head dim it accepts on the H200 (issue 24): the `head-dims` suite (d = dv
# in 8..256 step 8, bf16 and fp16, causal and not) forward and backward, production `fa4` and
# the model `fa4-model-sm90` beside it, N parallel jobs sharing production's persistent compile
# cache (FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED, flash_attn/cute/cache_utils.py).
# Device call (carry [".fa4dev"]):  bash benchmarks/device/h200_headdims.sh
#   SUITE  the suite (default head-dims); CASE_FILE: a case file instead of a suite
#   JOBS   parallel processes (default 12 of the machine's 16 cores)
#   LIMIT  seconds before the run is stopped (default 500; a stopped run still writes its report)
#   KERNELS (default "--kernel fa4 --kernel fa4-model-sm90")
#   WARM=1 runs the sweep a second time on the now warm compile cache (where the time goes:
#          compiling or computing), into $R-warm
#   MINIMAL a case file of minimal reproducers run on fa4 with --backward after the sweep
#   STATE  a journals.tgz from an earlier call (carry it too): the run resumes from it
# Reports come back in $OUT/reports.tgz, the timing summary in $OUT/log.txt.
set -uo pipefail
. benchmarks/device/h200_env.sh
mkdir -p "$OUT"
log=$OUT/log.txt
nvidia-smi -L | tee -a "$log"
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4cache
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
R=/tmp/headdims
KERNELS=${KERNELS:---kernel fa4 --kernel fa4-model-sm90}
mode=--overwrite
if [ -n "${STATE:-}" ] && [ -f "$STATE" ]; then mkdir -p $R && tar xzf "$STATE" -C $R && mode=--resume; fi
if [ -n "${CASE_FILE:-}" ]; then sel="--case-file $CASE_FILE"; else sel="--suite ${SUITE:-head-dims}"; fi
t0=$(date +%s)
timeout --signal=INT ${LIMIT:-500} python -m audits run $KERNELS $sel --backward --device cuda \
  --jobs ${JOBS:-12} --out $R $mode --quiet ${EXTRA:-} 2>&1 \
  | grep -v "Warning\|LayoutEnum\|aux_data\|exe_args" | tail -40 | tee -a "$log"
echo "head-dims --backward exit ${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s (jobs ${JOBS:-12})" | tee -a "$log"
python benchmarks/maintenance/headdims_summary.py $R 2>&1 | tee -a "$log"
if [ "${WARM:-0}" = 1 ]; then
  t0=$(date +%s)
  python -m audits run $KERNELS $sel --backward --device cuda --jobs ${JOBS:-12} --out $R-warm --overwrite --quiet \
    2>&1 | grep -v "Warning\|LayoutEnum\|aux_data\|exe_args" | grep "cases evaluated" | tee -a "$log"
  echo "warm-cache rerun after $(( $(date +%s) - t0 )) s" | tee -a "$log"
  python benchmarks/maintenance/headdims_summary.py $R-warm 2>&1 | grep "seconds summed" | tee -a "$log"
fi
if [ -n "${MINIMAL:-}" ]; then
  python -m audits run --kernel fa4 --case-file "$MINIMAL" --backward --device cuda --jobs 6 --out $R-minimal --overwrite \
    --quiet 2>&1 | grep -v "Warning\|LayoutEnum\|aux_data\|exe_args" | grep -v "reproduce:" | tail -30 | tee -a "$log"
  python benchmarks/maintenance/headdims_summary.py $R-minimal 2>&1 | tee -a "$log"
  (cd $R-minimal && tar czf $OUT/minimal.tgz --exclude=jobs --exclude=repro --exclude='*.html' --exclude='*.junit.xml' .)
fi
(cd $R && tar czf $OUT/reports.tgz --exclude=jobs --exclude=repro --exclude='*.html' --exclude='*.junit.xml' .)
(cd $R && find jobs -name journal.jsonl | tar czf $OUT/journals.tgz -T -)
ls -la $OUT
