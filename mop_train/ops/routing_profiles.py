"""Synthetic routing profiles of the paper's Appendix B.2, for dispatch tests and benchmarks.

A profile "r/h" makes experts 0..h-1 hot: the first floor(r% * N) token positions pick experts
{j mod h : j < k} (so with h < k a hot token repeats experts), and every other token i picks the
cold experts {h + ((i + j) mod (E - h)) : j < k}, walking the cold set evenly. "balanced" gives
token i the experts {(i + j) mod E : j < k}. Every routing weight is 1/k.

Legend: N tokens, E experts, k top-k, r hot-token percentage, h hot experts.
"""

from __future__ import annotations

import torch

PROFILES = ("balanced", "30/16", "50/16", "80/16", "95/16", "30/4", "50/4")


def routing_profile(name: str, num_tokens: int, num_experts: int, top_k: int, *, device=None,
                    dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (indices [N, k] int64, weights [N, k] = 1/k) for profile `name` ("balanced" or "r/h")."""
    N, E, k = num_tokens, num_experts, top_k
    i = torch.arange(N, device=device).unsqueeze(1)                  # [N, 1]
    j = torch.arange(k, device=device).unsqueeze(0)                  # [1, k]
    weights = torch.full((N, k), 1.0 / k, dtype=dtype, device=device)
    if name == "balanced":
        return (i + j) % E, weights
    try:
        pct, hot = (int(part) for part in name.split("/"))
    except ValueError:
        raise ValueError(f"routing profile {name!r}: expected 'balanced' or 'r/h' with integer hot-token "
                         f"percentage r and hot-expert count h, e.g. one of {PROFILES}") from None
    if not 0 <= pct <= 100 or not 1 <= hot < E:
        raise ValueError(f"routing profile {name!r} with {E} experts: need 0 <= r <= 100 and "
                         f"1 <= h < {E}")
    num_hot = pct * N // 100                                         # floor(r * N) exactly
    hot_ids = (j % hot).expand(N, k)                                 # [N, k]
    cold_ids = hot + (i + j) % (E - hot)                             # [N, k]
    return torch.where(i < num_hot, hot_ids, cold_ids), weights
