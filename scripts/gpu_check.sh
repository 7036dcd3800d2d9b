#!/usr/bin/env bash
# One H200 call: GPU tests, `small` training (plain and with every operator on), and the
# single-GPU SCO and dispatch benchmarks. Logs and JSON land in $OUT (default ./gpu_out).
# Usage (on the GPU machine, from the repo root, wheels carried in .whl/):
#   bash scripts/gpu_check.sh [STEP ...]   # default: every step
# Steps: train_small train_small_all_ops sco_bench dispatch_bench gpu_tests (the default set), and
#        optimizer_bench vocab_bench train_small_offload_0.0 train_small_offload_0.45 train_small_docmask
#        docmask_tests docmask_bench (only when named)
set -uo pipefail
want=" ${*:-train_small train_small_all_ops sco_bench dispatch_bench gpu_tests} "
source "$(dirname "$0")/gpu_steps.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
step train_small 110 torchrun --standalone --nproc_per_node=1 -m mop_train.train \
  --job.config_file configs/small_1gpu.toml --job.dump_folder /tmp/run_small --training.steps 20
[[ $want == *" train_small "* ]] && cp /tmp/run_small/metrics.jsonl "$OUT/train_small_metrics.jsonl" 2>/dev/null
step train_small_all_ops 120 torchrun --standalone --nproc_per_node=1 -m mop_train.train \
  --job.config_file configs/small_1gpu.toml --job.dump_folder /tmp/run_all --training.steps 20 \
  --mop.moe.dispatch pipelined_llep --mop.ring_dtp.enable --mop.sco.host_budget 8GiB \
  --optimizer.name OffloadStreamAdamW --mop.offload_adamw.bucket_params 50000000
[[ $want == *" train_small_all_ops "* ]] && cp /tmp/run_all/metrics.jsonl "$OUT/train_all_ops_metrics.jsonl" 2>/dev/null
step train_small_docmask 110 torchrun --standalone --nproc_per_node=1 -m mop_train.train \
  --job.config_file configs/small_1gpu.toml --job.dump_folder /tmp/run_docmask --training.steps 20 --mop.data.document_mask
[[ $want == *" train_small_docmask "* ]] && cp /tmp/run_docmask/metrics.jsonl "$OUT/train_docmask_metrics.jsonl" 2>/dev/null
for share in 0.0 0.45; do  # OffloadStreamAdamW alone, streamed only and with a CPU share
  step train_small_offload_$share 150 torchrun --standalone --nproc_per_node=1 -m mop_train.train \
    --job.config_file configs/small_1gpu.toml --job.dump_folder /tmp/run_offload_$share --training.steps 20 \
    --optimizer.name OffloadStreamAdamW --mop.offload_adamw.bucket_params 25000000 --mop.offload_adamw.slots 3 \
    --mop.offload_adamw.host_fraction $share
  [[ $want == *" train_small_offload_$share "* ]] && cp /tmp/run_offload_$share/metrics.jsonl "$OUT/train_offload_${share}_metrics.jsonl" 2>/dev/null
done
TAIL=40 step sco_bench 150 python3 benchmarks/sco.py --layers 12 --repeats 2
TAIL=40 step dispatch_bench 120 torchrun --standalone --nproc_per_node=1 benchmarks/moe_dispatch.py --tokens 65536 --modes ep pipelined_llep --profiles balanced 80/16 50/4 --repeats 1
TAIL=15 step gpu_tests 120 python3 -m pytest -q -m gpu tests/ops/test_sco.py tests/ops/test_offload_adamw.py -p no:cacheprovider
TAIL=15 step docmask_tests 120 python3 -m pytest -q -m gpu tests/models/test_document_mask.py -p no:cacheprovider
TAIL=20 step docmask_bench 150 python3 benchmarks/document_mask.py
TAIL=45 step optimizer_bench 330 python3 benchmarks/optimizer_step.py ${OPT_BENCH_ARGS:---buckets 25000000,100000000 --slots 2,3} \
  --skip fsdp2_offload
TAIL=12 step vocab_bench 150 python3 benchmarks/vocab_projection.py --dtypes bfloat16 --block-sizes 8192
