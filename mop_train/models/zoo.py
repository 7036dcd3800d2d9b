"""Named model configs, their exact parameter counts, and a builder.

Configs (DESIGN.md "Model zoo"):
- debug: tiny MLA model (one dense block + MoE blocks), trains on CPU in seconds; V=2048 matches
  the training loop's BPE tokenizer; I=32 keeps torch._grouped_mm's 16-byte row alignment in fp32;
  norm_eps 1e-6 as DeepSeek-V3's (HF's latent norms use no other), so it exports (mop_train.hf).
- small: ~3.3B MLA model for one H200 with all four operators on.
- gpt-oss-20b-shape: gpt-oss-20b's dimensions (GQA 64/8 heads of width 64, 24 blocks, H=2880,
  32 experts of I=2880, top-4, V=201088); no biases or attention sinks.
- mop-37b / mop-120b / mop-241b / mop-667b: the paper's width (H=7168, 384 experts of I=2048,
  top-8, V=200000; dense-FFN width 18432 if a dense block is configured) at 2 / 7 / 14 / 39
  blocks, with Kimi-K2's MLA (64 heads, q_lora_rank 1536, kv_lora_rank 512, qk 128+64, v 128)
  and sigmoid routing. Chosen so the totals land near the nominal sizes: ONE shared expert
  (I=2048) per block and NO dense blocks (a dense block in place of a MoE block loses ~16.5B).
  Totals: 36.99B, 122.3B (+1.9%), 241.7B (+0.3%), 668.2B (+0.2%).

Counts are exact, read off a meta-device model: `total` is every parameter, embeddings
(tok_embeddings and the output projection, untied) included; `active` is what one token touches:
all non-routed-expert parameters (embeddings, attention, norms, routers, dense and shared FFNs)
plus top_k / E of each MoE block's routed-expert weights.

Legend: H hidden, V vocab, E experts, I expert width, k top-k.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from mop_train.models.args import MoEModelArgs
from mop_train.models.model import MoETransformer

HOST_INIT_MAX_PARAMS = 2_000_000_000
"""Models up to this size are initialised whole (on the host, then moved to the device and sharded),
so every layout starts from the same weights; larger ones are initialised shard by shard on the
device (mop_train.train.build.build_model; the memory plan's "start-up" line counts either)."""

_MLA_KIMI = dict(attention="mla", n_heads=64, q_lora_rank=1536, kv_lora_rank=512,
                 qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
_PAPER = dict(dim=7168, vocab_size=200_000, n_dense_layers=0, dense_ffn_dim=18432, num_experts=384,
              top_k=8, moe_inter_dim=2048, n_shared_experts=1, score_func="sigmoid", route_norm=True,
              route_scale=2.827, rope_theta=50000.0, max_seq_len=1 << 20, norm_eps=1e-6, **_MLA_KIMI)

_CONFIGS: dict[str, MoEModelArgs] = {
    "debug": MoEModelArgs(
        dim=64, n_layers=3, attention="mla", n_heads=4, q_lora_rank=0, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, vocab_size=2048,
        n_dense_layers=1, dense_ffn_dim=192, num_experts=8, top_k=2, moe_inter_dim=32,
        n_shared_experts=1, score_func="sigmoid", route_norm=True, route_scale=1.0,
        rope_theta=10000.0, max_seq_len=1 << 17, norm_eps=1e-6),
    "small": MoEModelArgs(
        dim=1536, n_layers=12, attention="mla", n_heads=16, q_lora_rank=768, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, vocab_size=200_000,
        n_dense_layers=1, dense_ffn_dim=6144, num_experts=64, top_k=6, moe_inter_dim=768,
        n_shared_experts=1, score_func="sigmoid", route_norm=True, route_scale=1.0,
        rope_theta=50000.0, max_seq_len=1 << 20, norm_eps=1e-6),
    "gpt-oss-20b-shape": MoEModelArgs(
        dim=2880, n_layers=24, attention="gqa", n_heads=64, n_kv_heads=8, head_dim=64,
        vocab_size=201_088, n_dense_layers=0, num_experts=32, top_k=4, moe_inter_dim=2880,
        n_shared_experts=0, score_func="softmax", route_norm=True, route_scale=1.0,
        rope_theta=150000.0, max_seq_len=1 << 20, norm_eps=1e-5),
    "mop-37b": MoEModelArgs(n_layers=2, **_PAPER),
    "mop-120b": MoEModelArgs(n_layers=7, **_PAPER),
    "mop-241b": MoEModelArgs(n_layers=14, **_PAPER),
    "mop-667b": MoEModelArgs(n_layers=39, **_PAPER),
}

NOMINAL_SIZES = {"mop-37b": 37e9, "mop-120b": 120e9, "mop-241b": 241e9, "mop-667b": 667e9}
"""Sizes the paper names its models by; `total` lands within 3% of each."""


def names() -> list[str]:
    """Config names, smallest first."""
    return list(_CONFIGS)


def get_model_args(name: str) -> MoEModelArgs:
    """A fresh copy of the named config's args (safe to modify)."""
    if name not in _CONFIGS:
        raise ValueError(f"unknown model {name!r}; choose one of {names()}")
    return replace(_CONFIGS[name])


def _as_args(name_or_args: str | MoEModelArgs) -> MoEModelArgs:
    return get_model_args(name_or_args) if isinstance(name_or_args, str) else name_or_args


def build_model(name_or_args: str | MoEModelArgs, device: torch.device | str = "cpu",
                dtype: torch.dtype | None = None) -> MoETransformer:
    """Build on meta, then (unless device is "meta") materialise on `device` and initialise
    with the current torch RNG (seed it for reproducible weights). `dtype` casts parameters;
    the router's balancing buffers stay fp32."""
    with torch.device("meta"):
        model = MoETransformer(_as_args(name_or_args))
    if torch.device(device).type == "meta":
        return model
    model.to_empty(device=device)
    model.init_weights(buffer_device=device)
    if dtype is not None:
        model.to(dtype=dtype)
    return model


def param_counts(name_or_args: str | MoEModelArgs) -> dict[str, int]:
    """{"total": all parameters, "active": parameters one token touches}; see module docstring."""
    args = _as_args(name_or_args)
    model = build_model(args, device="meta")
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for moe in model.moe_layers() for p in moe.experts.parameters())
    # Each block's routed weights split evenly over E experts, of which k fire per token.
    active = total - routed + routed * args.top_k // args.num_experts if routed else total
    return {"total": total, "active": active}


def _billions(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def format_table() -> str:
    """One row per config: name, layers, hidden, experts, top-k, vocab, total, active."""
    header = ("name", "layers", "hidden", "experts", "top-k", "vocab", "total", "active")
    rows = [header]
    for name in names():
        a, counts = _CONFIGS[name], param_counts(name)
        rows.append((name, str(a.n_layers), str(a.dim), str(a.num_experts), str(a.top_k),
                     str(a.vocab_size), _billions(counts["total"]), _billions(counts["active"])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
