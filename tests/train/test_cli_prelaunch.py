"""`mop-train train` refuses, before torchrun's launcher starts any rank, what the ranks met first
after the launch: the layout against the model and sequence, the batch against W/D, torchtitan's
parallelism degrees, missing data or tokenizer paths, and a dump folder holding another model's
checkpoints. The launcher is replaced by one that fails the test if it is reached."""

from __future__ import annotations

import os

import pytest

from tests.train.cli import DEBUG_CONFIG


@pytest.fixture
def no_launch(monkeypatch):
    from torch.distributed import run as torchrun

    def launched(*_args, **_kwargs):
        raise AssertionError("torchrun's launcher was reached: the check ran after the launch")
    monkeypatch.setattr(torchrun, "run", launched)


def cli(argv, capsys):
    from mop_train.cli import main

    code = main(argv)
    return code, capsys.readouterr().err.strip()


@pytest.mark.parametrize("nproc, flags, needles", [
    (2, ["--mop.layout.seq_degree", "2", "--training.seq_len", "127"], ["training.seq_len (127)", "seq_degree (2)"]),
    (2, ["--mop.layout.seq_degree", "2", "--training.seq_len", "4097"], ["training.seq_len (4097)"]),
    (1, ["--training.global_batch_size", "6"], ["training.global_batch_size = 6", "multiple of 4"]),
    (1, ["--parallelism.tensor_parallel_degree", "2"], ["parallelism.tensor_parallel_degree = 2", "set it to 1"]),
    (1, ["--training.dtype", "bfloat16"], ["training.dtype = 'bfloat16'", "mixed_precision_param"]),
    (1, ["--training.dataset", "nope"], ["training.dataset = 'nope'", "embedded, jsonl"]),
    (1, ["--training.dataset", "jsonl", "--training.dataset_path", "/nonexistent/d.jsonl"],
     ["training.dataset_path = '/nonexistent/d.jsonl'", "names no jsonl file"]),
    (1, ["--training.dataset", "jsonl"], ["needs training.dataset_path"]),
    (1, ["--model.hf_assets_path", "/nonexistent/tok"],
     ["model.hf_assets_path = '/nonexistent/tok'", "tokenizer.json"]),
])
def test_train_refuses_before_the_launch(tmp_path, capsys, no_launch, nproc, flags, needles):
    code, err = cli(["train", "--nproc-per-node", str(nproc), DEBUG_CONFIG, "--job.dump_folder", str(tmp_path),
                     *flags], capsys)
    assert code == 2, err
    for needle in needles:
        assert needle in err, f"{needle!r} missing from: {err}"


def test_train_refuses_another_flavors_checkpoints_before_the_launch(tmp_path, capsys, no_launch):
    from mop_train.hf.run_record import write_run_record
    from mop_train.models import zoo

    write_run_record(str(tmp_path), flavor="small", args=zoo.get_model_args("small"), tokenizer_folder=None,
                     checkpoint_folder="checkpoint")
    os.makedirs(tmp_path / "checkpoint" / "step-5")
    code, err = cli(["train", "--nproc-per-node", "1", DEBUG_CONFIG, "--job.dump_folder", str(tmp_path)], capsys)
    assert code == 2, err
    for needle in ("holds checkpoints of model.flavor = 'small'", "model.flavor = 'debug'", "--model.flavor small",
                   "another --job.dump_folder"):
        assert needle in err, f"{needle!r} missing from: {err}"


def test_the_same_flavors_checkpoints_or_none_pass_the_check(tmp_path):
    """A resume of the same flavor, a record without checkpoints, and checkpointing off are not refused."""
    from mop_train.config import load_job_config
    from mop_train.config_checks import check_checkpoint_model
    from mop_train.hf.run_record import write_run_record
    from mop_train.models import zoo

    write_run_record(str(tmp_path), flavor="small", args=zoo.get_model_args("small"), tokenizer_folder=None,
                     checkpoint_folder="checkpoint")
    base = ["--job.config_file", DEBUG_CONFIG, "--job.dump_folder", str(tmp_path)]
    check_checkpoint_model(load_job_config(base))                              # no step folder yet
    os.makedirs(tmp_path / "checkpoint" / "step-5")
    check_checkpoint_model(load_job_config([*base, "--model.flavor", "small"]))  # same flavor
    check_checkpoint_model(load_job_config([*base, "--checkpoint.no-enable"]))   # nothing is loaded
    with pytest.raises(ValueError, match="holds checkpoints of model.flavor = 'small'"):
        check_checkpoint_model(load_job_config(base))


def fake_checkpoint(dump, step: int, *, readers: int, offload: bool, weights_alone: bool = False) -> None:
    """A DCP checkpoint's .metadata with the keys the resume checks read (data positions of `readers`
    sequence groups; an optimizer state with or without OffloadStreamAdamW's masters; a train state) and a
    manifest; `weights_alone`: the model only, as a run's last save under checkpoint.last_save_model_only."""
    import torch
    import torch.distributed.checkpoint as dcp

    folder = os.path.join(dump, "checkpoint", f"step-{step}")
    moments = {"exp_avg": torch.zeros(2), **({"master": torch.zeros(2)} if offload else {})}
    state = ({"model": {"w": torch.zeros(2)}} if weights_alone else
             {"dataloader": {f"dp_rank_{r}": torch.zeros(1) for r in range(readers)},
              "optimizer": {"state": {"w": moments}}, "train_state": {"step": torch.zeros(1)}})
    dcp.save(state, checkpoint_id=folder, no_dist=True)
    with open(os.path.join(folder, "manifest.json"), "w") as f:
        f.write('{"files": {}}')


@pytest.mark.parametrize("nproc, flags, readers, offload, needles", [
    (1, [], 2, False, ["written by 2 sequence groups (W/D) and this launch has 1", "W / mop.layout.seq_degree = 2"]),
    (2, ["--optimizer.name", "OffloadStreamAdamW"], 2, False,
     ["optimizer.name = AdamW or Adam and this run uses OffloadStreamAdamW", "--optimizer.name AdamW"]),
    (2, [], 2, True, ["optimizer.name = OffloadStreamAdamW and this run uses AdamW",
                      "--optimizer.name OffloadStreamAdamW"]),
])
def test_a_resume_the_checkpoint_cannot_take_is_refused_before_the_launch(tmp_path, capsys, no_launch, nproc, flags,
                                                                          readers, offload, needles):
    """Refused by the ranks too, but only after each had built the model and the optimizer."""
    fake_checkpoint(str(tmp_path), 5, readers=readers, offload=offload)
    code, err = cli(["train", "--nproc-per-node", str(nproc), DEBUG_CONFIG, "--job.dump_folder", str(tmp_path),
                     *flags], capsys)
    assert code == 2, err
    for needle in ("step-5", *needles):
        assert needle in err, f"{needle!r} missing from: {err}"


def test_a_resume_the_checkpoint_can_take_passes(tmp_path):
    """Same sequence groups and optimizer; a save cut short (no manifest) is not what a resume takes;
    checkpointing off reads nothing."""
    from mop_train.config import load_job_config
    from mop_train.config_checks import check_resume_layout

    fake_checkpoint(str(tmp_path), 5, readers=2, offload=False)
    base = ["--job.config_file", DEBUG_CONFIG, "--job.dump_folder", str(tmp_path)]
    check_resume_layout(load_job_config(base), 2)
    check_resume_layout(load_job_config([*base, "--mop.layout.seq_degree", "2"]), 4)
    check_resume_layout(load_job_config([*base, "--checkpoint.no-enable"]), 1)
    fake_checkpoint(str(tmp_path), 9, readers=1, offload=True)
    os.remove(tmp_path / "checkpoint" / "step-9" / "manifest.json")
    check_resume_layout(load_job_config(base), 2)
    with pytest.raises(ValueError, match="this launch has 1"):
        check_resume_layout(load_job_config(base), 1)


def test_a_model_only_last_save_is_passed_over_as_the_ranks_pass_it_over(tmp_path):
    """The ranks resume from step 5 (the newest with a train state), so the check reads step 5, not the
    weights-only step 9 after it (which has no data position and would pass any launch)."""
    from mop_train.config import load_job_config
    from mop_train.config_checks import check_resume_layout

    fake_checkpoint(str(tmp_path), 5, readers=2, offload=False)
    fake_checkpoint(str(tmp_path), 9, readers=0, offload=False, weights_alone=True)
    base = ["--job.config_file", DEBUG_CONFIG, "--job.dump_folder", str(tmp_path)]
    check_resume_layout(load_job_config(base), 2)
    with pytest.raises(ValueError, match="step-5 was written by 2 sequence groups"):
        check_resume_layout(load_job_config(base), 1)


def test_a_context_past_the_models_max_seq_len_is_refused_before_the_launch(tmp_path, capsys, no_launch):
    code, err = cli(["train", "--nproc-per-node", "1", DEBUG_CONFIG, "--job.dump_folder", str(tmp_path),
                     "--training.seq_len", "262144"], capsys)
    assert code == 2 and "training.seq_len = 262,144 exceeds model debug's max_seq_len = 131,072" in err, err
