# Sourced by the GPU-machine scripts (gpu_check.sh, h200_wave.sh): install the carried wheels, set the
# environment, and define `step NAME SECONDS CMD...` (run CMD under a time limit if NAME is in $want,
# log to $OUT/NAME.log, print its exit code, time and the log's tail). The caller sets `want`.
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=$PWD:/tmp/site || exit 1
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
  MOP_TRAIN_CACHE=/tmp/mop_cache
step() {
  local name=$1 limit=$2; shift 2
  [[ $want == *" $name "* ]] || return 0
  echo "=== $name (limit ${limit}s): $*"
  local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "=== $name rc=$rc in $(( $(date +%s) - t0 ))s"; tail -n "${TAIL:-25}" "$OUT/$name.log"
}
