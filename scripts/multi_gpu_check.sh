#!/usr/bin/env bash
# Multi-GPU check on one host of N >= 2 GPUs: the layout and every operator over NCCL, in bf16.
# From the repo root on the GPU host, with the wheels of ../shared/tools/device-wheels.sh in .whl/:
#   BUDGET=570 bash scripts/multi_gpu_check.sh [PART ...]   # default: every part, in this order
# Parts (each step time-limited; a failure is logged and the next step still runs):
#   invariance  `debug` in bf16, 3 steps: W=1 against (W=N, D=2, E_p=N, P=2) for every dispatch
#               schedule (Ring-DTP is the loss at P=2), fresh folders; beside it the bf16 noise:
#               W=1 bf16 vs W=1 fp32 and W=1 bf16 under two seeds
#   small       `small`, 50 steps on N GPUs, every operator on (D=2, E_p=N, P=2, PipelinedLLEP,
#               Ring-DTP, SCO auto, OffloadStreamAdamW) and every operator off (FSDP2, local
#               dispatch, AdamW on the GPU), the same global batch (2 x 4096 tokens) and seed
#   tests       the distributed operator tests over NCCL (pytest -m gpu, 2 ranks)
#   ring        benchmarks/vocab_projection.py --ring on N ranks (bf16; auto and both forced modes)
#   dispatch    benchmarks/moe_dispatch.py on N ranks: ep / llep / pipelined_llep, the paper's seven
#               routing profiles, 32K and 65K tokens per rank, 48 experts per rank (an 8-GPU run's)
#   offload     OffloadStreamAdamW at 1B params: one rank alone, then N ranks at once sharing the host
#               (one process per GPU), over host fractions 0 / 0.3 / 0.45 / 0.6
# Issue 38's parts (this wave's features over NCCL; not in the default list: name them):
#   gputests    every gpu-marked test on the N GPUs (pytest -m gpu tests; the nccl-2 ones use two)
#   streaming   [mop.offload_adamw] weights / gradients over NCCL: `debug` in bf16 at (W=N, D=2, E_p=N, P=2),
#               3 steps per setting (device/device, stream/stream, stream/device, bf16/device, device/stream,
#               stream/stream with overlap), the same seed (~4 min)
#   stream_long `small` with every operator at 524K and 1M (D=N), one step each, device/device against
#               stream/stream, tiling and keep on (~15 min: SEQS="524288" or "1048576" splits it in two commands)
#   tiled       `small` on N GPUs (Ulysses D=N) at 1M and 2M with every operator, tiling, keep and
#               stream/stream, one step each (a 2M step may not fit one 600 s command: SEQS splits it)
#   fake        the fake-world rank (--comm.mode fake_backend, WORLD_SIZE=N RANK=0, one GPU) against rank 0
#               of the real N-GPU run of the same configuration at 131K and 524K (every operator, D=N)
#   e2e         benchmarks/e2e_vs_torchtitan.py --nproc N: torchtitan's best per point, both reach
#               bisections, the batch search at 8K
# Logs, JSON and a summary (summary.txt, summary.json) go to $OUT (default ./multi_gpu_out);
# every log is also bundled into $OUT/logs.tar.gz.
set -uo pipefail
OUT=${OUT:-$PWD/multi_gpu_out}; mkdir -p "$OUT/logs"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=$PWD:/tmp/site || exit 1
# NVLink multicast stays off on shared hosts (see the device notes).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
  MOP_TRAIN_CACHE=/tmp/mop_cache
N=$(python3 -c "import torch; print(torch.cuda.device_count())")
[ "$N" -ge 2 ] || { echo "needs 2+ GPUs, found $N"; exit 2; }
want=" ${*:-invariance small tests ring dispatch offload} "
T0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

BUDGET=${BUDGET:-100000}   # seconds for the whole run: a step gets at most what is left, less 20 s for the summary
step() {  # step NAME LIMIT CMD...: run a real command (not a shell function) with a time limit
  local name=$1 limit=$2; shift 2
  local left=$(( BUDGET - 20 - ($(date +%s) - T0) ))
  if (( left < 30 )); then
    echo "=== $name skipped: ${left}s of BUDGET=${BUDGET}s left"; echo "$name skipped 0" >> "$OUT/logs/steps.txt"; return
  fi
  (( limit > left )) && limit=$left
  echo "=== [+$(( $(date +%s) - T0 ))s] $name (limit ${limit}s): $*"
  local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/logs/$name.log" 2>&1; local rc=$?
  echo "=== $name rc=$rc in $(( $(date +%s) - t0 ))s"; tail -n "${TAIL:-12}" "$OUT/logs/$name.log"
  echo "$name $rc $(( $(date +%s) - t0 ))" >> "$OUT/logs/steps.txt"
}
train() {  # train NAME LIMIT NPROC ARGS...: a fresh dump folder /tmp/runs/NAME per run
  local name=$1 limit=$2 nproc=$3; shift 3
  rm -rf "/tmp/runs/$name"
  step "$name" "$limit" torchrun --standalone --nproc_per_node="$nproc" -m mop_train.train \
    --job.dump_folder "/tmp/runs/$name" "$@"
  cp "/tmp/runs/$name/metrics.jsonl" "$OUT/logs/$name.metrics.jsonl" 2>/dev/null
}
part() { [[ $want == *" $1 "* ]]; }

if part invariance; then
  DEBUG=(--job.config_file configs/debug_cpu.toml --training.steps 3 --metrics.log_freq 1 --checkpoint.no-enable
         --metrics.no-enable-tensorboard)
  BF16=(--training.mixed_precision_param bfloat16)
  # The three one-rank references are independent: one per GPU at a time.
  CUDA_VISIBLE_DEVICES=0 train inv_w1_bf16 150 1 "${DEBUG[@]}" "${BF16[@]}" --debug.seed 11 --training.local_batch_size 4 &
  CUDA_VISIBLE_DEVICES=1 train inv_w1_fp32 150 1 "${DEBUG[@]}" --debug.seed 11 --training.local_batch_size 4 &
  wait
  CUDA_VISIBLE_DEVICES=0 train inv_w1_bf16_seed12 150 1 "${DEBUG[@]}" "${BF16[@]}" --debug.seed 12 \
    --training.local_batch_size 4
  for dispatch in ep llep pipelined_llep; do
    train "inv_w${N}_$dispatch" 150 "$N" "${DEBUG[@]}" "${BF16[@]}" --debug.seed 11 \
      --training.local_batch_size $((8 / N)) --mop.layout.seq_degree 2 --mop.layout.expert_degree "$N" \
      --mop.layout.vocab_degree 2 --mop.moe.dispatch "$dispatch" --mop.moe.token_budget 24 \
      --mop.moe.min_tokens_per_gemm 8 --mop.moe.imbalance_threshold 1.0
  done
fi

if part small; then
  SMALL=(--job.config_file configs/small_1gpu.toml --training.steps 50 --debug.seed 3 --metrics.no-enable-tensorboard)
  train small_ops_on 300 "$N" "${SMALL[@]}" --training.local_batch_size 2 --mop.layout.seq_degree 2 \
    --mop.layout.expert_degree "$N" --mop.layout.vocab_degree 2 --mop.moe.dispatch pipelined_llep \
    --mop.ring_dtp.enable --mop.sco.host_budget auto --optimizer.name OffloadStreamAdamW \
    --mop.offload_adamw.bucket_params 25000000 --mop.offload_adamw.slots 3
  train small_ops_off 200 "$N" "${SMALL[@]}" --training.local_batch_size 1
fi

if part tests; then
  TAIL=25 step nccl_tests 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/ops/test_moe_dispatch.py \
    tests/ops/test_ring_dtp.py tests/test_ulysses.py tests/test_sharding.py
fi

if part ring; then
  TAIL=14 step ring_bench 150 env OUT="$OUT/logs" torchrun --standalone --nproc_per_node="$N" benchmarks/vocab_projection.py --ring \
    --dtypes bfloat16 --ring-tokens 16384,32768 --name ring_p"$N"
fi

if part dispatch; then
  TAIL=50 step dispatch_bench 300 env OUT="$OUT/logs" torchrun --standalone --nproc_per_node="$N" benchmarks/moe_dispatch.py \
    --experts $((48 * N)) --tokens 32768 65536 --repeats 2
fi

if part offload; then
  OPT=(benchmarks/optimizer_step.py --sizes 1000000000 --buckets 25000000 --slots 3 --fraction-staging 25000000x3
       --host-fractions 0.3,0.45,0.6 --skip torch_cpu,deepspeed,fsdp2_offload --repeats 3)
  TAIL=20 step offload_alone 150 env OUT="$OUT/logs/offload_alone" CUDA_VISIBLE_DEVICES=0 python3 "${OPT[@]}"
  for ((r = 0; r < N; r++)); do
    TAIL=20 step "offload_shared_$r" 200 env OUT="$OUT/logs/offload_shared_$r" CUDA_VISIBLE_DEVICES=$r \
      python3 "${OPT[@]}" &
  done
  wait
fi

ALL_OPS=(--mop.moe.dispatch pipelined_llep --mop.ring_dtp.enable --mop.sco.host_budget auto
         --optimizer.name OffloadStreamAdamW --training.local_batch_size 1)
TILED=(--mop.tiling.ffn_tokens auto --mop.tiling.block_tokens auto --mop.attention.keep)
STREAM=(--mop.offload_adamw.weights stream --mop.offload_adamw.gradients stream)
LONG=(--job.config_file configs/small_1gpu.toml --training.steps 1 --metrics.log_freq 1 --checkpoint.no-enable
      --metrics.no-enable-tensorboard --debug.seed 3)
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}

if part gputests; then
  TAIL=30 step gpu_tests 540 python3 -m pytest -q -m gpu -p no:cacheprovider tests
fi

if part streaming; then
  DEBUG=(--job.config_file configs/debug_cpu.toml --training.steps 3 --metrics.log_freq 1 --checkpoint.no-enable
         --metrics.no-enable-tensorboard --training.mixed_precision_param bfloat16 --debug.seed 11
         --training.local_batch_size $((8 / N)) --mop.layout.seq_degree 2 --mop.layout.expert_degree "$N"
         --mop.layout.vocab_degree 2 --mop.moe.dispatch pipelined_llep --optimizer.name OffloadStreamAdamW
         --mop.offload_adamw.bucket_params 3000)
  for setting in device:device stream:stream stream:device bf16:device device:stream; do
    train "stream_${setting/:/_}" 150 "$N" "${DEBUG[@]}" --mop.offload_adamw.weights "${setting%:*}" \
      --mop.offload_adamw.gradients "${setting#*:}"
  done
  train stream_stream_stream_overlap 150 "$N" "${DEBUG[@]}" "${STREAM[@]}" --mop.offload_adamw.overlap
fi

if part stream_long; then
  for seq in ${SEQS:-524288 1048576}; do
    train "small_${seq}_device" 590 "$N" "${LONG[@]}" "${ALL_OPS[@]}" "${TILED[@]}" --training.seq_len "$seq" \
      --mop.layout.seq_degree "$N"
    train "small_${seq}_stream" 590 "$N" "${LONG[@]}" "${ALL_OPS[@]}" "${TILED[@]}" "${STREAM[@]}" \
      --training.seq_len "$seq" --mop.layout.seq_degree "$N"
  done
fi

if part tiled; then
  for seq in ${SEQS:-1048576 2097152}; do
    train "tiled_${seq}" 590 "$N" "${LONG[@]}" "${ALL_OPS[@]}" "${TILED[@]}" "${STREAM[@]}" \
      --training.seq_len "$seq" --mop.layout.seq_degree "$N" --mop.moe.max_chunks 40
  done
fi

if part fake; then
  for seq in 131072 524288; do
    FAKE=("${LONG[@]}" "${ALL_OPS[@]}" "${TILED[@]}" --training.steps 2 --training.seq_len "$seq"
          --mop.layout.seq_degree "$N")
    train "real_${seq}" 400 "$N" "${FAKE[@]}"
    rm -rf "/tmp/runs/fake_${seq}"
    step "fake_${seq}" 400 env CUDA_VISIBLE_DEVICES=0 WORLD_SIZE="$N" RANK=0 python3 -m mop_train.train \
      "${FAKE[@]}" --job.dump_folder "/tmp/runs/fake_${seq}" --comm.mode fake_backend
    cp "/tmp/runs/fake_${seq}/metrics.jsonl" "$OUT/logs/fake_${seq}.metrics.jsonl" 2>/dev/null
  done
fi

if part e2e; then
  TAIL=40 step e2e 590 python3 benchmarks/e2e_vs_torchtitan.py --nproc "$N" --budget-s 570 \
    --phases tps reach-titan reach-ours batch8k --out "$OUT/logs/e2e"
fi

python3 scripts/multi_gpu_summary.py "$OUT/logs" "$N" | tee "$OUT/summary.txt"
cp "$OUT/logs/summary.json" "$OUT/summary.json" 2>/dev/null
tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$OUT/logs"
echo "=== total $(( $(date +%s) - T0 ))s"
