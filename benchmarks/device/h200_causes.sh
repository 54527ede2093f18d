#!/usr/bin/env bash
# Issue 35's H200 measurement (device tool, carry [".fa4dev", ".triton-tutorial"]): the tested causes
# (audits/verdict/causes.py) and poisoned re-runs (audits/engine/poison.py, --poison is the default)
# on real kernels, each a report under $OUT/causes.tgz, the console in $OUT/log.txt:
#   triton-tutorial: Triton's fused-attention tutorial (loaded at run time from .triton-tutorial/,
#     never committed: examples/triton_tutorial.py) on smoke built inside its declared domain;
#   sink-overflow: production (flash-attn-4 4.0.0b40) on the four release cases whose learnable sink
#     overflowed the LSE on 4.0.0b36 (benchmarks/device/sink_overflow_cases.json);
#   head-dims-minimal: production's backward at the head dims where it is wrong
#     (benchmarks/device/headdims_minimal.json), --backward: the backward's poisoned re-runs;
#   gpu-tests: the GPU tests of the poisoned runs (tests/test_written.py too), of fa4@DIR (b36 installed with pip --target) and of
#     the tutorial's causes (tests/test_triton_tutorial.py).
# STEPS (default: all four, in that order) picks some of them.
set -uo pipefail
. benchmarks/device/h200_env.sh
nvidia-smi -L
python -c "import triton, torch; print('triton', triton.__version__, 'torch', torch.__version__)"
mkdir -p /tmp/b36 /tmp/causes
python -m pip install --quiet --no-deps --no-index --target /tmp/b36 .fa4dev/versions/flash_attn_4-4.0.0b36-py3-none-any.whl
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
export FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4cache
run() {  # NAME, then the run's arguments
  local name=$1; shift
  local t0=$SECONDS
  python -m audits run --device cuda --out /tmp/causes/$name "$@" 2>&1 | grep -v "Warning\|LayoutEnum" | tail -60
  echo "$name: exit ${PIPESTATUS[0]} in $((SECONDS - t0)) s"
}
{
for step in ${STEPS:-triton-tutorial sink-overflow head-dims-minimal gpu-tests}; do
  case $step in
    triton-tutorial) run triton-tutorial --kernel examples/triton_tutorial.py:attention --suite smoke --jobs 4 ;;
    sink-overflow) run sink-overflow --kernel fa4 --case-file benchmarks/device/sink_overflow_cases.json --jobs 4 ;;
    head-dims-minimal) run head-dims-minimal --kernel fa4 --case-file benchmarks/device/headdims_minimal.json --backward --jobs 7 ;;
    gpu-tests)
      t0=$SECONDS
      # the whole output in its own file (a tail cut the failures off on 2026-12-04), with and without
      # expandable segments (the device scripts set them; the pre-fill's test failed under both)
      for conf in "" "expandable_segments:True"; do
        PYTORCH_CUDA_ALLOC_CONF=$conf FA4_B36_DIR=/tmp/b36 timeout 240 python -m pytest -q -m gpu -p no:cacheprovider \
          -W ignore tests/test_poison.py tests/test_written.py tests/test_kernel_specs.py tests/test_triton_tutorial.py > $OUT/pytest-gpu${conf:+-expandable}.txt 2>&1
        echo "gpu tests (PYTORCH_CUDA_ALLOC_CONF=$conf): exit $? in $((SECONDS - t0)) s"
      done ;;
    *) echo "unknown step $step" ;;
  esac
done
say_compile_cache
} 2>&1 | tee $OUT/log.txt
(cd /tmp/causes && find . -name report.json -exec xz -kf {} \; && tar czf $OUT/causes.tgz \
  --exclude=jobs --exclude=repro --exclude='*.html' --exclude='*.junit.xml' --exclude='report.json' --exclude='journal.jsonl' --exclude='*.log' .)
ls -la $OUT
