"""torchtitan 0.2.2's own Trainer on its own DeepSeek-V3 model at one of our zoo's shapes, on our data.

    torchrun --standalone --nproc_per_node=2 -m benchmarks.titan_launch --model.flavor small \
        --training.seq_len 32768 --parallelism.context_parallel_degree 2 ...   # torchtitan's flags

This module registers two things and then calls torchtitan's `main` (CUDA only: torchtitan picks
its device type from the machine and builds NCCL groups):
- the train spec "deepseek_v3_mop": torchtitan's DeepSeek-V3 spec (model, parallelize_deepseekv3,
  optimizers, loss, its text dataloader) whose flavors are our zoo's MLA configs converted field by
  field (dims, MLA ranks, blocks, dense blocks, experts, top-k, shared experts, V), with plain RoPE
  (no YaRN rescaling, as ours) and SDPA causal attention (the only kind its context parallel takes),
  and whose tokenizer is ours (`[model] hf_assets_path = "embedded"` or a folder);
- the dataset "embedded" in torchtitan's DATASETS table: our embedded corpus.
`check_param_counts` builds both models on the meta device and compares their totals.

Metrics: torchtitan's MetricsProcessor hands one dict per logged step to its metric logger
(TensorBoard / W&B when enabled); the Trainer here also writes that dict, as is, to
<dump_folder>/metrics.jsonl on rank 0 (plus the world size). `throughput(tps)` there is per device:
rank tokens / (seconds x CP x TP x PP), so all ranks together process tps x world size tokens/s.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import operator
import os

import torch
import torch.distributed as dist
from torchtitan.hf_datasets import DatasetConfig
from torchtitan.hf_datasets.text_datasets import DATASETS
from torchtitan.models.deepseek_v3 import DeepSeekV3Model, DeepSeekV3ModelArgs
from torchtitan.models.moe import MoEArgs
from torchtitan.protocols import train_spec as train_spec_module
from torchtitan.train import Trainer, main as titan_main

from mop_train.models import zoo
from mop_train.train.data import EMBEDDED, build_tokenizer, default_cache_dir, load_documents

SPEC_NAME = "deepseek_v3_mop"
DATASET = EMBEDDED
METRICS_FILE = "metrics.jsonl"
NO_YARN = 1 << 40  # original_seq_len above any context: torchtitan applies YaRN only beyond it


def deepseek_v3_args(name: str) -> DeepSeekV3ModelArgs:
    """torchtitan's DeepSeek-V3 args with the shape of our zoo model `name` (MLA configs only)."""
    a = zoo.get_model_args(name)
    if a.attention != "mla":
        raise ValueError(f"zoo model {name!r} uses {a.attention} attention; torchtitan's DeepSeek-V3 "
                         f"is MLA only, pick one of {mla_names()}")
    return DeepSeekV3ModelArgs(
        vocab_size=a.vocab_size, dim=a.dim, inter_dim=a.dense_ffn_dim, moe_inter_dim=a.moe_inter_dim,
        n_layers=a.n_layers, n_dense_layers=a.n_dense_layers, n_heads=a.n_heads, norm_eps=a.norm_eps,
        moe_args=MoEArgs(num_experts=a.num_experts, num_shared_experts=a.n_shared_experts, top_k=a.top_k,
                         score_func=a.score_func, route_norm=a.route_norm, route_scale=a.route_scale,
                         score_before_experts=False),
        q_lora_rank=a.q_lora_rank, kv_lora_rank=a.kv_lora_rank, qk_nope_head_dim=a.qk_nope_head_dim,
        qk_rope_head_dim=a.qk_rope_head_dim, v_head_dim=a.v_head_dim, rope_theta=a.rope_theta,
        original_seq_len=NO_YARN, attn_type="sdpa", attn_mask_type="causal")


def mla_names() -> list[str]:
    return [n for n in zoo.names() if zoo.get_model_args(n).attention == "mla"]


def check_param_counts(name: str, *, tolerance: float = 0.01) -> dict[str, int]:
    """{"torchtitan": total, "mop_train": total} of both models built on meta; ValueError when they
    differ by more than `tolerance` (relative to ours)."""
    from torchtitan.config import JobConfig

    args = copy.deepcopy(deepseek_v3_args(name))
    args.update_from_config(JobConfig())  # sets the fields torchtitan fills in from the job config
    with torch.device("meta"):
        titan = sum(p.numel() for p in DeepSeekV3Model(args).parameters())
    ours = zoo.param_counts(name)["total"]
    if abs(titan - ours) > tolerance * ours:
        raise ValueError(f"torchtitan's DeepSeek-V3 at {name!r} has {titan:,} parameters, ours {ours:,}: "
                         f"{abs(titan - ours) / ours:.2%} apart (> {tolerance:.0%}); fix deepseek_v3_args")
    return {"torchtitan": titan, "mop_train": ours}


def build_embedded_tokenizer(job_config):
    """torchtitan's HuggingFaceTokenizer over our tokenizer files (`hf_assets_path` "embedded" or a folder)."""
    return build_tokenizer(job_config.model.hf_assets_path, cache_dir=default_cache_dir())


def _load_embedded(path: str):
    return load_documents(EMBEDDED, None, cache_dir=default_cache_dir())


def register() -> None:
    """Make the train spec SPEC_NAME and the dataset DATASET known to torchtitan (once per process)."""
    if SPEC_NAME not in train_spec_module._extra_train_specs:
        base = train_spec_module.get_train_spec("deepseek_v3")
        flavors = {n: deepseek_v3_args(n) for n in mla_names()}
        train_spec_module.register_train_spec(SPEC_NAME, dataclasses.replace(
            base, model_args=flavors, build_tokenizer_fn=build_embedded_tokenizer))
    DATASETS[DATASET] = DatasetConfig(path=EMBEDDED, loader=_load_embedded,
                                      sample_processor=operator.itemgetter("text"))


class _JsonlTee:
    """torchtitan's metric logger plus one JSON line per logged step."""

    def __init__(self, inner, path: str, world_size: int):
        self.inner, self.world_size = inner, world_size
        self.file = open(path, "a")

    def log(self, metrics: dict, step: int) -> None:
        self.inner.log(metrics, step)
        record = {"step": step, "world_size": self.world_size, **metrics}
        self.file.write(json.dumps(record, default=float) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.inner.close()
        self.file.close()


class MetricsTrainer(Trainer):
    """torchtitan's Trainer, unchanged, whose rank 0 also writes its metrics to metrics.jsonl."""

    def __init__(self, job_config):
        super().__init__(job_config)
        if dist.get_rank() == 0:
            path = os.path.join(job_config.job.dump_folder, METRICS_FILE)
            os.makedirs(job_config.job.dump_folder, exist_ok=True)
            self.metrics_processor.logger = _JsonlTee(self.metrics_processor.logger, path,
                                                      dist.get_world_size())


def main() -> None:
    register()
    titan_main(MetricsTrainer)


if __name__ == "__main__":
    main()
