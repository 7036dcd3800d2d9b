"""Feed-forward blocks of the decoder: a dense SwiGLU FFN and the routed MoE layer.

The MoE flattens [B, S, H] to x [N, H], routes it (`router`, or a forced routing set by a test or
benchmark), and hands (x, indices, weights, w1, w2, w3) to the expert-dispatch seam
`mop_train.ops.moe_dispatch.moe_experts_forward`; the always-on shared expert is added after.
How routes reach experts (`dispatch`: None for every expert here, or an `ExpertDispatch` binding a
schedule's options, the expert group and its stats) is set from outside by the parallelization
code, which also swaps `experts.w*` for this rank's shard: the model itself never communicates.
Expert weights use torchtitan's layout w1/w3 [E, I, H], w2 [E, H, I].

Legend: B batch, S sequence, N = B*S tokens, H hidden, E experts, I expert width, k top-k.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from mop_train.models.args import MoEModelArgs
from mop_train.models.router import TopKRouter
from mop_train.ops.moe_dispatch import ExpertDispatch, moe_experts_forward
from mop_train.ops.tiling import tiled_swiglu


def _trunc_normal(weight: torch.Tensor, std: float) -> None:
    nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-3 * std, b=3 * std)


def _local_weight(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    w = w.to_local() if isinstance(w, DTensor) else w
    return w if w.dtype == dtype else w.to(dtype)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x), w1/w3 nn.Linear(H, F), w2 nn.Linear(F, H).

    `tile_tokens` (set from outside, `models.model.tile_blocks`): 0 runs it whole; T > 0 runs it over
    tiles of T tokens once x holds more (ops.tiling.tiled_swiglu: same values, one tile's F-wide
    intermediates alive at a time)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.tile_tokens = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tile = self.tile_tokens
        if tile and x.numel() > tile * x.shape[-1]:
            return tiled_swiglu(x, self.w1.weight, self.w2.weight, self.w3.weight, tile)
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, init_std: float) -> None:
        _trunc_normal(self.w1.weight, 0.02)
        _trunc_normal(self.w2.weight, init_std)
        _trunc_normal(self.w3.weight, init_std)


class GroupedExperts(nn.Module):
    """E routed SwiGLU experts as stacked weights w1 [E, I, H], w2 [E, H, I], w3 [E, I, H].

    Its forward is the one call site of the dispatch seam, so a per-module FSDP wrap of the
    experts unshards exactly these weights around it.
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        # Set from outside (OffloadStreamAdamW's weights = "bf16" / "stream"): (param, dtype) -> the
        # compute weight of a shard kept out of FSDP2, or None to cast the parameter itself.
        self.weight_source = None
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))

    def forward(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                dispatch: ExpertDispatch | None = None) -> torch.Tensor:
        """x [N, H], indices/weights [N, k] -> [N, H] = sum_j weights[:, j] * expert_{indices[:, j]}(x).

        `dispatch`: None runs every expert here ("local"); an ExpertDispatch runs its schedule over
        its expert group. Expert-parallel code makes w* DTensors sharded over the expert group (kept
        out of FSDP): the seam gets this rank's shard, cast to the activation dtype (FSDP's mixed
        precision does not cast weights it does not manage).
        """
        w1, w2, w3 = (self._weight(w, x.dtype) for w in (self.w1, self.w2, self.w3))
        if dispatch is None:
            return moe_experts_forward(x, indices, weights, w1, w2, w3)
        return dispatch(x, indices, weights, w1, w2, w3)

    def _weight(self, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        source = self.weight_source
        working = source(w, dtype) if source is not None else None
        return working if working is not None else _local_weight(w, dtype)

    def init_weights(self, init_std: float) -> None:
        _trunc_normal(self.w1, 0.02)
        _trunc_normal(self.w2, init_std)
        _trunc_normal(self.w3, init_std)


Routing = tuple[torch.Tensor, torch.Tensor]


def _in_backward() -> bool:
    # True while autograd runs a backward pass (where checkpoints recompute); FSDP2 uses the same test.
    return torch._C._current_graph_task_id() != -1


class MoE(nn.Module):
    """Routed experts (+ optional shared expert) on [B, S, H] -> [B, S, H].

    Plain attributes set from outside:
        dispatch: None (every expert on this rank) or the ExpertDispatch the experts run through;
            its `stats` hold the figures of the last forward.
        forced_routing: None, a pair (indices [N, k] int64, weights [N, k]) or a callable
            x [N, H] -> such a pair; replaces the router (whose gate then gets no gradient).
    After a forward with aux_loss_coef > 0, `last_aux_loss` holds this layer's auxiliary loss.
    """

    def __init__(self, args: MoEModelArgs):
        super().__init__()
        self.aux_loss_coef = args.aux_loss_coef
        self.router = TopKRouter(args.dim, args.num_experts, args.top_k, args.score_func,
                                 args.route_norm, args.route_scale)
        self.experts = GroupedExperts(args.dim, args.moe_inter_dim, args.num_experts)
        self.shared_expert = (FeedForward(args.dim, args.n_shared_experts * args.moe_inter_dim)
                              if args.n_shared_experts > 0 else None)
        self.dispatch: ExpertDispatch | None = None
        self.forced_routing: Routing | Callable[[torch.Tensor], Routing] | None = None
        self.last_aux_loss: torch.Tensor | None = None

    def _forced(self, x: torch.Tensor) -> Routing:
        forced = self.forced_routing
        indices, weights = forced(x) if callable(forced) else forced
        N, E = x.shape[0], self.router.num_experts
        if indices.dim() != 2 or indices.shape[0] != N or weights.shape != indices.shape:
            raise ValueError(f"forced_routing must be (indices [N, k], weights [N, k]) with N={N}; "
                             f"got indices {tuple(indices.shape)}, weights {tuple(weights.shape)}")
        if indices.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"forced_routing indices must be int32/int64, got {indices.dtype}")
        if indices.numel() and not (0 <= int(indices.min()) and int(indices.max()) < E):
            raise ValueError(f"forced_routing indices must lie in [0, {E}); got "
                             f"[{int(indices.min())}, {int(indices.max())}]")
        return indices.to(device=x.device, dtype=torch.int64), weights.to(x.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, H = x.shape
        x = x.reshape(B * S, H)                                       # [N, H]
        # An activation-checkpoint recompute runs inside backward: it must not count the same
        # routes twice nor replace the aux loss that the training loss already holds.
        first_pass = not _in_backward()
        if self.forced_routing is not None:
            indices, weights = self._forced(x)
            aux = None
        else:
            indices, weights, scores = self.router(x)                 # [N, k], [N, k], [N, E]
            aux = (self.router.aux_loss(scores, indices, self.aux_loss_coef)
                   if self.aux_loss_coef > 0 else None)
        if first_pass:
            self.last_aux_loss = aux
            self.router.record_load(indices)
        y = self.experts(x, indices, weights, self.dispatch)         # [N, H]
        if self.shared_expert is not None:
            y = y + self.shared_expert(x)
        return y.reshape(B, S, H)

    def init_weights(self, init_std: float) -> None:
        self.router.init_weights(init_std)
        self.experts.init_weights(init_std)
        if self.shared_expert is not None:
            self.shared_expert.init_weights(init_std)
