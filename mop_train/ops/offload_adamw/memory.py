"""OffloadStreamAdamW's device bytes, in the bound protocol the memory plan sums (mop_train.ops.bound).

During the step the streamed part needs its staging slots (`staging_bytes_bound`: s x B x 12 bytes
plus one bucket's fp32 gradient upcast, and the host share's cast temporaries when it is on); the
device-resident share (`device_fraction` of this rank's elements) keeps its moments, and an fp32
master unless the working weight is itself fp32 (`device_bytes_per_element`), all step.

With [mop.offload_adamw] weights / gradients != "device" the parameters' and gradients' own device
bytes follow `weights_bound` and `gradients_bound` (the plan's "parameters" and "gradients" lines).
Before the first step the device holds more than they say: the model is initialised on the device in
fp32 and the optimizer is built around it before `WorkingWeights` moves the values to the masters
(`startup_bound`, the plan's "start-up" line).

Legend: N local elements, d device_fraction, B bucket capacity (elements), s slots, s_w weight-window slots.
"""

from __future__ import annotations

from dataclasses import dataclass

from mop_train.ops.bound import DeviceBound
from mop_train.ops.offload_adamw.buckets import staging_bytes_bound
from mop_train.ops.offload_adamw.device_share import device_bytes_per_element


@dataclass(frozen=True)
class OffloadSettings:
    """The [mop.offload_adamw] settings that size the device bound (device_fraction resolved)."""
    bucket_params: int
    slots: int
    host_share: bool = False            # host_fraction > 0
    device_fraction: float = 0.0


def device_bound(settings: OffloadSettings, local_params: int, *, fp32_weights: bool) -> DeviceBound:
    """`saved`: the device share's state (all step); `working`: the staging of the streamed part."""
    s = settings
    staging = staging_bytes_bound(s.bucket_params, s.slots, s.host_share)
    per = device_bytes_per_element(fp32_weights=fp32_weights)
    share = round(s.device_fraction * local_params) * per
    return DeviceBound(share, staging, f"OffloadStreamAdamW: staging {s.slots} x {s.bucket_params:,} x 12 B "
                                       f"+ grad buffer, device share {s.device_fraction:g} x {per} B")


WEIGHTS = ("device", "bf16", "stream")
"""[mop.offload_adamw] weights values (the optimizer, the config check and the plan use these)."""
GRADIENTS = ("device", "stream")
"""[mop.offload_adamw] gradients values."""


@dataclass(frozen=True)
class StreamSettings:
    """[mop.offload_adamw] weights, gradients and weight_window (working.py, grad_stream.py)."""
    weights: str = "device"
    gradients: str = "device"
    weight_window: int = 2

    def __post_init__(self):
        for key, value, valid in (("weights", self.weights, WEIGHTS), ("gradients", self.gradients, GRADIENTS)):
            if value not in valid:
                raise ValueError(f"mop.offload_adamw.{key} = {value!r} must be one of {valid}; set one of them")
        w = self.weight_window
        if isinstance(w, bool) or not isinstance(w, int) or w < 1:
            raise ValueError(f"mop.offload_adamw.weight_window = {w!r} must be an int >= 1 (block-sized device "
                             "slots; 2 copies one block ahead)")


@dataclass(frozen=True)
class WeightShapes:
    """This rank's sizes that bound the working weights and gradients on the device (elements)."""
    local_params: int        # N: every local element
    unit_shard: int          # the largest block unit's local shard FSDP2 gathers (the root unit excluded)
    kept_out_block: int      # the largest block kept out of FSDP2: one MoE layer's expert shards, or the vocab shard
    vocab_shard: int = 0     # the vocab shard handed to Ring-DTP (P > 1), 0 otherwise
    act_bytes: int = 2       # the compute (working) dtype's bytes


def weights_bound(settings: StreamSettings, shapes: WeightShapes) -> DeviceBound:
    """The device bytes of the parameters ("parameters" line): fp32 shards (4 B x N), bf16 working
    weights (2 B x N), or the stream windows: s_w slots of the largest block unit's shard and s_w of
    the largest block kept out of FSDP2, in the working dtype, plus, under bf16 compute, the fp32 copy
    of the vocab shard Ring-DTP holds from the loss's forward to its backward."""
    s, x = settings, shapes
    if s.weights == "device":
        return DeviceBound(4 * x.local_params, 0, f"fp32 shards: 4 B x {x.local_params:,} local params")
    if s.weights == "bf16":
        return DeviceBound(2 * x.local_params, 0, f"bf16 working weights: 2 B x {x.local_params:,} local params")
    slots = s.weight_window * (x.unit_shard + x.kept_out_block) * x.act_bytes
    vocab = 4 * x.vocab_shard if x.act_bytes != 4 else 0
    return DeviceBound(0, slots + vocab, f"streamed: {s.weight_window} slots x ({x.unit_shard:,} unit + "
                       f"{x.kept_out_block:,} shard block) x {x.act_bytes} B"
                       + (f" + the vocab shard in fp32 for Ring-DTP ({x.vocab_shard:,} x 4 B)" if vocab else ""))


def gradients_bound(settings: StreamSettings, shapes: WeightShapes, *, device_grads: int,
                    retained_grads: int, micro_batches: int = 1) -> DeviceBound:
    """The device bytes of the gradients ("gradients" line): `device_grads` (what the plan counts at
    its peak with gradients on the device), or streamed: `retained_grads` (what is still on the device
    at the plan's peak: in the loss, the head unit's and the vocab shard's being formed; none once the
    loss's backward is over, since FSDP2 reduces the head unit right after it and each block after its
    own; at the very end the embedding's unsharded gradient and its reduce-scatter buffers) plus the
    staging of the blocks leaving: two units' fp32 shards (one copying out, the next reduced) and one
    block kept out of FSDP2 (its gradients are formed together, and held until its replica sum), and
    with several micro-batches the running sum of one block copied back for the add.
        streamed bytes = retained + 4 x (2 x unit shard + kept-out block) [+ 4 x max(unit, block) if M > 1]"""
    s, x = settings, shapes
    if s.gradients == "device":
        return DeviceBound(device_grads, 0, "fp32 gradients on the device")
    staging = 4 * (2 * x.unit_shard + x.kept_out_block)
    partial = 4 * max(x.unit_shard, x.kept_out_block) if micro_batches > 1 else 0
    return DeviceBound(retained_grads, staging + partial,
                       f"streamed to the host as each unit's is final: {retained_grads:,} B still here + 2 x "
                       f"{x.unit_shard:,} unit + {x.kept_out_block:,} shard block in flight x 4 B"
                       + (" + one running sum copied back (micro-batches)" if partial else ""))


def startup_bound(settings: StreamSettings, *, local_params: int, optimizer_bytes: int,
                  whole_model_params: int = 0, piece_params: int = 0) -> DeviceBound:
    """The device bytes before the first step (mop_train.train.build.build_model, then the optimizers):
    every local parameter materialised and initialised on the device in fp32 (4 B x N), the optimizer's
    device bytes allocated while they are (`optimizer_bytes`: OffloadStreamAdamW's staging and device
    share; torch's AdamW allocates its moments in the first step), and with weights = "bf16" the bf16
    working weights (2 B x N) allocated before the fp32 tensors are dropped; with "stream" the windows'
    slots come after. A model initialised whole (`whole_model_params` > 0: small enough to initialise
    identically on every rank) is on the device whole before FSDP2 shards it (4 B x all params).
    `piece_params` > 0 ([mop.offload_adamw] host_init with a model initialised by shards): the pieces
    are initialised one at a time on the device and kept on the host (mop_train.train.build.
    init_pieces_to_host), so the largest piece's local elements stand in for N, twice (FSDP2 pads a
    copy while its `_apply` runs), and are gone before the optimizer allocates.
        start-up = max(4 x whole, 4 x N [+ 2 x N for bf16] + optimizer)
        host_init: max(2 x 4 x piece, [2 x N for bf16] + optimizer)"""
    working = 2 * local_params if settings.weights == "bf16" else 0
    whole = 4 * whole_model_params
    if piece_params and not whole_model_params:
        pieces = 2 * 4 * piece_params
        if pieces >= working + optimizer_bytes:
            return DeviceBound(pieces, 0, f"one piece initialised on the device at a time (host_init): "
                                          f"2 x 4 B x {piece_params:,}")
        return DeviceBound(working + optimizer_bytes, 0, "the optimizer's device bytes"
                           + (" + bf16 working weights (2 B x N)" if working else "") + " (host_init)")
    built = 4 * local_params + working + optimizer_bytes
    if whole > built:
        return DeviceBound(whole, 0, f"the whole model in fp32 before FSDP2 shards it: 4 B x {whole_model_params:,}")
    return DeviceBound(built, 0, f"fp32 parameters initialised on the device (4 B x {local_params:,})"
                       + (" + bf16 working weights (2 B x N)" if working else "")
                       + (f" + the optimizer's {optimizer_bytes / 2**30:.2f} GiB" if optimizer_bytes else "")
                       + " before the masters take the values")
