"""Values met only by the ranks before (after the launch, some in torch's words naming no key), now
refused when the job is loaded: training.steps, [optimizer] and [lr_scheduler] ranges."""

import pytest

from mop_train.config import load_job_config


@pytest.mark.parametrize("text, needles", [
    ("[training]\nsteps = 0\n", ["training.steps = 0", ">= 1"]),
    ("[training]\nsteps = -1\n", ["training.steps = -1", ">= 1"]),
    ("[optimizer]\nlr = -1.0\n", ["optimizer.lr = -1.0", ">= 0"]),
    ("[optimizer]\nbeta1 = 2.0\n", ["optimizer.beta1 = 2.0", "[0, 1)"]),
    ("[optimizer]\nbeta2 = 1.0\n", ["optimizer.beta2 = 1.0", "[0, 1)"]),
    ("[optimizer]\neps = -1e-8\n", ["optimizer.eps = -1e-08", ">= 0"]),
    ("[optimizer]\nweight_decay = -0.1\n", ["optimizer.weight_decay = -0.1", ">= 0"]),
    ("[optimizer]\nname = \"SGD\"\n", ["optimizer.name = 'SGD'", "AdamW, Adam, OffloadStreamAdamW"]),
    ("[optimizer]\nearly_step_in_backward = true\n", ["optimizer.early_step_in_backward = true", "false"]),
    ("[optimizer]\nname = \"OffloadStreamAdamW\"\nearly_step_in_backward = true\n",
     ["optimizer.early_step_in_backward = true", "false"]),
    ("[lr_scheduler]\nwarmup_steps = -3\n", ["lr_scheduler.warmup_steps = -3", ">= 0"]),
    ("[lr_scheduler]\nmin_lr_factor = 1.5\n", ["lr_scheduler.min_lr_factor = 1.5", "[0, 1]"]),
    ("[lr_scheduler]\ndecay_ratio = -0.5\n", ["lr_scheduler.decay_ratio = -0.5", "[0, 1]"]),
    ("[metrics]\nlog_freq = 0\n", ["metrics.log_freq = 0", ">= 1"]),
    ("[checkpoint]\nenable = true\ninterval = 0\n", ["checkpoint.interval = 0", ">= 1"]),
    ("[checkpoint]\nenable = true\nkeep_latest_k = 1\n", ["checkpoint.keep_latest_k = 1", ">= 2"]),
    ("[checkpoint]\nenable = true\nkeep_latest_k = -1\n", ["checkpoint.keep_latest_k = -1", "0 (keep every"]),
    # a byte size without a unit was that many bytes: an SCO budget of 24 bytes offloads nothing
    ("[mop.sco]\nhost_budget = \"24\"\n", ["mop.sco.host_budget = '24' has no unit", "\"24GiB\""]),
    ("[mop.ring_dtp]\nmemory_budget = \"6\"\n", ["mop.ring_dtp.memory_budget = '6' has no unit", "\"6GiB\""]),
])
def test_training_and_optimizer_values_are_refused_at_load(tmp_path, text, needles):
    path = tmp_path / "job.toml"
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        load_job_config(["--job.config_file", str(path)])
    msg = str(info.value)
    assert str(path) in msg
    for needle in needles:
        assert needle in msg, f"{needle!r} missing from: {msg}"


def test_the_names_refused_at_load_are_the_ones_the_builder_lacks():
    from mop_train.config_checks import OPTIMIZERS
    from mop_train.ops.offload_adamw import OFFLOAD_ADAMW
    from mop_train.train.local_shard_optim import LOCAL_SHARD_OPTIMIZERS
    assert sorted(OPTIMIZERS) == sorted([*LOCAL_SHARD_OPTIMIZERS, OFFLOAD_ADAMW])


def test_good_optimizer_values_still_load(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text("[optimizer]\nlr = 0.0\nbeta1 = 0.0\neps = 0.0\nweight_decay = 0.0\n"
                    "[mop.sco]\nhost_budget = \"25769803776\"\n[mop.ring_dtp]\nmemory_budget = \"512b\"\n"
                    "[lr_scheduler]\nwarmup_steps = 0\nmin_lr_factor = 1.0\ndecay_ratio = 0.5\n"
                    "[training]\nsteps = 1\n")
    cfg = load_job_config(["--job.config_file", str(path)])
    assert cfg.optimizer.lr == 0.0 and cfg.training.steps == 1
