#!/usr/bin/env bash
# Device call (carry [".fa4dev"]): the failing cases of the committed H200 reports run again with
# the diagnosis (issue 25: where the violations sit, error maps), so that the committed reports
# can be re-rendered with them (benchmarks/maintenance/rediagnose.py).  Same configurations and seeds, so the
# same inputs; production on the same GPU model.  The case files come from
# benchmarks/maintenance/failing_cases.py (made on the CPU machine: CASES, a directory of NAME.json), e.g.
#   python benchmarks/maintenance/failing_cases.py diag_cases/release.json reports/h200/release/fa4
#   (head-dims.json: head-dims-2026-12-01/sweep/fa4; release-bwd.json: release-backward/fa4;
#    varlen.json: varlen/fa4; triton.json: triton), then
#   CASES=diag_cases bash benchmarks/device/h200_diagnose.sh
# Runs (each a report under $R/NAME), production `fa4` only (its model is bit-identical, and
# the device time of this session was short): head-dims (the sweep's failing cases, --backward),
# release, varlen, triton (examples/triton_attention.py:attention, no production package on the
# path), release-bwd (--backward; last: what its limit leaves unrun stays undiagnosed).
# Reports (json, md, maps/*.npz) come back in $OUT/diagnose.tgz; timings in $OUT/log.txt.
set -uo pipefail
. benchmarks/device/h200_env.sh
mkdir -p "$OUT"
log=$OUT/log.txt
CASES=${CASES:-diag_cases}
nvidia-smi -L | tee -a "$log"
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4cache
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
R=/tmp/diagnose
filter() { grep -v "Warning\|LayoutEnum\|aux_data\|exe_args\|reproduce:" | tail -${1:-12}; }
step() {  # NAME SECONDS ARGS...
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  timeout --signal=INT "$limit" "$@" --device cuda --out $R/$name --overwrite --quiet 2>&1 | filter | tee -a "$log"
  echo "$name exit ${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s" | tee -a "$log"
}
K1="--kernel fa4"
pack() { (cd $R && tar czf $OUT/diagnose.tgz --exclude=repro --exclude='*.html' --exclude='*.junit.xml' \
  --exclude='*.png' --exclude='*.svg' .); }
# in order of what the committed reports most need; each step's limit from the environment (seconds)
step head-dims ${T_HD:-60} python -m audits run $K1 --case-file $CASES/head-dims.json --backward --jobs 14 --maps 0
pack
step release ${T_REL:-45} python -m audits run $K1 --case-file $CASES/release.json --jobs 14 --maps 0
pack
step varlen ${T_VL:-25} python -m audits run $K1 --case-file $CASES/varlen.json --jobs 4 --maps 0
pack
PYTHONPATH=$PWD step triton ${T_TR:-30} python -m audits run --kernel examples/triton_attention.py:attention \
  --case-file $CASES/triton.json --jobs 4 --maps 0
pack
step release-bwd ${T_BWD:-60} python -m audits run $K1 --case-file $CASES/release-bwd.json --backward --jobs 14 --maps 0
pack
ls -la $OUT | tee -a "$log"
