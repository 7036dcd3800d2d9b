"""Top-k MoE router with DeepSeek-V3's auxiliary-loss-free load balancing.

    scores  = score_func(x @ gate^T)                   # [N, E] fp32, softmax or sigmoid
    indices = topk(scores + expert_bias, k)            # the bias steers *selection* only
    weights = scores[indices] (/ their sum if route_norm) * route_scale   # unbiased gate weights

Each forward adds the selected experts' counts to `tokens_per_expert`; after the optimizer step
the training loop calls `MoETransformer.update_router_biases`, which moves every bias by
`rate * sign(mean_load - load)` and zeroes the counters (the MoE layer skips counting while an
activation checkpoint recomputes it, so each route counts once). The optional auxiliary loss is
the Switch/DeepSeek batch form `coef * E * sum_e f_e * P_e` (f_e share of routes, P_e mean
normalised score).

Legend: N tokens, H hidden, E experts, k top-k.
"""

from __future__ import annotations

import torch
from torch import nn

from mop_train.models.fp32_buffers import KeepFp32Buffers
from mop_train.ops.moe_dispatch.local import route_counts


class TopKRouter(KeepFp32Buffers):
    """Gate `nn.Linear(H, E)`; fp32 buffers `expert_bias [E]` (persistent, in the state dict) and
    `tokens_per_expert [E]` (non-persistent load counters). Both stay fp32 under `.to(dtype)`."""

    fp32_buffers = ("expert_bias", "tokens_per_expert")

    def __init__(self, dim: int, num_experts: int, top_k: int, score_func: str = "sigmoid",
                 route_norm: bool = True, route_scale: float = 1.0):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.score_func, self.route_norm, self.route_scale = score_func, route_norm, route_scale
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32), persistent=True)
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts, dtype=torch.float32),
                             persistent=False)

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, H] -> [N, E] fp32 routing scores (no bias)."""
        logits = self.gate(x).float()                               # [N, E]
        if self.score_func == "softmax":
            return logits.softmax(dim=-1)
        return logits.sigmoid()

    def select(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """scores [N, E] -> indices [N, k] int64 (chosen with the bias), weights [N, k] fp32
        (from the unbiased scores)."""
        _, indices = torch.topk(scores + self.expert_bias, self.top_k, dim=-1)  # [N, k]
        weights = scores.gather(1, indices)                                      # [N, k]
        if self.route_norm:
            weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(1e-20)
        return indices, weights * self.route_scale

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, H] -> (indices [N, k], weights [N, k] fp32, scores [N, E] fp32)."""
        scores = self.scores(x)
        indices, weights = self.select(scores)
        return indices, weights, scores

    @torch.no_grad()
    def record_load(self, indices: torch.Tensor) -> None:
        """Add the per-expert route counts of indices [N, k] to `tokens_per_expert`."""
        counts = route_counts(indices, self.num_experts)
        self.tokens_per_expert.add_(counts.to(self.tokens_per_expert.dtype))

    def aux_loss(self, scores: torch.Tensor, indices: torch.Tensor, coef: float) -> torch.Tensor:
        """coef * E * sum_e f_e * P_e for scores [N, E], indices [N, k]; equals coef when the
        routes and the normalised scores are both uniform. Differentiable through P only."""
        N = scores.shape[0]
        if N == 0:
            return scores.sum() * 0.0
        probs = scores / scores.sum(dim=-1, keepdim=True).clamp_min(1e-20)      # [N, E]
        counts = route_counts(indices, self.num_experts)
        route_share = counts.to(probs.dtype) / (N * indices.shape[1])           # [E]
        return coef * self.num_experts * (route_share * probs.mean(dim=0)).sum()

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor, rate: float) -> None:
        """bias += rate * sign(mean(load) - load) for load [E]; underloaded experts gain."""
        load = load.to(self.expert_bias.dtype)
        self.expert_bias.add_(rate * torch.sign(load.mean() - load))

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.gate.weight, mean=0.0, std=init_std, a=-3 * init_std, b=3 * init_std)
        with torch.no_grad():
            self.expert_bias.zero_()
            self.tokens_per_expert.zero_()
