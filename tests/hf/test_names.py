"""names.py: every tensor of our MLA models has exactly one HF name; unmappable configs are refused by name."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mop_train.hf.export import check_mapping
from mop_train.hf.names import check_exportable, check_hf_config, hf_config, hf_tensors
from mop_train.models import zoo
from tests.hf.checkpoints import debug_args


@pytest.mark.parametrize("flavor", ["debug", "small", "mop-37b"])
def test_every_tensor_has_one_hf_name(flavor):
    args = zoo.get_model_args(flavor)
    tensors = hf_tensors(args)
    check_mapping(args, tensors)                     # our state dict, exactly, with the HF shapes
    names = [t.name for t in tensors]
    assert len(names) == len(set(names))
    experts = [t for t in tensors if ".mlp.experts." in t.name]
    assert len(experts) == 3 * args.num_experts * args.n_moe_layers
    q = "q_proj" if args.q_lora_rank == 0 else "q_b_proj"
    assert sum(f"self_attn.{q}.weight" in n for n in names) == args.n_layers
    assert sum(n.endswith("mlp.gate_proj.weight") for n in names) == args.n_dense_layers


def test_q_lora_variant_maps():
    args = debug_args(q_lora_rank=16)
    check_mapping(args, hf_tensors(args))


@pytest.mark.parametrize("change, needle", [
    (dict(attention="gqa"), "attention='gqa'"),
    (dict(norm_eps=1e-5), "norm_eps=1e-05"),
    (dict(score_func="softmax"), "score_func='softmax'"),
    (dict(n_shared_experts=0), "n_shared_experts=0"),
    (dict(num_experts=1, top_k=1), "num_experts=1"),
])
def test_unmappable_configs_are_refused_by_name(change, needle):
    with pytest.raises(ValueError, match="HF|Hugging Face") as err:
        check_exportable(debug_args(**change))
    assert needle in str(err.value)


def test_the_gqa_zoo_model_has_no_export():
    with pytest.raises(ValueError, match="GQA family has no HF export"):
        hf_tensors(zoo.get_model_args("gpt-oss-20b-shape"))


@pytest.mark.parametrize("change, needle", [
    ({"n_group": 8, "topk_group": 4}, "n_group = 8"),
    ({"rope_scaling": {"type": "yarn", "factor": 40}}, "YaRN"),
    ({"rope_interleave": False}, "rope_interleave = False"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings"),
    ({"hidden_size": 128}, "hidden_size = 128"),
    ({"n_routed_experts": 16}, "n_routed_experts = 16"),
    ({"rms_norm_eps": 1e-5}, "rms_norm_eps"),
    ({"rope_theta": 50000.0}, "rope_theta = 50000.0"),
    ({"model_type": "qwen3_moe"}, "model_type"),
])
def test_an_hf_config_that_differs_is_refused_by_field(change, needle):
    args = debug_args()
    config = hf_config(args, dtype="float32")
    check_hf_config(config, args, source="x/config.json")
    with pytest.raises(ValueError, match="x/config.json") as err:
        check_hf_config({**config, **change}, args, source="x/config.json")
    assert needle in str(err.value)


def test_transformers_5_rope_parameters_are_read():
    args = debug_args()
    config = hf_config(args, dtype="float32")
    del config["rope_theta"], config["rope_scaling"]
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": args.rope_theta}
    check_hf_config(config, args, source="c")
    config["rope_parameters"]["rope_theta"] = 1.0
    with pytest.raises(ValueError, match="rope_theta"):
        check_hf_config(config, replace(args), source="c")
