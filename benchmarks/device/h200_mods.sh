#!/usr/bin/env bash
# FA4's programmable surface on the H200 (issue 26): production SM90 with every library mod
# (score mods, mask mods, block sparsity built from each mask mod), forward and backward, bf16
# and fp16, beside PyTorch's flex_attention (compiled) and the model fa4-model-sm90, in one
# report per direction; then the cross-checks of benchmarks/experiments/h200_mods.py (softcap score_mod vs
# the softcap flag, causal mask_mod vs causal=True, block-sparse vs dense, mask_mod + causal).
# Device call (carry [".fa4dev"]):  bash benchmarks/device/h200_mods.sh
#   SUITE    the suite option (default "--suite mods"; "" for none, with SELECT="--case-file F")
#   JOBS     parallel processes (default 12)
#   LIMIT    seconds per audit run before it is stopped (default 200; a stopped run still writes its report)
#   KERNELS  default "--kernel fa4 --kernel flex --kernel fa4-model-sm90" (FWD_KERNELS / BWD_KERNELS: per direction)
#   SELECT   extra case selection for the audit runs, e.g. "--case *varlen*" (globs are not expanded by the shell)
#   PROBE=1  then benchmarks/experiments/h200_mods_bwd_probe.py (which aux-reading score mods break the backward)
#   BITEXACT=1  then benchmarks/experiments/h200_backward.py --mods --deterministic with fa4-model-sm90-tc: every out, LSE
#            and gradient bit of the tensor-core model against production, one case per mod kind ($OUT/bitexact)
#   TESTS="tests/x.py ..."  then pytest -m gpu on those files ($OUT/pytest_gpu.txt)
# Reports come back in $OUT/mods-fwd.tgz and $OUT/mods-bwd.tgz, the log in $OUT/log.txt.
set -uo pipefail
. benchmarks/device/h200_env.sh
mkdir -p "$OUT"
log=$OUT/log.txt
nvidia-smi -L | tee -a "$log"
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4cache
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
KERNELS=${KERNELS:---kernel fa4 --kernel flex --kernel fa4-model-sm90}
filter() { grep -v "Warning\|LayoutEnum\|aux_data\|exe_args\|reproduce:" | tail -${1:-40}; }
for dir in fwd bwd; do
  extra=""; ks=${FWD_KERNELS:-$KERNELS}
  [ $dir = bwd ] && extra="--backward" && ks=${BWD_KERNELS:-$KERNELS}
  [ "$ks" = none ] && continue
  t0=$(date +%s)
  set -f  # SELECT's globs go to the audit as they are
  timeout --signal=INT ${LIMIT:-200} python -m audits run $ks ${SUITE---suite mods} ${SELECT:-} $extra \
    --device cuda --jobs ${JOBS:-12} --out /tmp/mods-$dir --overwrite --quiet 2>&1 | filter 40 | tee -a "$log"
  set +f
  echo "mods $dir exit ${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s" | tee -a "$log"
  # error maps stay behind (the backward's are tens of MB): the reports name them, re-render with show --plot
  (cd /tmp/mods-$dir && tar cJf $OUT/mods-$dir.tar.xz --exclude=jobs --exclude=repro --exclude=maps --exclude='*.html' \
    --exclude='*.junit.xml' .)
done
if [ "${PROBE:-0}" = 1 ]; then
  timeout ${PROBE_LIMIT:-150} python benchmarks/experiments/h200_mods_bwd_probe.py --out $OUT 2>&1 | filter 30 | tee -a "$log"
fi
if [ -n "${TESTS:-}" ]; then
  t0=$(date +%s)
  timeout ${TESTS_LIMIT:-200} python -m pytest -q -m gpu -p no:cacheprovider $TESTS > $OUT/pytest_gpu.txt 2>&1
  echo "gpu tests exit $? after $(( $(date +%s) - t0 )) s" | tee -a "$log"; tail -15 $OUT/pytest_gpu.txt | tee -a "$log"
fi
if [ "${BITEXACT:-0}" = 1 ]; then
  t0=$(date +%s)
  timeout ${BITEXACT_LIMIT:-240} python benchmarks/experiments/h200_backward.py --mods --deterministic --model fa4-model-sm90-tc \
    ${BITEXACT_ONLY:+--only $BITEXACT_ONLY} --out $OUT/bitexact 2>&1 | filter 30 | cut -c1-600 | tee -a "$log"
  echo "bitexact exit ${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s" | tee -a "$log"
fi
t0=$(date +%s)
[ "${CHECK_LIMIT:-150}" != 0 ] && timeout ${CHECK_LIMIT:-150} python benchmarks/experiments/h200_mods.py --out $OUT/crosschecks.json 2>&1 | filter 80 | tee -a "$log"
echo "cross-checks exit ${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s" | tee -a "$log"
ls -la $OUT
