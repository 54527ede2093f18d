#!/usr/bin/env bash
# Device call (device tool, nothing carried): the Triton example kernel, examples/triton_attention.py,
# audited on the H200 with `release` built inside its declared domain (fp16, d = dv in {64, 128},
# seqlen_q == seqlen_k multiples of 128, no window/softcap/sink).  The device image has torch and
# triton; the production package is not needed.  Reports and journals come back in
# $OUT/triton-release.tgz (reports/h200/triton/ holds the committed report).
#   bash benchmarks/device/h200_triton.sh
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
nvidia-smi -L
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
R=/tmp/triton-release
t0=$(date +%s)
timeout ${LIMIT:-270} python -m audits run --kernel examples/triton_attention.py:attention --suite release \
  --device cuda --jobs ${JOBS:-8} --out $R --quiet 2>&1 | grep -v "reproduce:" | tail -30
echo "release exit ${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s"
(cd $R && tar czf $OUT/triton-release.tgz --exclude=repro --exclude='*.html' .)
ls -la $OUT
