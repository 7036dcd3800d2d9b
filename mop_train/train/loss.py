"""Output projection + cross-entropy, summed over tokens, without ever holding all N x V logits.

    loss_sum = chunked_cross_entropy_sum(hidden, weight, targets)   # fp32 scalar
    loss = loss_sum / global_valid_tokens                           # the loop divides (torchtitan style)

Algorithm: the N tokens are cut into chunks of `chunk_size`; each chunk's logits [n, V] are made
in fp32, reduced to a summed cross-entropy, and dropped. Each chunk runs under a non-reentrant
activation checkpoint, so backward recomputes one chunk's logits at a time: the live set is one
[chunk_size, V] block, not [N, V]. The value is the same sum as the unchunked loss up to fp32
summation order. Tokens whose target is `ignore_index` contribute nothing.

This is the vocab_degree = 1 path. With P > 1 (or [mop.ring_dtp] enable) the lead swaps in
`mop_train.ops.ring_dtp.ring_dtp_cross_entropy(hidden, weight_shard, targets, group, vocab_size=V,
reduction="sum")`, which has the same contract: hidden and a projection shard in, a token sum out.

Legend: N tokens, H hidden, V vocab.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100
CHUNK_SIZE = 1024
"""Default tokens per loss chunk: the live logits are [CHUNK_SIZE, V] fp32."""


def _chunk_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                    ignore_index: int) -> torch.Tensor:
    logits = (hidden @ weight.t()).float()  # [n, V]
    return F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="sum")


def chunked_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                              chunk_size: int = CHUNK_SIZE, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Sum over tokens of cross_entropy(hidden @ weight.T, targets), in fp32.

    Args:
        hidden: [N, H] final hidden states (after the final norm).
        weight: [V, H] output projection.
        targets: [N] int64 target ids; `ignore_index` marks tokens without a target.
        chunk_size: tokens per chunk (bounds the live logits to [chunk_size, V]).
    Returns:
        fp32 scalar: the summed token losses.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} must be [N, H] and [V, H]")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets {tuple(targets.shape)} must be [N] with N = {hidden.shape[0]}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size = {chunk_size} must be >= 1")
    total = (hidden[:0].sum() + weight[:0].sum()).float()  # exact 0, connected to both inputs (N may be 0)
    for start in range(0, hidden.shape[0], chunk_size):
        h, t = hidden[start:start + chunk_size], targets[start:start + chunk_size]  # [n, H], [n]
        if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
            total = total + checkpoint(_chunk_loss_sum, h, weight, t, ignore_index, use_reentrant=False)
        else:
            total = total + _chunk_loss_sum(h, weight, t, ignore_index)
    return total


class LanguageModelLoss(torch.nn.Module):
    """`model` plus the loss: forward(tokens [B, S], labels [B, S]) -> summed token loss (fp32).

    It is the FSDP root. The output projection `model.output.weight` [V, H] is read by calling
    `model.output()` after the final norm: FSDP2's head unit [norm, output] gathers it in the norm's
    pre-forward and reduces its gradient as soon as the loss's and the norm's backward have run.
    `loss_fn(hidden [N, H], weight [V, H], targets [N]) -> fp32 sum` is the swap point for
    Ring-DTP (e.g. `functools.partial(ring_dtp_cross_entropy, group=..., vocab_size=V, reduction="sum")`).
    """

    def __init__(self, model: torch.nn.Module, loss_fn=chunked_cross_entropy_sum):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        # Set from outside (OffloadStreamAdamW's weights = "bf16" / "stream"): (param, dtype) -> the
        # compute weight of the vocab shard kept out of FSDP2, or None to pass the parameter itself.
        self.weight_source = None

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor,
                positions: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """doc_ids: None or [B, S_full] document ids of the whole sequence (the model's argument)."""
        hidden = self.model(tokens, positions, doc_ids)                        # [B, S, H]
        param = self.model.output.weight                                       # [V, H] or its shard
        working = self.weight_source(param, param.dtype) if self.weight_source is not None else None
        weight = self.model.output() if working is None else working            # the call: FSDP2's head unit sees it
        return self.loss_fn(hidden.flatten(0, 1), weight, labels.flatten())
