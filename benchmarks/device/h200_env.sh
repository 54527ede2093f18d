# Sourced by the benchmarks/device/h200_*.sh device scripts: unpack the staged production package
# (staged into .fa4dev/ by the device machine's stage-fa4.sh, outside this repository) and set the paths and $OUT.
mkdir -p /tmp/site && tar xJf .fa4dev/site.tar.xz -C /tmp/site
export PYTHONPATH=$PWD:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD/.fa4dev/extra
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
