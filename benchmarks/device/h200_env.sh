# Sourced by the benchmarks/device/h200_*.sh device scripts: unpack the staged production package
# (staged into .fa4dev/ by the device machine's stage-fa4.sh, outside this repository) and set the paths and $OUT.
mkdir -p /tmp/site && tar xJf .fa4dev/site.tar.xz -C /tmp/site
export PYTHONPATH=$PWD:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD/.fa4dev/extra
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
# the CuTe-DSL compile cache's size and file count: whether carrying it to the next call (64 MiB in
# all) could spare the compilation that keeps release from fitting one call cold (docs/compare.md)
say_compile_cache() {
  local dir=${FLASH_ATTENTION_CUTE_DSL_CACHE_DIR:-}
  echo "compile cache: $(du -sh "$dir" 2>/dev/null | cut -f1) in $(find "$dir" -type f 2>/dev/null | wc -l) files"
}
