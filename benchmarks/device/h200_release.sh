#!/usr/bin/env bash
# Device calls for the release audit on the H200 (device tool, carry [".fa4dev", ".release-state"]).
#   MODE=speed bash benchmarks/device/h200_release.sh   FP64 reference FLOP rate; fa4 on release from a
#                                                cold, then a warm compile cache (audit_speed.py);
#                                                the cold run's journals come back in $OUT/state.tgz
#   MODE=audit bash benchmarks/device/h200_release.sh   fa4 and its peers on release, resuming from
#                                                .release-state/state.tgz; journals and reports back
# Each call stays under the device's 10-minute limit (LIMIT seconds for the audit itself); the
# journals carry the audit across calls (fa4-audit run --resume).
set -uo pipefail
. benchmarks/device/h200_env.sh
nvidia-smi -L
KERNELS="--kernel fa4 --kernel fa4-model-sm90 --kernel sdpa-flash --kernel sdpa-cudnn --kernel sdpa-efficient"
R=/tmp/release
mkdir -p $R
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4cache
# 8 jobs share one GPU: let each give freed blocks back (runner: empty_cache after large cases)
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
if [ "${MODE:-speed}" = speed ]; then
  python benchmarks/reference_flops.py --out $OUT/reference_flops.json 2>&1 | tail -8
  python benchmarks/audit_speed.py --kernel fa4 --suite release --jobs 8 --cold-limit ${COLD:-400} --warm-limit ${WARM:-80} --out /tmp/speed
  cp /tmp/speed/speed.json $OUT/
  (cd /tmp/speed && tar czf $OUT/logs.tgz cold/jobs/*/log.txt warm/jobs/*/log.txt cold/report.md 2>/dev/null)
  # the cold run is the fa4 audit: its per-job journals become $R/jobs/I/fa4/ (the layout of a
  # several-kernel run, which resumes from them)
  for d in /tmp/speed/cold/jobs/*; do mkdir -p $R/jobs/$(basename $d)/fa4 && cp $d/journal.jsonl $R/jobs/$(basename $d)/fa4/ 2>/dev/null; done
  grep -h "Error\|error" /tmp/speed/cold/jobs/*/log.txt | sort | uniq -c | sort -rn | head -5
else
  [ -f .release-state/state.tgz ] && tar xzf .release-state/state.tgz -C $R
  # the static audit's CUDA path (the CPU path is what reports/static used): two compile groups
  python -m audits static --compile-on cuda --out $OUT/static-h200 --quiet \
    --config '{"dtype": "bfloat16", "d": 128, "dv": 128, "heads_q": 16, "heads_kv": 16, "seqlen_q": 1024, "seqlen_k": 1024}' \
    --config '{"dtype": "float8_e4m3fn", "d": 128, "dv": 128, "heads_q": 16, "heads_kv": 16, "seqlen_q": 1024, "seqlen_k": 1024, "causal": true}' 2>&1 | grep -v Warn | tail -3
  rm -rf $OUT/static-h200/ptx
  timeout ${LIMIT:-480} python -m audits run $KERNELS --suite release --device cuda --jobs 8 --resume --out $R --quiet 2>&1 | grep -v "Warning\|LayoutEnum" | tail -12
  echo "audit exit $?"
  (cd $R && tar czf $OUT/reports.tgz --exclude=jobs --exclude=repro --exclude='*.html' --exclude='*.junit.xml' .)
fi
(cd $R && find jobs -name journal.jsonl | tar czf $OUT/state.tgz -T -)
ls -la $OUT
