#!/usr/bin/env bash
# The harness on the H200 (issue 23): smoke runs of kernels that hang on the GPU, raise what cannot be pickled, or exhaust
# GPU memory, each finishing with the right verdicts in bounded time; the model run with and
# without a worker (--timeout) to price the isolation.  Needs no production package.
# (The wheel is proven outside the tree by .ci/run on the CPU: a venv on the device does not see
# the device's own torch, and the device has no network to install one.)
# Device call: bash benchmarks/device/h200_harness.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
out=${OUT:-/tmp/h200-harness}
mkdir -p "$out"
log="$out/log.txt"
stamp() { date +%s.%N; }
# Smoke runs on CUDA, each timed
for spec in "tests.hanging_kernels:spins_on_gpu --timeout 5" \
            "tests.hanging_kernels:raises_unpicklable" \
            "tests.hanging_kernels:exhausts_gpu_memory" \
            "fa4-model-sm90 --timeout 60" \
            "fa4-model-sm90"; do
  set -- $spec
  name=$(echo "$1" | tr ':' '_')${2:+_isolated}
  t0=$(stamp)
  python3 -m audits run --kernel $spec --suite smoke --device cuda --out "$out/$name" --overwrite --quiet \
    > "$out/$name.stdout" 2> "$out/$name.stderr"
  rc=$?
  t1=$(stamp)
  python3 - "$out/$name/report.json" "$name" "$rc" "$t0" "$t1" <<'PY' | tee -a "$log"
import json, sys, collections
path, name, rc, t0, t1 = sys.argv[1:]
rep = json.load(open(path))
counts = collections.Counter(c["verdict"] for c in rep["cases"])
reasons = collections.Counter((c.get("reasons") or [""])[0][:110] for c in rep["cases"] if c["verdict"] != "pass")
print(f"{name}: exit {rc}, {float(t1) - float(t0):.1f} s, verdicts {dict(counts)}")
for r, n in reasons.most_common(3):
    print(f"    x{n}: {r}")
PY
done
cd "$out" && tar cJf reports.tar.xz --exclude='*/repro' */report.json 2>/dev/null; ls "$out"
