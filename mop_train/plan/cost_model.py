"""Predicted step time of a job under a layout and operator set: the ranking model of `mop-train plan --auto`.

    step = predict_step(StepInputs(model=args, active_params=..., world=8, seq_len=131072, ...))
    print(step.seconds, step.tokens_per_s); for name, s, how in step.terms: ...

Calibrated on one and two H200s (benchmarks/RESULTS.md, DESIGN.md's measured facts), at `small`'s
shape: it is a model for RANKING configurations against each other, not a promise of a step time.
Constants measured on one host are assumed to carry over to others (a multi-node fabric has not
been measured at all: INTER_NODE_SLOWDOWN is a spec ratio), and the MFUs of a 1.5K-wide model are
used for every width. A term is one cost per step, per rank (every rank does the same work):

  compute     N * (dense FLOPs/token / (peak * MFU_DENSE) + attention FLOPs/token(S) / (peak * MFU_ATTENTION)),
              full recompute included (the calibration runs checkpoint every block); a block that is
              not checkpointed saves its forward's share, RECOMPUTE_SHARE; with [mop.attention] keep a
              checkpointed block's recompute skips its attention pass (the same share of its attention)
  tiling      [mop.tiling]: TILING_SHARE of the compute (each tiled stage's forward once more in backward)
  fsdp        FSDP2's all-gathers (two a block, one with fsdp_reshard_after_forward = "never") and
              reduce-scatters, exposed only beyond the compute they overlap
  reshard     fsdp_reshard_after_forward = "never": a saving, the device's copy-in cast and copy of each
              block gathered once a micro-batch instead of twice (at W=1 no link bytes move at all; fitted
              on one H100: FSDP_COPY_BYTES_PER_S)
  replicas    the expert and vocab shards' gradient all-reduce over their replica groups, after backward
  ulysses     the sequence group's all-to-all of q, k, v and the attention output (D > 1)
  dispatch    the expert group's dispatch and combine all-to-alls (E_p > 1)
  chunking    PipelinedLLEP's per-chunk overhead on the expert part (K > 1), and its own recompute of the
              expert activations in blocks that are not checkpointed
  ring_dtp    Ring-DTP's schedule against the chunked loss the compute term holds: "recompute" adds its
              extra GEMM pass over the standard loss; "grad_in_forward" (three passes, no fp32 logits
              replayed) is a saving, a share of the output projection's part of the compute term (one
              point on one H100: GRAD_IN_FORWARD_SHARE); and its hops when P spans nodes
  sco         the share of SCO's boundary traffic the prefetch does not hide
  optimizer   AdamW on the device, or OffloadStreamAdamW: the host link, host memory or the CPU share
              (host_fraction, updated in place by the CPU while the rest streams), whichever binds (with
              weights / gradients streamed, the gradient in and working copy out of every element the device
              updates too); the share's time per parameter fitted on one H100's 16-core host with one rank
              (HOST_ADAMW_S_PER_PARAM) and, where R ranks share a host, R / 2 times what two ranks measured
              on an H200's (SHARED_HOST_ADAMW_S_PER_PARAM)
  streams     weights / gradients = "stream": the working weights in per gather, the gradients out, exposed
              beyond the compute (an assumption: not measured yet)

Not modelled: LLEP's relocation under skewed routing (zero at balanced routing, what the router's
bias balancing aims for), overlap of the optimizer with the next forward (nor so how much of the CPU
share's time the step hides: its constant takes the measured steps as they are), document masks,
grad_in_forward at P > 1 (its rounds' all-reduces and dX ring: charged as at P = 1, and not searched
there), fsdp_reshard_after_forward = "always" (its extra gather of the last block).

Against the 19 measured `small` runs it was fitted on (1 and 2 H200s, 4K-524K, operators off and on; listed
in tests/plan/test_auto_plan.py), the predicted tokens/s are within -12% .. +11%, except every operator on at 4K on
2 GPUs (+32%: fixed per-step costs of a 0.1 s step that no term models).

Legend: W ranks, R ranks per node, D / E_p / P the degrees, L blocks, N = B*S/D tokens per rank
per micro-batch, S context, H hidden, V vocab, k top-k, I expert width, h heads, K chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

from mop_train.models.args import MoEModelArgs
from mop_train.ops.moe_dispatch.options import PipelinedLLEPOptions
from mop_train.ops.moe_dispatch.pipelined_llep import num_chunks
PEAK_FLOPS = 989e12
"""Dense bf16 peak of an H200 by its spec sheet (989 TFLOP/s; torchtitan's get_peak_flops and
mop_train.train.metrics use the same figure): the unit the efficiencies below were fitted in."""

MFU_DENSE = 0.15
"""Achieved share of the peak on 6 FLOPs per active non-embedding parameter per token (full recompute
included). Least squares, with MFU_ATTENTION, over nine operators-off runs of `small`: RESULTS.md
"Training small on one H200" (2026-11-29, 25,923 tokens/s at 2 x 4K), "Memory plan against the
measured peak on one H200" (2026-11-30, plain 32K / 128K / 256K: 24,809 / 10,643 / 6,100 tokens/s),
"End-to-end against torchtitan" (2026-11-30, ours best 43,752 tokens/s at 32K on 2 H200s) and
DESIGN.md's 2-GPU context sweep (2026-11-30, 41.3K / 33.4K / 20.3K / 12.0K tokens/s at 32K-262K)."""

MFU_ATTENTION = 0.45
"""Achieved share of the peak on causal attention's 6 * L * h * d_qk * S FLOPs per token (the metric of
mop_train.train.metrics); same fit as MFU_DENSE."""

RECOMPUTE_SHARE = 0.25
"""Share of a checkpointed block's compute that is the recomputed forward (2 of 8 FLOPs per parameter and
token; 1 of 4 attention passes): derived, not measured."""

FSDP_BYTES_PER_S = 42e9
"""FSDP2 traffic per rank per second inside a node: RESULTS.md "small, 50 steps on 2 GPUs" (2026-11-30),
operators off: 24,898 tokens/s at 4,096 tokens per rank = 0.329 s per step against ~0.16 s of compute
and optimizer; the step there is the 13.2 GB of gathers and reduce-scatters per rank at this rate."""

FSDP_COPY_BYTES_PER_S = 10 * 2_435_988_224 / 8.36e-3
"""Device bytes per second of FSDP2's per-gather copies (2.9 TB/s): the copy-in's cast of each shard to the
compute dtype ((4 + act) B per shard element) and its copy of the gathered block (2 * act B per element).
Fitted to `small` at 2 x 4K on one H100 (RESULTS.md "Levers and streaming on one H100, 2026-12-06",
benchmarks/results/h100_2026-12-06/reshard_2x4k_*.json; local dispatch, AdamW, no AC, W=1): with
fsdp_reshard_after_forward = "never" the copies took 52.3 -> 43.9 ms a step (the fp32 -> bf16 casts 15.6 ->
10.5 ms, device-to-device copies 16.7 -> 13.4 ms), 27,059 -> 27,799 tokens/s (1.027x), for the 2,435,988,224
parameters of every block but the last that "default" gathers again in backward, 10 B each at W=1. That is 87%
of the H100's 3.35 TB/s: the copies run at the memory's speed. At W > 1 the cast touches only the 1/W shard
and the gathered bytes arrive over the link: an assumption, not measured."""

A2A_BYTES_PER_S = 75e9
"""All-to-all bytes per rank per second inside a node (Ulysses and expert dispatch): fitted to `small` on 2 H200s
with D=2, E_p=2, every operator on (DESIGN.md "Measured facts, 2026-11-30", one run: 21.5K / 17.1K / 11.3K
tokens/s at 65K / 131K / 262K): after compute, loss and optimizer, 0.42 / 0.82 / 1.51 s remain for 32 / 64 /
128 GB of all-to-all (76-85 GB/s). The P=2 points of RESULTS.md "End-to-end against torchtitan" (2026-11-30)
leave 0.06-4.8 s at 32K-524K: the other terms' noise is larger than the all-to-all there."""

INTER_NODE_SLOWDOWN = 9.0
"""How much slower a group that spans nodes moves bytes: NVLink 4's 450 GB/s per direction over one
400 Gb/s (50 GB/s) NIC per GPU. A spec ratio: no multi-node run has been measured."""

OFFLOAD_S_PER_PARAM = 0.2437 / 1e9
"""OffloadStreamAdamW's step per streamed parameter, one rank alone on its host: RESULTS.md
"OffloadStreamAdamW (optimizer step)" (2026-11-29), 1.0B parameters, 25M x 3 slots: 0.2437 s
(98.7% of the host link's floor)."""

HOST_BYTES_PER_PARAM = 24
"""Host memory traffic of a host-resident AdamW per parameter per step (fp32 master and two moments read
and written): RESULTS.md "Why not 2.5x DeepSpeed" (2026-11-29)."""

HOST_MEMORY_BYTES_PER_S = 144e9
"""Useful host memory bandwidth of a node, shared by its ranks' streamed steps (the streamed rest: a CPU
share's own traffic is inside its constants below): RESULTS.md "Why not 2.5x
DeepSpeed" (2026-11-29): copies and CPU updates together saturate at ~140-145 GB/s. With two ranks on a
host it predicts 0.55 s for `small`'s 1.65B parameters per rank; RESULTS.md "small, 50 steps on 2 GPUs"
(2026-11-30) measured 574 ms."""

HOST_ADAMW_S_PER_PARAM = (16 * 3_290_190_336 * OFFLOAD_S_PER_PARAM / 12 - (1.8821 - 1.3229)) / 2_303_133_235
"""OffloadStreamAdamW's CPU share (host_fraction): step seconds per parameter the CPU updates in place, one rank
alone on its host (0.221 ns). Fitted on one host type, an H100's with 16 cores: RESULTS.md "Levers and streaming
on one H100, 2026-12-06" (benchmarks/results/h100_2026-12-06/variants_2x4k.json, variants_host0.5.json,
variants_host0.7.json), `small` at 2 x 4K, every operator, weights and gradients streamed with overlap, CPU share
0 / 0.3 / 0.5 / 0.7: 1.882 / 1.585 / 1.391 / 1.323 s a step. Beside streamed gradients a share's 30 B per
parameter leave the link (12 + 4 in, 12 + 2 out): this model's link term (H200 rates; 16 B in per parameter
binds: 1.069 s for the 3,290,190,336 parameters at share 0) falls by 0.321 / 0.535 s at 0.3 / 0.5, where the
link still binds (measured 0.297 / 0.491 s: +8% / +9%); at 0.7 the CPU binds, and the 0.559 s measured saved
leave 1.069 - 0.559 = 0.510 s for its round(0.7 * 3,290,190,336) = 2,303,133,235 parameters. The H100's seconds
are taken as they are. It is the step's cost, not the CPU's time: step() spent 0.30-0.32 ns per share parameter
there (optimizer_s in the JSON), as torch's fused CPU AdamW does while pinned copies run (0.393 ns, 0.199 alone:
RESULTS.md "Why not 2.5x DeepSpeed", H200 host, 16 threads); the rest of the step hides part of it. The share's
own host memory traffic is in this figure (HOST_MEMORY_BYTES_PER_S charges the streamed rest only). Not measured
in a training step: a share beside gradients on the device (4 B each way on the link), where the optimizer step
alone gained less than this predicts (one rank, 1B parameters, share 0.6: 0.250 -> 0.232 s measured, 0.244 ->
0.146 s predicted; RESULTS.md "OffloadStreamAdamW, two ranks sharing the host")."""

SHARED_HOST_ADAMW_S_PER_PARAM = 1.240 / 0.6e9
"""The CPU share's seconds per parameter of one rank when two ranks share the host (2.07 ns; R / 2 times that
at R ranks): RESULTS.md "OffloadStreamAdamW, two ranks sharing the host" (2026-11-29, H200 host, 1B parameters per
rank, gradients on the device, the optimizer step alone): two ranks at once took 0.620-0.628 / 0.912-0.932 /
1.224-1.256 s at shares 0.3 / 0.45 / 0.6 (2.05-2.08 ns per share parameter alike; the link's rest is under 0.2
s), against 0.232 s for one rank alone at 0.6 (0.39 ns): over five times slower per parameter. Charged as
measured: where one rank alone hides part of the CPU's time in the training step (HOST_ADAMW_S_PER_PARAM),
nothing is assumed hidden for ranks sharing a host. With it the model keeps host_fraction = 0 where ranks share
a host, as measured there (0.256-0.345 s at share 0). Only R = 2 measured: more ranks are assumed linear."""

DEVICE_ADAMW_S_PER_PARAM = 0.027 / 3.29e9
"""Fused AdamW on the device per local parameter: RESULTS.md "The optimizer in training on one H200"
(2026-11-30), plain: 0.027 s per optimizer step for `small`'s 3.29B parameters."""

HOST_LINK_BYTES_PER_S = 12e9 / 0.2405
"""Pinned host <-> device bytes per second each way: RESULTS.md "OffloadStreamAdamW" (2026-11-29), link
floor 0.2405 s for 12 B x 1B parameters each way (49.9 GB/s)."""

SCO_EXPOSED_SHARE = 0.07
"""Share of SCO's boundary traffic (down in forward, up in backward) the step waits for: RESULTS.md
"SCO on one H200", 24 blocks (2026-11-29): the worst row, 18 boundaries (3,240 MiB) offloaded, +9 ms of
3.079 s against 136 ms of link time."""

RING_DTP_TIME_RATIO = 1.25
"""Ring-DTP's loss time over the standard loss: RESULTS.md "Ring-DTP ring, P=2, bf16" (2026-11-30), 0.307
vs 0.245 s at N=16384 per rank; P=1: 0.2985 vs 0.2397 s (1.245x, "Ring-DTP (vocab projection)" 2026-11-29)."""

GRAD_IN_FORWARD_SHARE = 0.53
"""Ring-DTP's grad_in_forward loss as a share of the time the compute term charges the output projection
(6 * N * H * V FLOPs per micro-batch at MFU_DENSE, the chunked cross-entropy it replaces): its term is
-(1 - share) of that, a saving. One point, on one H100 (not an H200 like the rest): RESULTS.md "Levers and
streaming on one H100, 2026-12-06" (benchmarks/results/h100_2026-12-06/levers_32k_auto*.json), `small` at
1 x 32K as plan --auto picked it (pipelined_llep c=32768, no AC): 25,324 -> 29,722 tokens/s, 1.2940 ->
1.1025 s a step (the loss's kernels 222.3 -> 103.7 ms, copies 109.9 -> 56.4 ms), 0.1915 s saved against the
projection's 6 * 32768 * 1536 * 200000 / (989e12 * 0.15) = 0.4071 s: 1 - 0.1915 / 0.4071 = 0.53. This model
predicts 1.251 s for the chunked step measured at 1.294 s, so the H100's seconds are taken as they are.
Assumed for every width and context: at a wider H the projection runs nearer LOSS_MFU than MFU_DENSE."""

LOSS_MFU = 0.594
"""Share of the peak the standard loss reaches on its 6 * N * H * V FLOPs: RESULTS.md "Ring-DTP (vocab
projection)" (2026-11-29), 0.2397 s at N=16384, H=7168, V=200000, bf16."""

TILING_SHARE = 0.019
"""Sequence tiling's cost as a share of the compute: RESULTS.md "Sequence tiling at 131K" (2026-12-01), tiled steps
of `small` with every operator at 0.981x the untiled ones' tokens/s. One point: taken for every context (where a
rank's tokens fit one tile, "auto" leaves the stage untiled and the search's untiled twin wins on this cost)."""

CHUNK_OVERHEAD = 0.004
"""PipelinedLLEP's extra time per chunk beyond the first, as a share of the expert part (expert GEMMs and
dispatch): RESULTS.md "Expert dispatch, 2 ranks over NCCL" (2026-11-30), inside a checkpointed block
0.96-1.01x LLEP at 65K tokens (K=10) and 0.98-1.09x at 32K (K=8). The one-rank, 384-expert case (2.2-2.5x,
"Expert dispatch on one H200" 2026-11-29, few rows per expert) is not what an E_p > 1 rank sees."""

PIPELINED_RECOMPUTE = 1 / 3
"""PipelinedLLEP recomputes each chunk's expert activations in backward (8 expert GEMM passes instead of 6):
RESULTS.md "Expert dispatch on one H200", per-rank proxy (2026-11-29), 1.32-1.34x forward+backward of the bare
layer. Inside a checkpointed block LLEP pays the same recompute (the in-block ratio is ~1.0), so it is
charged only for blocks that are not checkpointed."""


@dataclass(frozen=True)
class StepInputs:
    """What one rank does per step. Counts are parameters (not bytes)."""
    model: MoEModelArgs
    active_params: int
    """Parameters one token touches (zoo.param_counts' "active")."""
    embedding_params: int
    """The input embedding's (a lookup: no FLOPs)."""
    fsdp_params: int
    """Parameters FSDP2 gathers and reduces over all W (the expert and vocab shards kept out excluded)."""
    local_params: int
    """This rank's parameters: the optimizer's work."""
    world: int
    ranks_per_node: int
    seq_len: int
    local_batch: int
    micro_batches: int = 1
    expert_shard_params: int = 0
    """This rank's routed-expert parameters when the expert group shards them (0 with "local" dispatch):
    their gradients are summed over the W/E_p ranks holding the same shard after backward."""
    vocab_shard_params: int = 0
    """This rank's share of the output projection when P > 1 (summed over the W/P replicas likewise)."""
    seq_degree: int = 1
    expert_degree: int = 1
    vocab_degree: int = 1
    dispatch: str = "local"
    token_budget: int = PipelinedLLEPOptions.token_budget       # the schedule's own defaults
    max_chunks: int = PipelinedLLEPOptions.max_chunks
    ring_dtp: bool = False
    checkpointed_layers: int | None = None
    """Blocks under activation checkpointing (None: every block)."""
    sco_offloaded_bytes: int = 0
    """Boundary bytes SCO offloads per micro-batch on this rank."""
    offload_optimizer: bool = False
    device_fraction: float = 0.0
    """OffloadStreamAdamW's share of the state kept and updated on the device."""
    host_fraction: float = 0.0
    """OffloadStreamAdamW's share of the streamed rest that the CPU updates in place ([mop.offload_adamw]
    host_fraction): its state stays off the link, and its gradient and working weight too where they stream."""
    stream_weights: bool = False
    """[mop.offload_adamw] weights = "stream": each block's working weights copied in per gather."""
    stream_gradients: bool = False
    """[mop.offload_adamw] gradients = "stream": each gradient copied out as it is final."""
    tiled: bool = False
    """[mop.tiling]: some per-token stage runs over token tiles."""
    keep_attention: bool = False
    """[mop.attention] keep: checkpointed blocks keep attention's output and log-sum-exp for the recompute."""
    fsdp_gathers: int = 2
    """FSDP2 all-gathers of each block per micro-batch: its forward and its backward, or the forward alone
    with [parallelism] fsdp_reshard_after_forward = "never" (the head unit and the embedding are gathered
    once either way; counted as blocks, a small over-count at "never")."""
    reshard_saved_params: int = 0
    """Block parameters FSDP2 does not gather again for backward with fsdp_reshard_after_forward = "never":
    every block but the last, which the default policy already keeps unsharded (0 under "default")."""
    ring_schedule: str = "recompute"
    """Ring-DTP's schedule as it will run: "recompute" or "grad_in_forward" ([mop.ring_dtp] schedule,
    "auto" resolved as plan.job.ring_dtp_plan_schedule resolves it)."""
    act_bytes: int = 2


@dataclass(frozen=True)
class StepPrediction:
    terms: list[tuple[str, float, str]]
    tokens_per_step: int
    """Tokens of one optimizer step over all ranks: micro-batches x B x S x W/D."""

    @property
    def seconds(self) -> float:
        return sum(s for _, s, _ in self.terms)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.seconds


def _bytes_per_s(rate: float, degree: int, ranks_per_node: int) -> float:
    """A contiguous group of `degree` ranks stays inside a node when degree <= R (layout.py's placement)."""
    return rate if degree <= ranks_per_node else rate / INTER_NODE_SLOWDOWN


def _ulysses_elements(a: MoEModelArgs) -> int:
    """Elements per token one all-to-all round moves: q, k, v to heads and the output back to sequence."""
    if a.attention == "mla":
        return a.n_heads * (2 * a.qk_head_dim + 2 * a.v_head_dim)
    return (a.n_heads * 2 + a.n_kv_heads * 2) * a.head_dim


def _optimizer_term(x: StepInputs) -> tuple[float, str]:
    if not x.offload_optimizer:
        return x.local_params * DEVICE_ADAMW_S_PER_PARAM, "fused AdamW on the device"
    return offload_step_seconds(x.local_params, device_fraction=x.device_fraction, host_fraction=x.host_fraction,
                                stream_weights=x.stream_weights, stream_gradients=x.stream_gradients,
                                sharing=min(x.ranks_per_node, x.world), act_bytes=x.act_bytes)


def offload_step_seconds(local: int, *, device_fraction: float, host_fraction: float, stream_weights: bool,
                         stream_gradients: bool, sharing: int, act_bytes: int) -> tuple[float, str]:
    """OffloadStreamAdamW's step on one rank of `local` parameters, `sharing` ranks to a host: the host link,
    host memory or the CPU share, whichever binds, then the device share. Every part is linear in `local`."""
    streamed = local - round(device_fraction * local)
    by_cpu = round(host_fraction * streamed)            # the streamed range's tail (host_update.host_split)
    rest, by_device = streamed - by_cpu, local - by_cpu
    # 12 B each way per streamed element; with streaming, every element the device updates has its gradient
    # come in from the host (4 B) and its working copy go out to it (act B), the device share's too. The CPU
    # share's gradient goes down (4 B) unless it streamed there, and its master up (4 B) unless the working
    # weights are host tensors: nothing of it crosses with both streamed
    inward = 12 * rest + 4 * by_device * stream_gradients + 4 * by_cpu * (not stream_weights)
    outward = 12 * rest + act_bytes * by_device * stream_weights + 4 * by_cpu * (not stream_gradients)
    link = max(inward, outward) * OFFLOAD_S_PER_PARAM / 12
    memory = sharing * rest * HOST_BYTES_PER_PARAM / HOST_MEMORY_BYTES_PER_S
    cpu = by_cpu * (HOST_ADAMW_S_PER_PARAM if sharing == 1 else sharing / 2 * SHARED_HOST_ADAMW_S_PER_PARAM)
    phase, bound = max((link, "host link"), (memory, f"host memory shared by {sharing} ranks"),
                       (cpu, "the CPU" if sharing == 1 else f"the CPU shared by {sharing} ranks"), key=lambda t: t[0])
    share = f", {by_cpu / 1e9:.2f}B of them by the CPU (host_fraction {host_fraction:g})" if by_cpu else ""
    return phase + (local - streamed) * DEVICE_ADAMW_S_PER_PARAM, (
        f"OffloadStreamAdamW: {streamed / 1e9:.2f}B streamed ({bound}){share}, {(local - streamed) / 1e9:.2f}B on "
        f"the device")


def _shape(x: StepInputs) -> tuple[int, int, float]:
    """(N tokens per rank per micro-batch, checkpointed blocks, passes over a block: forward, backward and
    the recompute where checkpointed)."""
    L = x.model.n_layers
    ckpt = L if x.checkpointed_layers is None else x.checkpointed_layers
    return x.local_batch * x.seq_len // x.seq_degree, ckpt, 2 + (ckpt / L if L else 0)


def _compute_term(x: StepInputs) -> tuple[str, float, str]:
    a, (N, ckpt, _), L = x.model, _shape(x), x.model.n_layers
    saved = RECOMPUTE_SHARE * (L - ckpt) / L if L else 0.0
    kept = RECOMPUTE_SHARE * ckpt / L if L and x.keep_attention else 0.0   # the recompute's attention pass skipped
    dense = 6.0 * (x.active_params - x.embedding_params) / (PEAK_FLOPS * MFU_DENSE)
    attention = 6.0 * L * a.n_heads * a.qk_head_dim * x.seq_len / (PEAK_FLOPS * MFU_ATTENTION)
    return ("compute", x.micro_batches * N * (dense * (1.0 - saved) + attention * (1.0 - saved - kept)),
            f"{x.micro_batches} x {N:,} tokens: {dense * 1e6:.1f} us/token dense + {attention * 1e6:.1f} us/token "
            f"attention at S={x.seq_len:,}" + (f", {L - ckpt} block(s) not recomputed" if ckpt < L else "")
            + (", attention kept across the recompute" if kept else ""))


def _sharding_terms(x: StepInputs, compute: float) -> list[tuple[str, float, str]]:
    """FSDP2's traffic beyond the compute it overlaps, and the device copies "never" saves; the MoP shards'
    gradient all-reduce over their replicas."""
    W, R = x.world, x.ranks_per_node
    fsdp_bytes = x.micro_batches * x.fsdp_params * (x.fsdp_gathers * x.act_bytes + 4) * (W - 1) / W   # fp32 reduce
    fsdp = fsdp_bytes / _bytes_per_s(FSDP_BYTES_PER_S, W, R)
    terms = [("fsdp", max(0.0, fsdp - compute), f"{fsdp_bytes / 1e9:.1f} GB in {fsdp:.2f} s, exposed beyond the compute")]
    if x.reshard_saved_params:
        copies = x.micro_batches * x.reshard_saved_params * ((4 + x.act_bytes) / W + 2 * x.act_bytes)
        terms.append(("reshard", -copies / FSDP_COPY_BYTES_PER_S,
                      f"never, a saving: no second gather of {x.reshard_saved_params / 1e9:.2f}B block params "
                      f"({copies / 1e9:.1f} GB of device casts and copies)"))
    replica_bytes = 0.0
    for shard, degree in ((x.expert_shard_params, x.expert_degree), (x.vocab_shard_params, x.vocab_degree)):
        replicas = W // degree
        if shard and replicas > 1:
            replica_bytes += 2 * (replicas - 1) / replicas * shard * 4                    # fp32 all-reduce
    if replica_bytes:
        terms.append(("replicas", replica_bytes / _bytes_per_s(FSDP_BYTES_PER_S, W, R),
                      f"{replica_bytes / 1e9:.1f} GB of shard gradients all-reduced over their replicas"))
    return terms


def _all_to_all_terms(x: StepInputs) -> list[tuple[str, float, str]]:
    """Ulysses over D; dispatch and combine over E_p; PipelinedLLEP's per-chunk overhead on the expert part."""
    a, R, D, Ep, act = x.model, x.ranks_per_node, x.seq_degree, x.expert_degree, x.act_bytes
    (N, ckpt, passes), micro, terms = _shape(x), x.micro_batches, []
    if D > 1:
        volume = micro * a.n_layers * N * _ulysses_elements(a) * act * passes * (D - 1) / D
        terms.append(("ulysses", volume / _bytes_per_s(A2A_BYTES_PER_S, D, R),
                      f"{volume / 1e9:.1f} GB of all-to-all over D={D}"))
    layers, dispatch = a.n_moe_layers, 0.0
    if x.dispatch != "local" and Ep > 1 and layers:
        volume = micro * layers * N * a.top_k * a.dim * act * 2 * passes * (Ep - 1) / Ep
        dispatch = volume / _bytes_per_s(A2A_BYTES_PER_S, Ep, R)
        terms.append(("dispatch", dispatch, f"{volume / 1e9:.1f} GB of dispatch + combine over E_p={Ep} ({x.dispatch})"))
    if x.dispatch == "pipelined_llep" and layers:
        experts = micro * N * layers * a.top_k * 3 * a.dim * a.moe_inter_dim * 6.0 / (PEAK_FLOPS * MFU_DENSE)
        K, c_eff = num_chunks(max(N, 1), x.token_budget, x.max_chunks)
        unchecked = (a.n_layers - ckpt) / a.n_layers
        terms.append(("chunking", (experts + dispatch) * CHUNK_OVERHEAD * (K - 1) + experts * PIPELINED_RECOMPUTE * unchecked,
                      f"K={K} chunks of {c_eff:,} tokens" + (", expert recompute in unchecked blocks" if unchecked else "")))
    return terms


def _operator_terms(x: StepInputs) -> list[tuple[str, float, str]]:
    """Ring-DTP against the chunked loss (and its hops when P spans nodes); SCO's exposed boundary traffic."""
    a, R, P, (N, _, _), terms = x.model, x.ranks_per_node, x.vocab_degree, _shape(x), []
    if x.ring_dtp or P > 1:
        flops = x.micro_batches * 6.0 * N * a.dim * a.vocab_size
        if x.ring_schedule == "grad_in_forward":   # against the projection's part of the compute term
            projection = flops / (PEAK_FLOPS * MFU_DENSE)
            ring = (GRAD_IN_FORWARD_SHARE - 1.0) * projection
            how = (f"grad_in_forward, a saving: {1 - GRAD_IN_FORWARD_SHARE:.0%} of the output projection's "
                   f"{projection:.3f} s in the compute")
        else:
            loss = flops / (PEAK_FLOPS * LOSS_MFU)
            ring = (RING_DTP_TIME_RATIO - 1.0) * loss
            how = f"recompute, {RING_DTP_TIME_RATIO - 1:.0%} over the standard loss's {loss:.3f} s"
        if P > R:
            ring += x.micro_batches * 2 * (P - 1) * N * a.dim * x.act_bytes * 2 / _bytes_per_s(A2A_BYTES_PER_S, P, R)
        terms.append(("ring_dtp", ring, how + (", hops across nodes" if P > R else "")))
    if x.sco_offloaded_bytes:
        link = x.micro_batches * 2 * x.sco_offloaded_bytes / HOST_LINK_BYTES_PER_S
        terms.append(("sco", SCO_EXPOSED_SHARE * link, f"{SCO_EXPOSED_SHARE:.0%} of {link:.2f} s of boundary traffic"))
    return terms


def _stream_term(x: StepInputs, compute: float) -> tuple[str, float, str]:
    """weights / gradients = "stream": the working weights in (two gathers a micro-batch: forward, and
    backward with its recompute), the gradients out (and back for the add of each later micro-batch),
    exposed beyond the compute they overlap (an assumption: not measured yet)."""
    N, M = x.local_params, x.micro_batches
    up = M * 2 * x.act_bytes * N * x.stream_weights + (M - 1) * 4 * N * x.stream_gradients
    down = M * 4 * N * x.stream_gradients
    link = max(up, down) / HOST_LINK_BYTES_PER_S
    return ("streams", max(0.0, link - compute), f"{max(up, down) / 1e9:.1f} GB each way at most in {link:.2f} s, "
            f"exposed beyond the compute")


def predict_step(x: StepInputs) -> StepPrediction:
    """The step's time on one rank, term by term (see the module docstring)."""
    compute = _compute_term(x)
    terms = [compute, *_sharding_terms(x, compute[1]), *_all_to_all_terms(x), *_operator_terms(x),
             ("optimizer", *_optimizer_term(x))]
    if x.tiled:
        terms.append(("tiling", TILING_SHARE * compute[1], f"{TILING_SHARE:.1%} of the compute"))
    if x.stream_weights or x.stream_gradients:
        terms.append(_stream_term(x, compute[1]))
    return StepPrediction(terms, x.micro_batches * x.local_batch * x.seq_len * (x.world // x.seq_degree))


def format_prediction(p: StepPrediction) -> str:
    width = max(len(n) for n, _, _ in p.terms)
    lines = [f"predicted step (ranking model, calibrated on 1-2 H200s; not a promise): "
             f"{p.seconds:.3f} s, {p.tokens_per_s:,.0f} tokens/s over all ranks"]
    lines += [f"  {name:<{width}}  {s:>9.3f} s  {how}" for name, s, how in p.terms if s or name == "compute"]
    return "\n".join(lines)

