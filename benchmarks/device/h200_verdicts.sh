#!/usr/bin/env bash
# One device call for the verdict-contract work: production FA4 on the new smoke suite (refusals
# by explicit rule only, LSE audited, reproducers printed), the fidelity comparison on the unified
# inputs, a reproducer of a production case run as printed, and the GPU tests.
# Device tool, carry [".fa4dev"]:   bash benchmarks/device/h200_verdicts.sh
set -uo pipefail
. benchmarks/device/h200_env.sh
nvidia-smi -L
mkdir -p $OUT/bin && printf '#!/bin/sh\nexec python -m audits "$@"\n' > $OUT/bin/fa4-audit && chmod +x $OUT/bin/fa4-audit
export PATH=$OUT/bin:$PATH  # the console script, for the printed reproducers
time python -m audits run --kernel fa4 --kernel fa4-model-sm90 --suite smoke --device cuda --out $OUT/smoke --quiet 2>&1 | tail -30
python - <<'PY'
import json, os, collections
for k in ("fa4", "fa4-model-sm90"):
    rep = json.load(open(f"{os.environ['OUT']}/smoke/{k}/report.json"))
    print(k, rep["summary"]["verdicts"], "evaluated", rep["summary"]["evaluated"])
    for c in rep["cases"]:
        if c["verdict"] not in ("pass",):
            print("  ", c["verdict"], c["case"], "|", "; ".join(c["reasons"])[:220])
PY
cd /tmp && fa4-audit run --kernel fa4 --config '{"dtype":"float16","d":128,"heads_q":4,"heads_kv":1,"seqlen_q":160,"seqlen_k":160,"family":"uniform"}' --device cuda --out $OUT/one --quiet; echo "one case from /tmp: exit $?"; cd - >/dev/null
time python -m audits fidelity --device cuda --out $OUT/fidelity --quiet 2>&1 | tail -5
timeout 300 python -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider 2>&1 | tail -5
