"""HF import at another layout continues the same losses, and a sharded run's checkpoint exports exactly
(fp32 CPU, gloo, through the real launch path: `torchrun -m mop_train.train` and `mop-train export`).

One random `debug` model W0 (router biases drawn too) is saved as DCP and exported to HF. Run C starts from
the DCP at W=1 (the training function the CLI calls, in one spawned rank: tests/train/in_process.py, a
launch fewer), run B (a torchrun launch) from the HF folder at (W=4, D=2, E_p=2, P=2): both take the same
global batch, so their losses must agree (rel 1e-5), and C's first loss must be W0's loss on that batch
computed here (so both really loaded W0). Then B's step-2 checkpoint (FSDP2 rows over 4 ranks, expert shards
over E_p, vocabulary intervals over P) is exported from its run record, each stored piece read once, and
every HF tensor equals, bit for bit, that checkpoint's tensor as DCP's own reader assembles it.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from mop_train.cli import main
from mop_train.config import load_job_config
from mop_train.hf.export import export_checkpoint
from mop_train.hf.names import hf_tensors
from mop_train.hf.run_record import find_run_record
from mop_train.train import data
from mop_train.train.loss import IGNORE_INDEX
from tests.hf.checkpoints import debug_args, random_model, save_dcp
from tests.dist_utils import run_distributed
from tests.train.cli import DEBUG_CONFIG, check_ok, read_metrics, run_train
from tests.train.in_process import stdout_of, train_here
from tests.utils import assert_bitwise_equal, assert_close, fresh_seed

pytestmark = pytest.mark.slow
GLOBAL_BATCH, SEQ = 4, 128
COMMON = ["--job.config_file", DEBUG_CONFIG, "--training.seq_len", str(SEQ), "--training.steps", "2",
          "--metrics.log_freq", "1", "--metrics.no-enable-tensorboard", "--debug.seed", "11",
          "--checkpoint.enable", "--checkpoint.interval", "2", "--lr_scheduler.warmup_steps", "2",
          "--lr_scheduler.total_steps", "8"]
WIDE = ["--training.local_batch_size", "2", "--mop.layout.seq_degree", "2", "--mop.layout.expert_degree", "2",
        "--mop.layout.vocab_degree", "2", "--mop.moe.dispatch", "ep"]
W, E_p, P = 4, 2, 2


def first_batch_loss(model) -> float:
    """W0's mean token loss on the first global batch of the embedded corpus (what step 1 reports)."""
    cfg = load_job_config(["--job.config_file", DEBUG_CONFIG, "--training.local_batch_size", str(GLOBAL_BATCH),
                           "--training.seq_len", str(SEQ)])
    cache = data.default_cache_dir()
    loader = data.build_dataloader(cfg.training, data.build_tokenizer(data.EMBEDDED, cache_dir=cache), 0, 1,
                                   cache_dir=cache)
    inputs, labels = next(iter(loader))
    with torch.no_grad():
        logits = model(inputs["input"]) @ model.output.weight.T                 # [B, S, V]
    return float(F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX))


def expected_reads(args) -> int:
    """Elements all ranks read together when each reads its own slices: FSDP2 rows once over W, each expert
    shard by its W/E_p replicas, each vocabulary interval by its W/P replicas, the router biases by all."""
    total = 0
    for t in hf_tensors(args):
        n = torch.Size(t.shape).numel()
        copies = (W // E_p if ".experts." in t.name else W // P if t.key == "output.weight"
                  else W if t.key.endswith("expert_bias") else 1)
        total += n * copies
    return total


def _dcp_start_worker(rank, world, folder, dcp_w0):
    train_here(folder, [*COMMON, "--training.local_batch_size", str(GLOBAL_BATCH),
                        "--checkpoint.initial_load_path", dcp_w0])


def test_hf_import_at_another_layout_and_sharded_export(tmp_path):
    args = debug_args()
    w0 = random_model(args, fresh_seed(80))
    dcp_w0, hf0 = save_dcp(w0, str(tmp_path / "w0")), str(tmp_path / "hf0")
    assert main(["export", "--checkpoint", dcp_w0, "--out", hf0, "--flavor", "debug", "--tokenizer", "none"]) == 0
    c, b = str(tmp_path / "c"), str(tmp_path / "b")
    run_distributed(_dcp_start_worker, 1, c, dcp_w0, timeout_s=300)
    proc_b = run_train([*COMMON, *WIDE, "--job.dump_folder", b, "--checkpoint.initial_load_path", hf0,
                        "--checkpoint.initial_load_in_hf"], nproc=W, timeout=300)
    check_ok(proc_b)
    assert f"initial weights from {dcp_w0} (DCP, model only)" in stdout_of(c)
    assert f"initial weights from {hf0} (Hugging Face safetensors, model only)" in proc_b.stdout
    loss_c = torch.tensor([r["loss"] for r in read_metrics(c)])
    loss_b = torch.tensor([r["loss"] for r in read_metrics(b)])
    assert len(loss_c) == len(loss_b) == 2
    assert_close(loss_c[:1], torch.tensor([first_batch_loss(w0)]), rtol=1e-5, atol=0, name="step 1 vs W0's loss")
    assert_close(loss_b, loss_c, rtol=1e-5, atol=0, name="HF import at W=4 vs DCP at W=1")

    found = re.search(r"ranks read \[([\d, ]+)\] of the checkpoint's (\d+) elements", proc_b.stdout + proc_b.stderr)
    assert found, proc_b.stderr[-2000:]
    counts, total = [int(x) for x in found.group(1).split(",")], int(found.group(2))
    assert len(counts) == W and max(counts) < total / 2 and sum(counts) == expected_reads(args), counts

    record = find_run_record(os.path.join(b, "checkpoint", "step-2"))
    assert record is not None and record.flavor == "debug" and record.args == args
    out = str(tmp_path / "hf2")
    report = export_checkpoint(os.path.join(b, "checkpoint", "step-2"), out, record.args, max_shard_bytes=150_000,
                               tokenizer_folder=record.tokenizer_folder)
    assert set(report.chunk_reads.values()) == {1}
    assert sum(c.key == "tok_embeddings.weight" for c in report.chunk_reads) == W          # FSDP2 rows
    assert sum(c.key == "layers.1.moe.experts.w1" for c in report.chunk_reads) == E_p      # expert shards
    assert sum(c.key == "output.weight" for c in report.chunk_reads) == P                  # vocab intervals
    assert "tokenizer.json" in report.tokenizer_files
    dcp_to_torch_save(os.path.join(b, "checkpoint", "step-2"), str(tmp_path / "b.pt"))   # DCP's own reader
    state = torch.load(str(tmp_path / "b.pt"), weights_only=False)
    ref = state.get("model", state)
    from safetensors import safe_open

    handles = {n: safe_open(os.path.join(out, n), framework="pt") for n in report.files}
    for t in hf_tensors(args):
        got = next(h.get_tensor(t.name) for h in handles.values() if t.name in h.keys())
        want = ref[t.key] if t.expert is None else ref[t.key][t.expert]
        assert_bitwise_equal(got, want, name=t.name)
