"""The MoE decoder: embeddings -> n_layers pre-norm blocks -> final RMSNorm.

    h = tok_embeddings(tokens)
    for block in layers:  h = h + attention(attention_norm(h)); h = h + ffn(ffn_norm(h))
    return norm(h)        # [B, S, H]: the output projection is applied by the loss, not here

With `tile_blocks(model, ffn_tokens, block_tokens)` the FFNs and attention's row-wise stages run over
token tiles (same values; mop_train.ops.tiling).

`ffn` is `feed_forward` (dense SwiGLU) in the first n_dense_layers blocks and `moe` after.
`output.weight [V, H]` is the vocabulary projection that the loss (e.g. Ring-DTP) consumes: the loss
calls `output()` for it (`OutputProjection`), so that module hooks (FSDP2's head unit) see its use.
Runs on one device; parallelism (FSDP, expert/sequence parallel) is applied from outside.
Build without allocation: `with torch.device("meta"): m = MoETransformer(args)`, then
`m.to_empty(device=d)` and `m.init_weights(buffer_device=d)`.

Legend: B batch, S sequence, H hidden, V vocab, E experts, L blocks.
"""

from __future__ import annotations

import numbers
from typing import Callable

import torch
from torch import nn

from mop_train.models.args import MoEModelArgs
from mop_train.models.attention import build_attention, rope_cos_sin, rope_inv_freq
from mop_train.models.fp32_buffers import KeepFp32Buffers
from mop_train.models.moe import FeedForward, MoE
from mop_train.ops.tiling import TilingOptions


class TransformerBlock(nn.Module):
    """Pre-norm block: attention + (dense FFN or MoE), each with a residual."""

    def __init__(self, layer_id: int, args: MoEModelArgs):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = build_attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        if layer_id < args.n_dense_layers:
            self.feed_forward = FeedForward(args.dim, args.dense_ffn_dim)
        else:
            self.moe = MoE(args)
        # Depth-scaled std for the projections that write into the residual stream.
        self.init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5
        self.tile_tokens = 0   # set from outside (`tile_blocks`): 0 runs attention's stages untiled

    def forward(self, x: torch.Tensor, rope: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, S, H], rope [S, r/2, 2], doc_ids None or [B, S_full] int -> [B, S, H]."""
        tile = self.tile_tokens
        if tile and x.shape[0] * x.shape[1] > tile:   # attention's norm, projections, RoPE and wo over tiles
            x = x + self.attention.forward_tiled(x, self.attention_norm, rope, doc_ids, tile)
        else:  # view_as: the norm's two uses of x reach x as one gradient, as the tiled path's do
            x = x + self.attention(self.attention_norm(x.view_as(x)), rope, doc_ids)
        ffn = self.moe if hasattr(self, "moe") else self.feed_forward
        return x + ffn(self.ffn_norm(x))

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.init_std)
        (self.moe if hasattr(self, "moe") else self.feed_forward).init_weights(self.init_std)


def tile_blocks(model: nn.Module, ffn_tokens: int, block_tokens: int) -> tuple[int, int]:
    """Set the token tiles of every block's stages ([mop.tiling], mop_train.ops.tiling): `ffn_tokens`
    on each dense FFN and shared expert, `block_tokens` on each block's attention stages (0: untiled).
    Call between steps. Returns (FFNs, blocks) set. "auto" must be resolved first (TilingOptions.resolve,
    models.memory.tiling_options): only token counts are taken."""
    for key, value in (("ffn_tokens", ffn_tokens), ("block_tokens", block_tokens)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise ValueError(f"tile_blocks: {key} = {value!r} must be 0 (untiled) or a token count >= 1; "
                             f"resolve \"auto\" to a count first (TilingOptions.resolve or "
                             f"models.memory.tiling_options)")
    ffns = [m for m in model.modules() if isinstance(m, FeedForward)]
    blocks = [m for m in model.modules() if isinstance(m, TransformerBlock)]
    for module in ffns:
        module.tile_tokens = int(ffn_tokens)
    for module in blocks:
        module.tile_tokens = int(block_tokens)
    return len(ffns), len(blocks)


def model_tiles(model: nn.Module) -> TilingOptions:
    """The tiles `tile_blocks` set on `model` (0: untiled; the largest where they differ)."""
    ffns = [m.tile_tokens for m in model.modules() if isinstance(m, FeedForward)]
    blocks = [m.tile_tokens for m in model.modules() if isinstance(m, TransformerBlock)]
    return TilingOptions(max(ffns, default=0), max(blocks, default=0))


class OutputProjection(nn.Linear):
    """The vocabulary projection [V, H], an nn.Linear without bias: `output(h)` is `h @ W.T`; `output()` is
    W itself, as a view, for a loss that consumes the weight rather than logits (chunked cross-entropy,
    Ring-DTP). Calling the module instead of reading `.weight` lets module hooks see the use: FSDP2's head
    unit [norm, output] (torchtitan's grouping) runs its post-forward once both modules have run and
    registers its backward hooks on this output. A view, not the parameter, because a hook registered on
    a tensor stays there: on the parameter, one would be added every step."""

    def forward(self, x: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., H] -> [..., V] logits; no x -> the weight [V, H] (a view, same values)."""
        if x is None:
            return self.weight.view_as(self.weight)
        return super().forward(x)


class MoETransformer(KeepFp32Buffers):
    """The decoder family of `MoEModelArgs`; see the module docstring. RoPE's `rope_inv_freq`
    buffer stays fp32 under `.to(dtype)`."""

    fp32_buffers = ("rope_inv_freq",)

    def __init__(self, args: MoEModelArgs):
        super().__init__()
        args.validate()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.register_buffer("rope_inv_freq", rope_inv_freq(args.rope_dim, args.rope_theta), persistent=False)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = OutputProjection(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [B, S] int64; positions [S] int64 global RoPE positions of these tokens
        (default arange(S); a sequence shard passes its offset); doc_ids None (plain causal
        attention) or [B, S_full] int document ids of the WHOLE sequence, also when `tokens` is a
        sequence shard (see models/document_mask.py) -> hidden [B, S, H], normed."""
        B, S = tokens.shape
        if S > self.args.max_seq_len:
            raise ValueError(f"sequence length {S} exceeds max_seq_len={self.args.max_seq_len}; "
                             f"raise max_seq_len in the model args")
        if positions is None:
            positions = torch.arange(S, device=tokens.device)
        elif positions.shape != (S,):
            raise ValueError(f"positions must have shape [S]=({S},), got {tuple(positions.shape)}")
        if doc_ids is not None and (doc_ids.dim() != 2 or doc_ids.shape[0] != B or doc_ids.shape[1] < S):
            raise ValueError(f"doc_ids must be [B, S_full] with B = {B} and S_full >= S = {S} (tokens "
                             f"{tuple(tokens.shape)}), got {tuple(doc_ids.shape)}; pass the document ids "
                             f"of the whole sequence these tokens are part of")
        rope = rope_cos_sin(positions.to(self.rope_inv_freq.device), self.rope_inv_freq)  # [S, r/2, 2]
        h = self.tok_embeddings(tokens)                                                    # [B, S, H]
        for layer in self.layers.values():
            h = layer(h, rope, doc_ids)
        return self.norm(h)

    def moe_layers(self) -> list[MoE]:
        return [layer.moe for layer in self.layers.values() if hasattr(layer, "moe")]

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """Initialise every parameter and buffer in place (after `to_empty` from meta)."""
        for _, init in self.init_pieces(buffer_device):
            init()

    def init_pieces(self, buffer_device: torch.device | str | None = None):
        """`init_weights` as (module, its initialiser) in the order it runs, the random draws in that
        order: the token embedding, each block, the final norm, the projection (the RoPE buffer is
        set first). A caller may materialise each module just before its initialiser runs and move
        it off the device after (mop_train.train.build: the start-up's device bytes stay one piece's)."""
        buffer_device = buffer_device or self.rope_inv_freq.device
        self.rope_inv_freq = rope_inv_freq(self.args.rope_dim, self.args.rope_theta, device=buffer_device)
        yield self.tok_embeddings, lambda: nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            yield layer, layer.init_weights
        yield self.norm, self.norm.reset_parameters
        std = self.args.dim ** -0.5
        yield self.output, lambda: nn.init.trunc_normal_(self.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    @torch.no_grad()
    def update_router_biases(self, rate: float,
                             reduce_fn: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """Auxiliary-loss-free balancing step; call once after each optimizer step.

        Stacks every MoE layer's `tokens_per_expert` into loads [L_moe, E] (fp32), lets
        `reduce_fn(loads)` reduce it in place (e.g. an all-reduce over the ranks that saw other
        tokens), then per layer adds `rate * sign(mean(load) - load)` to the router bias and zeroes
        the counters. Returns the (reduced) loads, for logging.
        """
        moes = self.moe_layers()
        if not moes:
            return torch.zeros(0, 0)
        loads = torch.stack([moe.router.tokens_per_expert for moe in moes])  # [L_moe, E]
        if reduce_fn is not None:
            reduce_fn(loads)
        for moe, load in zip(moes, loads):
            moe.router.update_bias(load, rate)
            moe.router.tokens_per_expert.zero_()
        return loads

    def aux_loss(self) -> torch.Tensor:
        """Sum of the MoE layers' auxiliary losses of the last forward (a 0-dim fp32 tensor; zero
        when aux_loss_coef == 0). Backpropagates through plain or non-reentrant checkpointed
        blocks; a reentrant checkpoint runs its forward without autograd, which raises here."""
        moes = [moe for moe in self.moe_layers() if moe.last_aux_loss is not None]
        if not moes:
            return torch.zeros((), device=self.rope_inv_freq.device)
        if torch.is_grad_enabled():
            for moe in moes:
                if moe.router.gate.weight.requires_grad and not moe.last_aux_loss.requires_grad:
                    raise ValueError("aux_loss_coef > 0 but the last forward built no autograd graph for "
                                     "the aux loss (a reentrant activation checkpoint?); use "
                                     "non-reentrant checkpointing or set aux_loss_coef = 0")
        return torch.stack([moe.last_aux_loss for moe in moes]).sum()
