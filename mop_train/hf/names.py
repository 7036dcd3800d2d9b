"""Our MLA decoder's tensors <-> Hugging Face DeepseekV3 (safetensors names and config.json).

    check_exportable(args)              # ValueError naming the field where HF DeepseekV3 computes otherwise
    tensors = hf_tensors(args)          # every HF tensor: its HF name, our key, expert index, shape
    config = hf_config(args, ...)       # config.json of DeepseekV3ForCausalLM
    check_hf_config(config, args)       # an HF folder's config.json against the model a run trains

Names follow the published DeepSeek-V3 checkpoints, read off torchtitan 0.2.2's
`DeepSeekV3StateDictAdapter` (models/deepseek_v3/model/state_dict_adapter.py), the model for this
module; the code is our own. Our stacked experts `moe.experts.w1/w3/w2 [E, I, H] / [E, H, I]` are E
HF tensors `mlp.experts.{e}.gate_proj/up_proj/down_proj.weight` ([I, H] / [H, I]: the same
orientation, no transpose); our router bias `moe.router.expert_bias` is `e_score_correction_bias`.

Where HF DeepseekV3 (transformers 5) computes what our model computes, and where it does not:
- RoPE: ours rotates consecutive pairs (x0, x1), (x2, x3), ... of the rotated part, as DeepSeek's own
  code does; HF does the same with `rope_interleave = true` (its default), so no weight is permuted.
  An HF folder with `rope_interleave = false` (rotate-half layout) is refused on import.
- Norms: HF builds `q_a_layernorm` and `kv_a_layernorm` with eps 1e-6 whatever `rms_norm_eps` says
  (torchtitan's DeepSeek-V3 uses its norm_eps there, and its adapter does not check it): a model
  maps only with norm_eps = 1e-6.
- Router: HF scores with a sigmoid always (ours may be softmax: refused), adds the correction bias for
  selection only, renormalises when `norm_topk_prob` (our route_norm; it adds 1e-20 to the sum where
  we clamp at 1e-20: the same in fp32 for any sum above 1e-13) and scales by
  `routed_scaling_factor` (our route_scale). Group-limited routing is off: n_group = topk_group = 1
  (HF then takes each group's top 2, so E >= 2). An HF model with more groups is refused on import.
- Shared experts: HF always builds one SwiGLU of width n_shared_experts * moe_intermediate_size, ours
  too; with n_shared_experts = 0 ours has none and HF's would have width 0, which it cannot load:
  refused. Dense blocks: the first `first_k_dense_replace` = n_dense_layers, width
  `intermediate_size` = dense_ffn_dim. Embeddings untied. No YaRN (rope_scaling null), no MTP layers.
- Not in HF's forward: the auxiliary load-balancing loss (training only).

Legend: H hidden, V vocab, E experts, I expert width, k top-k, h heads, L blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mop_train.models.args import MoEModelArgs

HF_NORM_EPS = 1e-6
"""The eps HF DeepseekV3 gives q_a_layernorm / kv_a_layernorm (its DeepseekV3RMSNorm default)."""

FP32_KEPT = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")
"""HF tensors written in fp32 whatever the export dtype (transformers keeps them fp32:
DeepseekV3's `_keep_in_fp32_modules_strict`), so routing is decided on the trained values."""


@dataclass(frozen=True)
class HFTensor:
    """One tensor of the HF checkpoint: rows `expert` of our stacked `key` (None: all of `key`)."""

    name: str                  # HF name, e.g. "model.layers.1.mlp.experts.3.up_proj.weight"
    key: str                   # our state-dict key, e.g. "layers.1.moe.experts.w3"
    expert: int | None         # index into dim 0 of our stacked expert tensor, or None
    shape: tuple[int, ...]     # HF shape (ours without the expert dim)

    @property
    def keep_fp32(self) -> bool:
        return self.name.endswith(FP32_KEPT)


def check_exportable(args: MoEModelArgs) -> None:
    """Raise ValueError naming the first field whose value HF DeepseekV3 cannot reproduce."""
    if args.attention != "mla":
        raise ValueError(f"attention={args.attention!r}: only the MLA family maps to Hugging Face "
                         f"(DeepseekV3ForCausalLM); the GQA family has no HF export (README, 'Hugging Face')")
    if args.norm_eps != HF_NORM_EPS:
        raise ValueError(f"norm_eps={args.norm_eps}: HF DeepseekV3 builds q_a_layernorm and kv_a_layernorm "
                         f"with eps {HF_NORM_EPS} whatever rms_norm_eps says, so its MLA would differ; "
                         f"train with norm_eps = {HF_NORM_EPS}")
    if args.n_moe_layers > 0:
        if args.score_func != "sigmoid":
            raise ValueError(f"score_func={args.score_func!r}: HF DeepseekV3's router scores with a sigmoid "
                             f"only; use score_func = 'sigmoid'")
        if args.n_shared_experts < 1:
            raise ValueError(f"n_shared_experts={args.n_shared_experts}: HF DeepseekV3 always has a shared "
                             f"expert (width n_shared_experts * moe_inter_dim); use n_shared_experts >= 1")
        if args.num_experts < 2:
            raise ValueError(f"num_experts={args.num_experts}: HF DeepseekV3's router takes the top 2 scores "
                             f"of its expert group; use num_experts >= 2")


def _layer_tensors(args: MoEModelArgs, i: int) -> list[HFTensor]:
    H, h = args.dim, args.n_heads
    qk, nope, v, r = args.qk_head_dim, args.qk_nope_head_dim, args.v_head_dim, args.qk_rope_head_dim
    hf, ours = f"model.layers.{i}.", f"layers.{i}."
    out = [HFTensor(hf + "input_layernorm.weight", ours + "attention_norm.weight", None, (H,))]
    a, sa = ours + "attention.", hf + "self_attn."
    if args.q_lora_rank == 0:
        out.append(HFTensor(sa + "q_proj.weight", a + "wq.weight", None, (h * qk, H)))
    else:
        q = args.q_lora_rank
        out += [HFTensor(sa + "q_a_proj.weight", a + "wq_a.weight", None, (q, H)),
                HFTensor(sa + "q_a_layernorm.weight", a + "q_norm.weight", None, (q,)),
                HFTensor(sa + "q_b_proj.weight", a + "wq_b.weight", None, (h * qk, q))]
    kv = args.kv_lora_rank
    out += [HFTensor(sa + "kv_a_proj_with_mqa.weight", a + "wkv_a.weight", None, (kv + r, H)),
            HFTensor(sa + "kv_a_layernorm.weight", a + "kv_norm.weight", None, (kv,)),
            HFTensor(sa + "kv_b_proj.weight", a + "wkv_b.weight", None, (h * (nope + v), kv)),
            HFTensor(sa + "o_proj.weight", a + "wo.weight", None, (H, h * v)),
            HFTensor(hf + "post_attention_layernorm.weight", ours + "ffn_norm.weight", None, (H,))]
    mlp = hf + "mlp."
    if i < args.n_dense_layers:
        F, ff = args.dense_ffn_dim, ours + "feed_forward."
        return out + [HFTensor(mlp + "gate_proj.weight", ff + "w1.weight", None, (F, H)),
                      HFTensor(mlp + "up_proj.weight", ff + "w3.weight", None, (F, H)),
                      HFTensor(mlp + "down_proj.weight", ff + "w2.weight", None, (H, F))]
    E, I, moe = args.num_experts, args.moe_inter_dim, ours + "moe."
    out += [HFTensor(mlp + "gate.weight", moe + "router.gate.weight", None, (E, H)),
            HFTensor(mlp + "gate.e_score_correction_bias", moe + "router.expert_bias", None, (E,))]
    for e in range(E):
        ex = f"{mlp}experts.{e}."
        out += [HFTensor(ex + "gate_proj.weight", moe + "experts.w1", e, (I, H)),
                HFTensor(ex + "up_proj.weight", moe + "experts.w3", e, (I, H)),
                HFTensor(ex + "down_proj.weight", moe + "experts.w2", e, (H, I))]
    S, se = args.n_shared_experts * I, moe + "shared_expert."
    return out + [HFTensor(mlp + "shared_experts.gate_proj.weight", se + "w1.weight", None, (S, H)),
                  HFTensor(mlp + "shared_experts.up_proj.weight", se + "w3.weight", None, (S, H)),
                  HFTensor(mlp + "shared_experts.down_proj.weight", se + "w2.weight", None, (H, S))]


def hf_tensors(args: MoEModelArgs) -> list[HFTensor]:
    """Every tensor of the HF checkpoint, in model order (embeddings, blocks, final norm, lm_head)."""
    check_exportable(args)
    V, H = args.vocab_size, args.dim
    out = [HFTensor("model.embed_tokens.weight", "tok_embeddings.weight", None, (V, H))]
    for i in range(args.n_layers):
        out += _layer_tensors(args, i)
    return out + [HFTensor("model.norm.weight", "norm.weight", None, (H,)),
                  HFTensor("lm_head.weight", "output.weight", None, (V, H))]


def hf_config(args: MoEModelArgs, *, dtype: str, bos_token_id: int | None = None,
              eos_token_id: int | None = None) -> dict:
    """config.json of DeepseekV3ForCausalLM for `args` (`dtype`: "float32" / "bfloat16" / ...)."""
    check_exportable(args)
    E = args.num_experts if args.n_moe_layers > 0 else 2    # unused by HF when every block is dense
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "dtype": dtype,
        "vocab_size": args.vocab_size, "hidden_size": args.dim, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_heads,
        "q_lora_rank": args.q_lora_rank or None, "kv_lora_rank": args.kv_lora_rank,
        "qk_nope_head_dim": args.qk_nope_head_dim, "qk_rope_head_dim": args.qk_rope_head_dim,
        "v_head_dim": args.v_head_dim, "first_k_dense_replace": args.n_dense_layers,
        "intermediate_size": args.dense_ffn_dim, "moe_intermediate_size": args.moe_inter_dim,
        "n_routed_experts": E, "num_experts_per_tok": min(args.top_k, E),
        "n_shared_experts": max(args.n_shared_experts, 1), "n_group": 1, "topk_group": 1,
        "norm_topk_prob": args.route_norm, "routed_scaling_factor": args.route_scale,
        "scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1,
        "hidden_act": "silu", "rms_norm_eps": args.norm_eps, "rope_interleave": True,
        "rope_theta": args.rope_theta, "rope_scaling": None,
        "max_position_embeddings": args.max_seq_len, "tie_word_embeddings": False,
        "attention_bias": False, "attention_dropout": 0.0, "num_nextn_predict_layers": 0,
        "initializer_range": 0.02, "use_cache": True,
        "bos_token_id": bos_token_id, "eos_token_id": eos_token_id,
    }


def _rope_theta(config: dict) -> float | None:
    params = config.get("rope_parameters") or {}
    return config.get("rope_theta", params.get("rope_theta"))


def check_hf_config(config: dict, args: MoEModelArgs, *, source: str) -> None:
    """Raise ValueError naming the first config.json field of `source` that differs from what `args`
    (the model a run trains) needs, or that our model does not compute (groups, YaRN, ...)."""
    check_exportable(args)
    if config.get("model_type") != "deepseek_v3":
        raise ValueError(f"{source}: model_type = {config.get('model_type')!r}; mop_train imports "
                         f"DeepseekV3 checkpoints only (model_type 'deepseek_v3')")
    scaling = config.get("rope_scaling") or (config.get("rope_parameters") or {})
    if scaling.get("rope_type", scaling.get("type", "default")) != "default":
        raise ValueError(f"{source}: rope scaling {scaling.get('rope_type', scaling.get('type'))!r} is not "
                         f"modelled by mop_train's attention (no YaRN or other scaling); only plain RoPE imports")
    unsupported = {"rope_interleave": (True, "the rotate-half RoPE layout would need q/k rows permuted"),
                   "tie_word_embeddings": (False, "our embeddings and output projection are separate"),
                   "hidden_act": ("silu", "our FFNs are SwiGLU"),
                   "attention_bias": (False, "our projections have no bias"),
                   "scoring_func": ("sigmoid", "HF DeepseekV3 scores with a sigmoid")}
    for name, (want, why) in unsupported.items():
        if config.get(name, want) != want:
            raise ValueError(f"{source}: {name} = {config[name]!r} cannot be imported ({why}); need {want!r}")
    if args.n_moe_layers > 0:
        for name in ("n_group", "topk_group"):
            if config.get(name, 1) not in (1, None):
                raise ValueError(f"{source}: {name} = {config[name]}: group-limited routing is not modelled by "
                                 f"mop_train's router (it would route differently); need n_group = topk_group = 1")
    expected = hf_config(args, dtype="")
    fields = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
              "first_k_dense_replace", "rms_norm_eps"]
    if args.n_dense_layers:
        fields.append("intermediate_size")
    if args.n_moe_layers:
        fields += ["moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "n_shared_experts",
                   "norm_topk_prob", "routed_scaling_factor"]
    for name in fields:
        have, want = config.get(name), expected[name]
        if name == "num_key_value_heads" and have is None:    # HF DeepseekV3: None means one per head
            have = config.get("num_attention_heads")
        same = math.isclose(have, want, rel_tol=1e-9) if isinstance(want, float) and have is not None else have == want
        if not same:
            raise ValueError(f"{source}: {name} = {have!r} but the run's model needs {want!r}; pick the "
                             f"model.flavor that matches this checkpoint (`mop-train zoo`)")
    theta = _rope_theta(config)
    if theta is None or not math.isclose(float(theta), args.rope_theta, rel_tol=1e-9):
        raise ValueError(f"{source}: rope_theta = {theta!r} but the run's model needs {args.rope_theta!r}")
