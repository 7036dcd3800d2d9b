"""Export to Hugging Face and import back, in one process (fp32, CPU): transformers' DeepseekV3ForCausalLM
computes our logits from the exported folder; the import restores every tensor; bad folders are refused."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from mop_train.cli import main
from mop_train.hf.export import export_checkpoint
from mop_train.hf.load import load_hf_state_dict
from mop_train.hf.names import hf_tensors
from mop_train.hf.run_record import write_run_record
from mop_train.models import zoo
from mop_train.train import data
from tests.hf.checkpoints import debug_args, random_model, save_dcp
from tests.utils import assert_close_to_scale, fresh_seed

transformers = pytest.importorskip("transformers")   # a test-only dependency (the `dev` extra)


def _logits(model, tokens):
    with torch.no_grad():
        return model(tokens) @ model.output.weight.T                    # [B, S, V]


@pytest.mark.parametrize("q_lora_rank", [0, 16])
def test_transformers_computes_our_logits(tmp_path, q_lora_rank):
    args = debug_args(q_lora_rank=q_lora_rank)
    model = random_model(args, fresh_seed(10 + q_lora_rank), bias_std=1.0)   # biases steer the routes
    out = str(tmp_path / "hf")
    report = export_checkpoint(save_dcp(model, str(tmp_path / "step-1")), out, args, max_shard_bytes=300_000)
    assert len(report.files) > 1 and all(n == 1 for n in report.chunk_reads.values())
    hf, info = transformers.DeepseekV3ForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                                    output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    hf.eval()
    for moe, layer in zip(model.moe_layers(), hf.model.layers[args.n_dense_layers:]):
        assert torch.equal(layer.mlp.gate.e_score_correction_bias, moe.router.expert_bias)
    tokens = torch.randint(0, args.vocab_size, (2, 37), generator=torch.Generator().manual_seed(fresh_seed(3)))
    with torch.no_grad():
        theirs = hf(tokens).logits
    assert_close_to_scale(theirs, _logits(model, tokens), rtol=2e-6, name="HF logits vs ours")


def test_files_index_and_memory_bound(tmp_path):
    args = debug_args(n_layers=6)   # deep enough that the embeddings are not half of the model
    model = random_model(args, fresh_seed(20))
    limit = 200_000
    out = str(tmp_path / "hf")
    report = export_checkpoint(save_dcp(model, str(tmp_path / "step-1")), out, args, max_shard_bytes=limit)
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        index = json.load(f)
    assert set(index["weight_map"]) == {t.name for t in hf_tensors(args)}
    assert sorted(set(index["weight_map"].values())) == report.files
    from safetensors import safe_open

    sizes, total = [], 0
    for name in report.files:
        with safe_open(os.path.join(out, name), framework="pt") as f:
            nbytes = [f.get_tensor(k).nbytes for k in f.keys()]
        sizes.append(sum(nbytes))
        assert sum(nbytes) <= limit or len(nbytes) == 1, (name, sum(nbytes))
        total += sum(nbytes)
    assert index["metadata"]["total_size"] == total == report.total_bytes
    # one file's tensors + the stored pieces they touch (one piece per tensor here: the largest, and an
    # expert stack that straddles two files): never the whole model
    largest = max(v.nbytes for v in model.state_dict().values())
    assert report.peak_bytes <= max(sizes) + 2 * largest, (report.peak_bytes, max(sizes), largest)
    assert report.peak_bytes < total / 2


def test_bfloat16_export_keeps_the_router_in_fp32(tmp_path):
    args = debug_args()
    model = random_model(args, fresh_seed(30))
    out = str(tmp_path / "hf")
    export_checkpoint(save_dcp(model, str(tmp_path / "step-1")), out, args, dtype=torch.bfloat16)
    from safetensors import safe_open

    ours = model.state_dict()
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["dtype"] == "bfloat16"
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    for t in hf_tensors(args):
        with safe_open(os.path.join(out, weight_map[t.name]), framework="pt") as f:
            got = f.get_tensor(t.name)
        want = ours[t.key] if t.expert is None else ours[t.key][t.expert]
        fp32 = t.name.endswith(("mlp.gate.weight", "e_score_correction_bias"))
        assert got.dtype == (torch.float32 if fp32 else torch.bfloat16), t.name
        assert torch.equal(got, want.to(got.dtype)), t.name


def test_import_restores_every_tensor(tmp_path):
    args = debug_args(q_lora_rank=16)
    model = random_model(args, fresh_seed(40))
    out = str(tmp_path / "hf")
    export_checkpoint(save_dcp(model, str(tmp_path / "step-1")), out, args, max_shard_bytes=100_000)
    fresh = random_model(args, fresh_seed(41))
    state = fresh.state_dict()
    report = load_hf_state_dict(state, out, args)
    assert report.elements_read == report.elements_total == sum(v.numel() for v in state.values())
    for key, value in model.state_dict().items():
        assert torch.equal(state[key], value), key


def test_import_refuses_another_model_and_bad_tensors(tmp_path):
    args = debug_args()
    model = random_model(args, fresh_seed(50))
    out = str(tmp_path / "hf")
    export_checkpoint(save_dcp(model, str(tmp_path / "step-1")), out, args)
    other = debug_args(q_lora_rank=16)
    with pytest.raises(ValueError, match="q_lora_rank = None but the run's model needs 16"):
        load_hf_state_dict(random_model(other, 0).state_dict(), out, other)
    assert "no mop_model.json" in capture_export_error(tmp_path) and "--flavor" in capture_export_error(tmp_path)
    bad = str(tmp_path / "nan")
    poisoned = random_model(args, fresh_seed(51))
    with torch.no_grad():
        poisoned.layers["2"].attention.wo.weight[3, 5] = float("nan")
    export_checkpoint(save_dcp(poisoned, str(tmp_path / "step-2")), bad, args)
    with pytest.raises(ValueError, match="layers.2.attention.wo.weight hold NaN"):
        load_hf_state_dict(random_model(args, 0).state_dict(), bad, args)


def capture_export_error(tmp_path) -> str:
    """`mop-train export` without a run record or --flavor: exit 2, and the message."""
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["export", "--checkpoint", str(tmp_path / "step-1"), "--out", str(tmp_path / "x")]) == 2
    return err.getvalue()


def test_cli_export_reads_the_run_record_and_copies_the_tokenizer(tmp_path, capsys):
    args = debug_args()
    dump = tmp_path / "run"
    step = save_dcp(random_model(args, fresh_seed(60)), str(dump / "checkpoint" / "step-3"))
    folder = data.embedded_assets(data.default_cache_dir())
    write_run_record(str(dump), flavor="debug", args=args, tokenizer_folder=folder, checkpoint_folder="checkpoint")
    out = str(tmp_path / "hf")
    assert main(["export", "--checkpoint", step, "--out", out, "--dtype", "bfloat16"]) == 0
    assert "mop_model.json" in capsys.readouterr().out
    assert sorted(n for n in os.listdir(out) if n.startswith("tokenizer")) == ["tokenizer.json",
                                                                               "tokenizer_config.json"]
    assert not os.path.exists(os.path.join(out, "corpus.jsonl"))
    ours = data.build_tokenizer(data.EMBEDDED, cache_dir=data.default_cache_dir())
    theirs = transformers.PreTrainedTokenizerFast.from_pretrained(out)
    text = "def f(x):\n    return x + 1  # a comment\n"
    assert theirs(text, add_special_tokens=False)["input_ids"] == ours.encode(text, add_bos=False, add_eos=False)
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    assert (config["bos_token_id"], config["eos_token_id"]) == (ours.bos_id, ours.eos_id)
    assert main(["export", "--checkpoint", step, "--out", out]) == 2      # never over an earlier export
    assert "not empty" in capsys.readouterr().err
    assert main(["export", "--checkpoint", step, "--out", str(tmp_path / "g"), "--flavor",
                 "gpt-oss-20b-shape"]) == 2
    assert "GQA family has no HF export" in capsys.readouterr().err


def test_export_refuses_a_damaged_checkpoint(tmp_path, capsys):
    args = debug_args()
    step = save_dcp(random_model(args, fresh_seed(70)), str(tmp_path / "step-1"))
    shard = next(n for n in os.listdir(step) if n.endswith(".distcp"))
    with open(os.path.join(step, shard), "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert main(["export", "--checkpoint", step, "--out", str(tmp_path / "hf"), "--flavor", "debug"]) == 2
    assert re.search("failed verification.*SHA-256", capsys.readouterr().err)
    with pytest.raises(ValueError, match="has shape"):
        export_checkpoint(step, str(tmp_path / "hf2"), zoo.get_model_args("small"))
