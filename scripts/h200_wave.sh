#!/usr/bin/env bash
# One H200 call of the 2026-12-01 wave (issues 32-37): the named steps, each under its own time limit,
# logs and JSON in $OUT. Usage (on the GPU machine, repo root, wheels carried in .whl/):
#   bash scripts/h200_wave.sh STEP ...
# Steps:
#   offload_repro      torchtitan's one-rank CPU offload, its own entry point (benchmarks/titan_offload_repro.py)
#   fake_smoke         the fake world's GPU path (benchmarks/fake_world.py smoke)
#   fake_37b_64k       one rank of mop-37b at W=8, 64K tokens (fake world)
#   fake_120b_64k      one rank of mop-120b at W=16, 64K tokens (fake world)
#   profile_2x4k       where ours-auto's step time goes at 2 x 4K (benchmarks/step_profile.py)
#   profile_stream_2x4k  where the 2 x 4K step with weights and gradients streamed (issue 32's all-stream-overlap)
#                      waits: copies against compute (benchmarks/step_profile.py); PROFILE_STREAM_EXTRA adds flags
#                      (e.g. "--mop.offload_adamw.stage_in_backward --mop.offload_adamw.slots 28"), PROFILE_STREAM_TAG
#                      names its folder
#   gpu_tests          the wave's gpu-marked tests, those never run on a GPU first (PipelinedLLEP's group of one
#                      without host syncs and the grouped dW's idle-expert mask, compile), then the foreach norm,
#                      LocalShardAdamW, streaming, the one-rank reduction, profiling, core workspace; GPU_TEST_FILES,
#                      GPU_TESTS_S override
#   variants_2x4k      issue 32 at 2 x 4K: every weights/gradients setting, link floor (train_variants.py);
#                      V2_VARIANTS, V2_BASE, V2_EXTRA (one override for every variant, e.g. --debug.deterministic)
#   variants_long      issue 32 at SHAPE (default 1x524288), LONG_VARIANTS (default "all"), LONG_STEPS (default 2)
#                      each: a 524K step of `small` takes ~170 s, so two variants per call need LONG_STEPS=1
#                      LONG_WARMUP=0 (the one step is then the first, warm-up included: say so)
#   snapshot_repro     which memory-history setting trips the checkpointed loss (benchmarks/snapshot_repro.py)
#   tiling_core        the attention core's bytes per token and backward workspace against the plan
#   tiling_steps       real steps of `small`, every operator, tiled against untiled (benchmarks/tiling.py --phase train);
#                      TILING_SEQ (default 131072), TILING_VARIANTS (default tiled,untiled), TILING_STEPS (default 3)
#   small_1m           `small` at 1M tokens, every operator + tiling (+ streaming), one step
#   compile_2x4k       compile gain at 2 x 4K, ours and torchtitan (benchmarks/compile_gain.py)
#   compile_32k        the same at 1 x 32K (~8 min)
#   levers_32k         issue 37's two loss/combine levers at 1 x 32K, ours-auto profiled twice (~70 s): as planned
#                      (chunked cross-entropy; the combine is combine.sum_token_rows since 2026-12-03), then with
#                      Ring-DTP's grad_in_forward schedule as the P = 1 loss (three GEMM passes, no recompute)
#   attention_kernels  the attention core at `small`'s shape (mla-h16: 16 heads, d_qk 192, d_v 128) at 32K and 128K:
#                      every kernel's forward and forward+backward TFLOP/s (benchmarks/attention.py; issue 37's third
#                      lever); ATTN_METHODS overrides the method list, ATTN_S the limit
#   ab_step_end        `small` as plan --auto runs it on one 80 GB GPU at 2 x 4K (AdamW on the device), tokens/s of the
#                      tree against the mop_train/ copied into baseline/ (AB_BASE; `git archive` of an earlier commit,
#                      carried), run A B A B (benchmarks/train_variants.py --variants auto-1gpu-2x4k; a record
#                      every 5th step, since a record reads the device: 20 steps, the windows ending at 10, 15, 20 timed);
#                      AB_EXTRA adds one override to every run (AB_EXTRA=--debug.deterministic: are the trees' losses bitwise?);
#                      AB_VARIANT another variant (auto-80gb-32k: plan --auto's 1 x 32K on 80 GB, PipelinedLLEP, for the
#                      combine's segment sums against AB_BASE=baseline_combine, a `git archive` of ef0b7a2); AB_TAG
#                      prefixes the run folders (two A/Bs in one command); the summary prints tokens/s and the losses
#   optim_host         host time of a fused AdamW step over 160 small DTensor parameters on CUDA: torch's against
#                      LocalShardAdamW (benchmarks/optimizer_host_overhead.py --device cuda)
#   reshard_2x4k       ours-auto at 2 x 4K profiled as planned, then with [parallelism] fsdp_reshard_after_forward
#                      = "never" (one FSDP2 gather a block per step instead of two; free at the peak at W = 1)
#   fake_667b_1m_snapshot  the memory snapshot of issue 35's largest point, mop-667b at W=64 and 1M (~480 s)
#   long_start, long_wait  one step of `small` longer than a command (issue 37's reach at 16x torchtitan's 90,112:
#                      SEQ default 1441792, ~1,200 s): long_start launches it in its own process session (it outlives
#                      the command, device README "Notes") and waits LONG_WAIT_S (default 570); each long_wait, in the
#                      next commands of the same lease, waits again; both copy its log and metrics to $OUT
#   plan_gap_32k       where the 2.6 GiB the plan misses at plan --auto's 1 x 32K on 80 GB go (RESULTS 2026-12-08):
#                      three steps with a CUDA memory snapshot ([profiling] enable_memory_snapshot, dumped at step 2),
#                      the peak's make-up by allocating frame (benchmarks/fake_world.py peak) to $OUT (~150 s)
#   e2e_tps            issue 37's throughput points against torchtitan's grid (benchmarks/e2e_vs_torchtitan.py
#                      --phases tps); E2E_S (default 570), E2E_SERIES (default "torchtitan ours-auto"),
#                      E2E_EXTRA (more flags, e.g. --resume benchmarks/results/.../e2e.json)
set -uo pipefail
want=" $* "
source "$(dirname "$0")/gpu_steps.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
git log --oneline -1 2>/dev/null || true
ALL_OPS=(--training.local_batch_size 1 --mop.moe.dispatch pipelined_llep --mop.ring_dtp.enable
         --mop.sco.host_budget auto --optimizer.name OffloadStreamAdamW)
TAIL=12 step offload_repro 150 python3 benchmarks/titan_offload_repro.py --out "$OUT/offload_repro"
TAIL=12 step fake_smoke 120 python3 benchmarks/fake_world.py smoke --out "$OUT/fake"
TAIL=12 step fake_37b_64k 200 python3 benchmarks/fake_world.py run mop-37b-w8-64k --out "$OUT/fake"
TAIL=12 step fake_120b_64k 200 python3 benchmarks/fake_world.py run mop-120b-w16-64k --out "$OUT/fake"
TAIL=40 step profile_2x4k 150 python3 benchmarks/step_profile.py --config configs/small_1gpu.toml --auto \
  --seq-len 4096 --batch 2 --out "$OUT/prof_2x4k"
STREAM_OPS=(--mop.moe.dispatch pipelined_llep --mop.ring_dtp.enable --mop.sco.host_budget 8GiB
            --optimizer.name OffloadStreamAdamW --mop.offload_adamw.weights stream --mop.offload_adamw.gradients stream
            --mop.offload_adamw.overlap)
TAIL=40 step profile_stream_2x4k 170 python3 benchmarks/step_profile.py --config configs/small_1gpu.toml \
  --seq-len 4096 --batch 2 --out "$OUT/prof_stream_2x4k${PROFILE_STREAM_TAG:-}" -- "${STREAM_OPS[@]}" ${PROFILE_STREAM_EXTRA:-}
GPU_TEST_FILES=${GPU_TEST_FILES:-tests/ops/test_moe_dispatch_chunks.py tests/models/test_document_mask.py \
  tests/ops/test_route_counts.py \
  tests/train/test_compile.py tests/test_sharding.py tests/train/test_local_shard_optim.py \
  tests/train/test_offload_streaming_gpu.py tests/ops/test_offload_adamw_working.py tests/train/test_fsdp_reduce.py \
  tests/train/test_profiling.py tests/models/test_core_workspace.py \
  tests/train/test_host_init_gpu.py tests/train/test_validation_gpu.py}
TAIL=30 step gpu_tests ${GPU_TESTS_S:-300} python3 -m pytest -q -m gpu $GPU_TEST_FILES -p no:cacheprovider
V2_S=${V2_S:-560}
TAIL=30 step variants_2x4k $V2_S python3 benchmarks/train_variants.py --variants ${V2_VARIANTS:-ops-device all all-stream \
  all-gstream all-bf16} --base ${V2_BASE:-all} --compute ops-device --steps 6 --warmup 2 --budget-s $((V2_S - 20)) ${V2_EXTRA:+--extra=$V2_EXTRA} \
  --out "$OUT/variants_2x4k"
LONG_S=${LONG_S:-590}
TAIL=30 step variants_long $LONG_S python3 benchmarks/train_variants.py --shape ${SHAPE:-1x524288} \
  --variants ${LONG_VARIANTS:-all} --base ${LONG_BASE:-all} --steps ${LONG_STEPS:-2} --warmup ${LONG_WARMUP:-1} \
  --point-timeout-s ${LONG_POINT_S:-575} --budget-s $((LONG_S - 10)) --out "$OUT/variants_long"
TAIL=20 step snapshot_repro 150 python3 benchmarks/snapshot_repro.py --out "$OUT/snapshot_repro"
TAIL=30 step tiling_core 120 python3 benchmarks/tiling.py --phase core
TILING_S=${TILING_S:-280}
TAIL=20 step tiling_steps $TILING_S python3 benchmarks/tiling.py --phase train --seq-len-list ${TILING_SEQ:-131072} \
  --variants ${TILING_VARIANTS:-tiled,untiled} --steps ${TILING_STEPS:-3} --point-timeout $(( (TILING_S - 10) / 2 )) \
  --root /tmp/tiling
TAIL=30 step small_1m 590 torchrun --standalone --nproc_per_node=1 -m mop_train.train \
  --job.config_file configs/small_1gpu.toml --job.dump_folder /tmp/run_1m --training.steps 1 \
  --training.seq_len ${SEQ:-1048576} "${ALL_OPS[@]}" ${SMALL_1M_FLAGS:-}
[[ -f /tmp/run_1m/metrics.jsonl ]] && cp /tmp/run_1m/metrics.jsonl "$OUT/small_1m_metrics.jsonl"
LONG_RUN=/tmp/run_long
if [[ $want == *" long_start "* ]]; then   # every operator, tiling without keep, weights and gradients streamed
  mkdir -p $LONG_RUN && echo "=== long_start: small at ${SEQ:-1441792} tokens, one step, in its own session"
  setsid nohup env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True torchrun --standalone --nproc_per_node=1 \
    -m mop_train.train --job.config_file configs/small_1gpu.toml --job.dump_folder $LONG_RUN --training.steps 1 \
    --training.seq_len ${SEQ:-1441792} "${ALL_OPS[@]}" --mop.tiling.ffn_tokens auto --mop.tiling.block_tokens auto \
    --mop.moe.max_chunks 40 --mop.sco.host_budget ${LONG_SCO:-56GiB} --mop.offload_adamw.weights stream \
    --mop.offload_adamw.gradients stream ${LONG_FLAGS:-} > $LONG_RUN/train.log 2>&1 < /dev/null &
  echo $! > $LONG_RUN/pid
fi
if [[ $want == *" long_start "* || $want == *" long_wait "* ]]; then
  pid=$(cat $LONG_RUN/pid 2>/dev/null) || { echo "=== long_wait: no long run on this machine (a fresh one?)"; exit 1; }
  t0=$(date +%s); limit=${LONG_WAIT_S:-570}
  while kill -0 "$pid" 2>/dev/null && (( $(date +%s) - t0 < limit )); do sleep 5; done
  kill -0 "$pid" 2>/dev/null && state=running || state=ended
  echo "=== long run $state after $(( $(date +%s) - t0 ))s of waiting"; tail -n 30 $LONG_RUN/train.log
  cp $LONG_RUN/train.log "$OUT/long_train.log"; cp $LONG_RUN/metrics.jsonl "$OUT/long_metrics.jsonl" 2>/dev/null || true
fi
TAIL=30 step compile_2x4k 420 python3 benchmarks/compile_gain.py --shapes 2x4096 --out "$OUT/compile"
TAIL=30 step compile_32k 580 python3 benchmarks/compile_gain.py --shapes 1x32768 --out "$OUT/compile_32k"
TAIL=25 step levers_32k 200 bash -c "python3 benchmarks/step_profile.py --config configs/small_1gpu.toml --auto \
  --seq-len 32768 --batch 1 --out $OUT/levers_32k/auto && python3 benchmarks/step_profile.py \
  --config configs/small_1gpu.toml --auto --seq-len 32768 --batch 1 --out $OUT/levers_32k/auto_gif -- \
  --mop.ring_dtp.enable --mop.ring_dtp.schedule grad_in_forward; rm -f $OUT/levers_32k/*/trace.json.gz"
ATTN_S=${ATTN_S:-170}
TAIL=25 step attention_kernels $ATTN_S env OUT="$OUT" python3 benchmarks/attention.py --shapes mla-h16 \
  --seq-lens 32K,128K --time-budget $((ATTN_S - 15)) \
  --methods ${ATTN_METHODS:-sdpa_default,sdpa_cudnn,sdpa_cudnn_pad_v,sdpa_flash_pad_v,sdpa_efficient,flex_block_mask}
AB_BASE=${AB_BASE:-baseline}
ab_run() {  # ab_run TREE TAG: train_variants.py of that tree, its own modules first on the path
  (cd "$1" && PYTHONPATH=$PWD:/tmp/site python3 benchmarks/train_variants.py --variants ${AB_VARIANT:-auto-1gpu-2x4k} --steps 20 --warmup 6 \
    --extra=--metrics.log_freq=5 ${AB_EXTRA:+--extra=$AB_EXTRA} --out "$OUT/ab_step_end/${AB_TAG:-}$2") || echo "=== $2 failed"
}
if [[ $want == *" ab_step_end "* ]]; then
  [[ -d $AB_BASE/mop_train ]] || { echo "=== ab_step_end: no $AB_BASE/mop_train"; exit 1; }
  export -f ab_run; export OUT
  TAIL=40 step ab_step_end ${AB_S:-300} bash -c "ab_run $AB_BASE base1; ab_run . new1; ab_run $AB_BASE base2; ab_run . new2; \
    python3 -c 'import json,sys; [print(p, [(round(r[\"tokens_per_s\"]), r[\"losses\"]) for r in json.load(open(p))[\"rows\"]]) for p in sys.argv[1:]]' \
    $OUT/ab_step_end/${AB_TAG:-}*/train_variants.json"
fi
TAIL=6 step optim_host 60 python3 benchmarks/optimizer_host_overhead.py --device cuda
TAIL=25 step reshard_2x4k 200 bash -c "python3 benchmarks/step_profile.py --config configs/small_1gpu.toml --auto \
  --seq-len 4096 --batch 2 --out $OUT/reshard_2x4k/default && python3 benchmarks/step_profile.py \
  --config configs/small_1gpu.toml --auto --seq-len 4096 --batch 2 --out $OUT/reshard_2x4k/never -- \
  --parallelism.fsdp_reshard_after_forward never; rm -f $OUT/reshard_2x4k/*/trace.json.gz"
TAIL=12 step fake_667b_1m_snapshot 590 python3 benchmarks/fake_world.py run mop-667b-w64-1024k --steps 1 --snapshot \
  --timeout 580 --out "$OUT/fake"
GAP_RUN=/tmp/run_gap_32k
TAIL=30 step plan_gap_32k 300 bash -c "rm -rf $GAP_RUN; torchrun --standalone --nproc_per_node=1 -m mop_train.train \
  --job.config_file configs/small_1gpu.toml --job.dump_folder $GAP_RUN --training.steps 3 --training.seq_len 32768 \
  --training.local_batch_size 1 --activation_checkpoint.mode none --mop.moe.dispatch pipelined_llep \
  --mop.moe.token_budget 32768 --mop.ring_dtp.enable --mop.ring_dtp.schedule grad_in_forward \
  --profiling.enable_memory_snapshot --profiling.profile_freq 2 --checkpoint.no-enable \
  && python3 benchmarks/fake_world.py peak \$(ls $GAP_RUN/*/iteration_2/rank0_memory_snapshot.pickle | head -1)"
E2E_S=${E2E_S:-570}
TAIL=40 step e2e_tps $E2E_S python3 benchmarks/e2e_vs_torchtitan.py --nproc 1 --budget-s $((E2E_S - 15)) --phases tps \
  --series ${E2E_SERIES:-torchtitan ours-auto} --out "$OUT/e2e" ${E2E_EXTRA:-}
exit 0
