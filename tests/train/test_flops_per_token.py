"""metrics.flops_per_token, the one FLOP count of the torchtitan comparison's table, against torch's
FLOP counter over a real forward of random small models (MLA and GQA, dense and MoE blocks) at two
sequence lengths: the counter sees every matmul (the experts' grouped GEMMs counted as 2 x rows x in
x out, CPU flash attention as its two matmuls) and full, non-causal attention; the convention counts 3x the forward, every weight that
multiplies (not the input embedding, not the norms' gains), and attention at the causal half."""

import random

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from mop_train.models import zoo
from mop_train.models.args import MoEModelArgs
from mop_train.train.metrics import flops_per_token
from tests.utils import fresh_seed


def _grouped_mm_flops(x_shape, w_shape, *args, out_shape=None, **kwargs) -> int:
    rows, inner = x_shape[-2], x_shape[-1]
    return 2 * rows * inner * w_shape[-1]  # x [R, A] @ w[e] [A, B] per row block


def _cpu_flash_flops(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    b, h, s_q, d_qk = q_shape
    return 2 * b * h * s_q * k_shape[-2] * (d_qk + v_shape[-1])  # q k^T and p v, every key (no causal half)


COUNTED = {torch.ops.aten._grouped_mm: _grouped_mm_flops,  # torch's counter knows neither
           torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_flops}


def random_args(rng: random.Random, attention: str) -> MoEModelArgs:
    heads = rng.choice([2, 3, 4])
    common = dict(dim=rng.choice([32, 48, 64]), n_layers=rng.choice([2, 3]), n_heads=heads, attention=attention,
                  vocab_size=rng.choice([257, 512, 1000]), n_dense_layers=1, dense_ffn_dim=rng.choice([40, 96]),
                  num_experts=rng.choice([4, 6, 8]), top_k=2, moe_inter_dim=rng.choice([16, 24]),
                  n_shared_experts=rng.choice([0, 1]), max_seq_len=4096)
    if attention == "mla":
        return MoEModelArgs(**common, kv_lora_rank=rng.choice([16, 32]), qk_nope_head_dim=rng.choice([8, 16]),
                            qk_rope_head_dim=rng.choice([4, 8]), v_head_dim=rng.choice([8, 12, 16]))
    return MoEModelArgs(**common, n_kv_heads=1, head_dim=rng.choice([8, 16]))


def counted_forward_flops(model, batch: int, seq_len: int, vocab: int) -> int:
    tokens = torch.randint(0, vocab, (batch, seq_len))
    with torch.no_grad(), FlopCounterMode(display=False,
                                          custom_mapping=COUNTED) as counter:
        model.output(model(tokens))
    return counter.get_total_flops()


@pytest.mark.parametrize("attention", ["mla", "gqa"])
def test_flops_per_token_matches_a_counted_forward(attention):
    seed = fresh_seed()
    rng = random.Random(seed)
    torch.manual_seed(seed)
    args = random_args(rng, attention)
    model = zoo.build_model(args)
    active = zoo.param_counts(args)["active"]
    gains = sum(p.numel() for m in model.modules() if isinstance(m, nn.RMSNorm) for p in m.parameters())
    d_v = args.v_head_dim if attention == "mla" else args.head_dim
    for seq_len in rng.sample([16, 40, 96, 128], 2):
        batch = rng.choice([1, 2, 3])
        n = batch * seq_len
        forward = counted_forward_flops(model, batch, seq_len, args.vocab_size)
        full_attention = 3 * args.n_layers * args.n_heads * (args.qk_head_dim + d_v) * seq_len
        # 3 x the counted forward, per token, with the norms' gains added back and attention halved.
        expected = 3 * forward / n + 6 * gains - full_attention
        got = flops_per_token(args, seq_len, active_params=active)
        print(f"seed {seed} {attention} S={seq_len} B={batch}: counted {expected:,.0f} formula {got:,.0f}")
        assert got == pytest.approx(expected, rel=1e-12), (args, seq_len)


def test_small_counts_what_torchtitan_counts_less_the_causal_half():
    """At `small`'s shape the parameter term equals torchtitan's (models/utils.py's
    get_moe_model_nparams_and_flops on its DeepSeek-V3 at the same shape); its attention term is twice ours."""
    import copy

    from torchtitan.config import JobConfig
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model

    from benchmarks.titan_launch import deepseek_v3_args

    seq_len = 32768
    titan_args = copy.deepcopy(deepseek_v3_args("small"))
    titan_args.update_from_config(JobConfig())
    with torch.device("meta"):
        _, titan = titan_args.get_nparams_and_flops(DeepSeekV3Model(titan_args), seq_len)
    a = zoo.get_model_args("small")
    ours = flops_per_token(a, seq_len, active_params=zoo.param_counts("small")["active"])
    half = 3 * a.n_layers * a.n_heads * (a.qk_head_dim + a.v_head_dim) * seq_len
    assert titan - ours == half, f"torchtitan {titan:,} ours {ours:,}"
