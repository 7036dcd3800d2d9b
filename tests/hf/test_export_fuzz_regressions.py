"""Regressions found by an adversarial probe of the HF export (fresh seeds, CPU, fp32).

- An export that fails must fail before it writes anything, so the corrected command can run into the
  same --out: a tokenizer folder without tokenizer.json, and a checkpoint missing one of its .distcp
  files (`--no-verify`), were found out only after the safetensors were written (the rerun was then
  refused as "not empty"), the latter as a bare FileNotFoundError; an --out that is a file was a bare
  FileExistsError.
- The logits test with the zoo's init cannot see a norm mapped to the wrong HF name (every norm weight
  is 1 there): here every norm weight is drawn too.
"""

from __future__ import annotations

import os

import pytest
import torch

from mop_train.hf.export import export_checkpoint
from tests.hf.checkpoints import debug_args, random_model, save_dcp
from tests.utils import assert_close_to_scale, fresh_seed


def _step(tmp_path, seed: int) -> tuple:
    args = debug_args()
    return args, save_dcp(random_model(args, fresh_seed(seed)), str(tmp_path / "step-1"))


def test_a_tokenizer_folder_without_tokenizer_json_is_refused_before_writing(tmp_path):
    args, step = _step(tmp_path, 100)
    (tmp_path / "tok").mkdir()
    out = str(tmp_path / "hf")
    with pytest.raises(ValueError, match="has no tokenizer.json"):
        export_checkpoint(step, out, args, tokenizer_folder=str(tmp_path / "tok"))
    assert not os.path.exists(out) or not os.listdir(out), os.listdir(out)
    export_checkpoint(step, out, args)                       # the corrected command, into the same --out


def _remove(path):
    os.remove(path)


def _truncate(path):
    os.truncate(path, os.path.getsize(path) // 2)


@pytest.mark.parametrize("seed, damage, needle", [(101, _remove, "missing"), (102, _truncate, "bytes")],
                         ids=["missing", "truncated"])
def test_a_damaged_distcp_file_is_named_before_writing(tmp_path, seed, damage, needle):
    args, step = _step(tmp_path, seed)
    shard = next(n for n in os.listdir(step) if n.endswith(".distcp"))
    damage(os.path.join(step, shard))
    out = str(tmp_path / "hf")
    with pytest.raises(ValueError, match=f"{shard}.*{needle}"):
        export_checkpoint(step, out, args)
    assert not os.path.exists(out) or not os.listdir(out)


def test_an_out_that_is_a_file_is_refused(tmp_path):
    args, step = _step(tmp_path, 103)
    (tmp_path / "afile").write_text("")
    with pytest.raises(ValueError, match="is a file"):
        export_checkpoint(step, str(tmp_path / "afile"), args)


def test_a_checkpoint_folder_that_does_not_exist_is_named(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        export_checkpoint(str(tmp_path / "nope" / "step-1"), str(tmp_path / "hf"), debug_args())
    assert not os.path.exists(tmp_path / "hf")


def test_the_parent_of_the_step_folders_is_refused_with_the_steps_it_holds(tmp_path):
    args = debug_args()
    save_dcp(random_model(args, fresh_seed(104)), str(tmp_path / "checkpoint" / "step-7"))
    with pytest.raises(ValueError, match="step-7"):
        export_checkpoint(str(tmp_path / "checkpoint"), str(tmp_path / "hf"), args)


@pytest.mark.parametrize("q_lora_rank", [0, 16])
def test_transformers_computes_our_logits_with_every_norm_weight_drawn(tmp_path, q_lora_rank):
    transformers = pytest.importorskip("transformers")
    args = debug_args(q_lora_rank=q_lora_rank, n_layers=4, n_dense_layers=2, n_shared_experts=2,
                      rope_theta=50000.0, route_scale=2.5)
    model = random_model(args, fresh_seed(110 + q_lora_rank), bias_std=1.0)
    gen = torch.Generator().manual_seed(fresh_seed(112))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:                                     # every RMSNorm weight, 1 in the zoo's init
                p.copy_(1.0 + 0.4 * torch.randn(p.shape, generator=gen))
    out = str(tmp_path / "hf")
    export_checkpoint(save_dcp(model, str(tmp_path / "step-1")), out, args)
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = torch.randint(0, args.vocab_size, (2, 37), generator=gen)
    with torch.no_grad():
        theirs = hf(tokens).logits
        ours = model(tokens) @ model.output.weight.T
    assert_close_to_scale(theirs, ours, rtol=2e-6, name="HF logits vs ours (drawn norms)")


def _hf_folder(tmp_path, seed: int):
    args, step = _step(tmp_path, seed)
    out = str(tmp_path / "hf")
    report = export_checkpoint(step, out, args, max_shard_bytes=200_000)
    assert len(report.files) > 2
    return args, out, report.files


def test_import_names_a_missing_or_truncated_safetensors_file(tmp_path):
    from mop_train.hf.load import load_hf_state_dict

    args, out, files = _hf_folder(tmp_path, 120)
    os.remove(os.path.join(out, files[1]))                   # was a bare FileNotFoundError
    with pytest.raises(ValueError, match=f"{files[1]}.*is missing"):
        load_hf_state_dict(random_model(args, 0).state_dict(), out, args)
    path = os.path.join(out, files[0])
    os.truncate(path, os.path.getsize(path) // 2)            # was a bare SafetensorError
    with pytest.raises(ValueError, match=f"{files[0]} is not a readable safetensors file"):
        load_hf_state_dict(random_model(args, 0).state_dict(), out, args)


def test_import_reads_num_key_value_heads_null_as_one_per_head(tmp_path):
    import json

    from mop_train.hf.load import load_hf_state_dict

    args, out, _ = _hf_folder(tmp_path, 121)
    path = os.path.join(out, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["num_key_value_heads"] = None                     # HF DeepseekV3: num_attention_heads
    with open(path, "w") as f:
        json.dump(config, f)
    load_hf_state_dict(random_model(args, 0).state_dict(), out, args)
