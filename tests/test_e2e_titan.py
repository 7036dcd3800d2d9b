"""The torchtitan side of the end-to-end comparison (benchmarks/titan_launch.py, e2e_settings.py),
checked on CPU: the DeepSeek-V3 flavor's parameter count equals ours, every setting's flags parse
into torchtitan's JobConfig, the grid holds every AC x compile x layout and no CPU offload at one
rank (and why: torchtitan applies no FSDP there), its dataloader over our embedded corpus yields the
same batches as ours, its metrics are read as written. The comparison's phases are checked against
fakes of the launcher in tests/test_e2e_phases.py. torchtitan's Trainer itself runs on CUDA only (it
takes its device type from the machine and builds NCCL groups): those tests carry `gpu`."""

import copy
import os
import subprocess

import pytest
import torch

from benchmarks import titan_launch
from benchmarks.e2e_settings import (AutoSettings, TitanSetting, all_operators, candidates, our_command,
                                     read_titan_metrics, titan_command, titan_flags, titan_grid)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("name", ["debug", "small"])
def test_deepseek_v3_flavor_has_our_parameter_count(name):
    counts = titan_launch.check_param_counts(name, tolerance=0.0)
    print(f"{name}: torchtitan {counts['torchtitan']:,}  ours {counts['mop_train']:,}")
    assert counts["torchtitan"] == counts["mop_train"]
    if name == "small":
        assert counts["mop_train"] == 3_290_190_336


def test_gqa_zoo_model_is_refused():
    with pytest.raises(ValueError, match="MLA only"):
        titan_launch.deepseek_v3_args("gpt-oss-20b-shape")


def parse(flags):
    from torchtitan.config import ConfigManager
    return ConfigManager().parse_args(flags)


@pytest.mark.parametrize("world", [1, 2])
def test_every_candidate_setting_parses_into_torchtitans_config(tmp_path, world):
    settings = {s for kinds in candidates(world, 1).values() for lst in kinds.values() for s in lst
                if isinstance(s, TitanSetting)}
    assert len(settings) >= 9 * world
    for s in settings:
        cfg = parse(titan_flags(str(tmp_path), s, flavor="small", seq_len=32768, local_batch=1, steps=2,
                                timeout_s=100, hf_assets_path=str(tmp_path), warmup_steps=7))
        assert (cfg.parallelism.context_parallel_degree, cfg.parallelism.expert_parallel_degree) == (s.cp, s.ep)
        assert cfg.activation_checkpoint.mode == s.ac and cfg.training.enable_cpu_offload == s.offload
        assert cfg.compile.enable == (s.compile != "off")
        if s.compile != "off":
            assert cfg.compile.components == s.compile.split("+")
        assert cfg.model.name == titan_launch.SPEC_NAME and cfg.training.seq_len == 32768
        assert cfg.comm.train_timeout_seconds >= 100 and cfg.metrics.log_freq == 1
        assert (cfg.lr_scheduler.warmup_steps, cfg.lr_scheduler.decay_type) == (7, "cosine")
    cmd = titan_command(2, str(tmp_path), TitanSetting(), flavor="small", seq_len=8, local_batch=1, steps=2,
                        timeout_s=10)
    assert cmd[cmd.index("-m", 2) + 1] == "benchmarks.titan_launch"


def test_the_grid_holds_every_ac_and_compile_at_every_layout_and_no_offload_at_one_rank():
    one, two = titan_grid(1), titan_grid(2)
    assert len(set(one)) == len(one) == 9 and {(s.cp, s.ep) for s in one} == {(1, 1)}
    assert {(s.ac, s.compile) for s in one} == {(a, c) for a in ("full", "selective", "none")
                                                for c in ("off", "loss", "model+loss")}
    assert len(set(two)) == 36 and {(s.cp, s.ep) for s in two} == {(1, 1), (2, 1), (1, 2), (2, 2)}
    one_rank = [s for kinds in candidates(1, 1)["torchtitan"].values() for s in kinds]
    assert not any(s.offload for s in one_rank) and all(s.cp == s.ep == 1 for s in one_rank)
    assert any(s.offload for s in candidates(2, 1)["torchtitan"]["reach"])
    with pytest.raises(ValueError, match="enable_cpu_offload at one rank"):
        titan_command(1, "/tmp/x", TitanSetting(offload=True), flavor="small", seq_len=8, local_batch=1,
                      steps=2, timeout_s=10)
    with pytest.raises(ValueError, match="must divide"):
        TitanSetting(cp=2).check(3)
    TitanSetting(cp=2, offload=True).check(2)


def test_memory_dominance_between_settings():
    t = TitanSetting
    assert t(ac="none", compile="off").holds_at_least(t(ac="selective", compile="loss"))
    assert t(ac="selective", compile="loss").holds_at_least(t(ac="full", compile="loss"))
    assert not t(ac="full", compile="off").holds_at_least(t(ac="selective", compile="loss")), "orders cross"
    assert not t(ac="none").holds_at_least(t(ac="none")), "not itself"
    assert not t(cp=2, ac="none").holds_at_least(t(cp=1, ac="full")), "another layout"
    assert not t(ac="none", offload=True).holds_at_least(t(ac="full")), "another offload"


def test_torchtitan_applies_no_fsdp_at_one_rank_so_cpu_offload_leaves_parameters_where_they_are_built():
    """The cause of the one-rank offload failure, on CPU: torchtitan's own parallelize_deepseekv3 with
    enable_cpu_offload at world size 1 wraps nothing in FSDP (no CPUOffloadPolicy moves anything), so the
    Trainer's `to_empty(device="cpu")` (train.py, enable_cpu_offload) leaves every parameter on the CPU
    while the batch goes to the GPU (benchmarks/titan_offload_repro.py shows the failure on one GPU)."""
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model, deepseekv3_args
    from torchtitan.models.deepseek_v3.infra.parallelize import parallelize_deepseekv3

    cfg = parse(["--model.name", "deepseek_v3", "--model.flavor", "debugmodel", "--training.enable_cpu_offload",
                 "--activation_checkpoint.mode", "none"])
    args = copy.deepcopy(deepseekv3_args["debugmodel"])
    args.update_from_config(cfg)  # as the Trainer does before building the model
    with torch.device("meta"):
        model = DeepSeekV3Model(args)
    dims = ParallelDims(dp_shard=-1, dp_replicate=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    assert not dims.fsdp_enabled and not dims.ep_enabled
    model = parallelize_deepseekv3(model, dims, cfg)
    assert not any(isinstance(m, FSDPModule) for m in model.modules())
    model.to_empty(device="cpu")
    assert {p.device.type for p in model.parameters()} == {"cpu"}


def test_torchtitans_dataloader_and_ours_give_the_same_batches_at_one_rank(tmp_path):
    """The loss curves' "same data order": torchtitan's dataloader over our corpus (the launcher's
    dataset) and ours yield the same inputs and labels, batch by batch, at world size 1."""
    from torchtitan.protocols.train_spec import get_train_spec

    from mop_train.config import load_job_config
    from mop_train.models import zoo
    from mop_train.train.data import build_dataloader, build_tokenizer, default_cache_dir

    titan_launch.register()
    seq_len, batch = 96, 3
    tcfg = parse(titan_flags(str(tmp_path), TitanSetting(), flavor="debug", seq_len=seq_len, local_batch=batch,
                             steps=2, timeout_s=10))
    spec = get_train_spec(titan_launch.SPEC_NAME)
    titan = spec.build_dataloader_fn(dp_world_size=1, dp_rank=0, tokenizer=spec.build_tokenizer_fn(tcfg),
                                     job_config=tcfg)
    ocfg = load_job_config(["--job.config_file", "configs/debug_cpu.toml", "--training.seq_len", str(seq_len),
                            "--training.local_batch_size", str(batch)], model_flavors=zoo.names())
    ours = build_dataloader(ocfg.training, build_tokenizer("embedded", cache_dir=default_cache_dir()), 0, 1,
                            cache_dir=default_cache_dir())
    for (ti, tl), (oi, ol), _ in zip(titan, ours, range(4)):
        assert torch.equal(ti["input"], oi["input"]) and torch.equal(tl, ol)


def test_our_settings_flags():
    assert all_operators(2).flags() == [
        "--mop.layout.seq_degree", "2", "--mop.layout.expert_degree", "2", "--mop.layout.vocab_degree", "2",
        "--mop.moe.dispatch", "pipelined_llep", "--mop.ring_dtp.enable", "--mop.sco.host_budget", "auto",
        "--optimizer.name", "OffloadStreamAdamW"]
    assert all_operators(1).global_batch(2, 3) == 3 and TitanSetting(cp=2).global_batch(2, 3) == 3
    assert TitanSetting(cp=1).global_batch(2, 3) == 6
    with pytest.raises(ValueError, match="compile"):
        TitanSetting(compile="yes")


def test_embedded_dataset_and_tokenizer_build_through_the_train_spec(tmp_path):
    from torchtitan.protocols.train_spec import get_train_spec

    titan_launch.register()
    titan_launch.register()  # twice is fine
    cfg = parse(titan_flags(str(tmp_path), TitanSetting(), flavor="debug", seq_len=64, local_batch=2, steps=2,
                            timeout_s=10))
    spec = get_train_spec(titan_launch.SPEC_NAME)
    assert set(spec.model_args) == set(titan_launch.mla_names())
    tokenizer = spec.build_tokenizer_fn(cfg)
    assert tokenizer.get_vocab_size() == 2048
    loader = spec.build_dataloader_fn(dp_world_size=2, dp_rank=1, tokenizer=tokenizer, job_config=cfg)
    inputs, labels = next(iter(loader))
    assert inputs["input"].shape == labels.shape == (2, 64)
    assert int(inputs["input"].max()) < 2048
    assert bool((inputs["input"][:, 1:] == labels[:, :-1]).all()), "labels are the inputs shifted by one"


def test_metrics_tee_and_reader(tmp_path):
    class Inner:
        logged = []

        def log(self, metrics, step):
            self.logged.append(step)

        def close(self):
            pass

    tee = titan_launch._JsonlTee(Inner(), str(tmp_path / "metrics.jsonl"), world_size=2)
    for step, tps in ((1, 10.0), (2, 100.0), (3, 300.0), (4, 200.0)):
        tee.log({"throughput(tps)": tps, "tflops": tps / 10, "memory/max_active(GiB)": step,
                 "memory/max_reserved(GiB)": step + 1, "loss_metrics/global_avg_loss": 8.0 - step}, step)
    tee.close()
    got = read_titan_metrics(str(tmp_path))
    assert got["tokens_per_s"] == 400.0, "median of steps 2-4 (200 tokens/s per device) times 2 ranks"
    assert got["peak_mem_gib"] == 4 and got["peak_reserved_gib"] == 5 and got["final_loss"] == 4.0
    assert got["steps"] == 4 and Inner.logged == [1, 2, 3, 4]
    from benchmarks.e2e_vs_torchtitan import read_losses
    assert read_losses(str(tmp_path), "loss_metrics/global_avg_loss") == [7.0, 6.0, 5.0, 4.0]


@pytest.mark.gpu
@pytest.mark.slow
def test_titan_trainer_runs_two_steps_on_cuda(tmp_path):
    """torchtitan's Trainer through our launcher (CUDA only), the debug flavor on one GPU."""
    cmd = titan_command(1, str(tmp_path), TitanSetting(), flavor="debug", seq_len=256, local_batch=2, steps=2,
                        timeout_s=300)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = read_titan_metrics(str(tmp_path))
    assert got["steps"] == 2 and got["tokens_per_s"] > 0


def test_ours_auto_asks_the_planner_per_point_and_its_flags_parse():
    from mop_train.config import load_job_config
    from mop_train.models import zoo

    auto = AutoSettings("configs/small_1gpu.toml", world=2, gpu_bytes=141 << 30, host_bytes=256 << 30)
    chosen = auto.at(32768, 1)
    assert chosen is auto.at(32768, 1), "one plan per point"
    assert chosen.name.startswith("auto-D") and "--training.seq_len" not in chosen.flags()
    assert chosen.predicted_tokens_per_s > 0 and 0 < chosen.planned_peak_gib <= 139
    cmd = our_command("configs/small_1gpu.toml", 2, "/tmp/x", chosen, seq_len=32768, local_batch=1, steps=2)
    job = cmd[cmd.index("--job.config_file"):]
    cfg = load_job_config(job, model_flavors=zoo.names())
    assert cfg.mop.layout.seq_degree == int(chosen.flags()[chosen.flags().index("--mop.layout.seq_degree") + 1])
    assert chosen.global_batch(2, 1) == 2 // cfg.mop.layout.seq_degree
    assert AutoSettings("configs/small_1gpu.toml", world=1, gpu_bytes=8 << 30, host_bytes=16 << 30).at(4096, 2) is None


def test_offload_reproduction_uses_torchtitans_own_spec_dataset_and_entry_point(tmp_path):
    """benchmarks/titan_offload_repro.py on CPU, as far as CPU goes: its flags are torchtitan's own
    (spec deepseek_v3, flavor debugmodel, dataset c4_test), its c4_test folder feeds torchtitan's own
    dataloader, and its verdict names whose failure it is from the runs' outcomes."""
    from torchtitan.protocols.train_spec import get_train_spec

    from benchmarks import titan_offload_repro as repro
    from mop_train.train.data import default_cache_dir, embedded_assets

    c4 = repro.write_c4_test(str(tmp_path / "c4_test"), documents=8)
    tok = embedded_assets(default_cache_dir())
    flags = repro.titan_flags(str(tmp_path / "run"), tokenizer_dir=tok, c4_dir=c4, offload=True)
    cfg = parse(flags)
    assert (cfg.model.name, cfg.model.flavor, cfg.training.dataset) == ("deepseek_v3", "debugmodel", "c4_test")
    assert cfg.training.enable_cpu_offload and not parse(repro.titan_flags(
        str(tmp_path), tokenizer_dir=tok, c4_dir=c4, offload=False)).training.enable_cpu_offload
    cmd = repro.titan_command(1, flags)
    assert cmd[cmd.index("-m", 2) + 1] == "torchtitan.train" and "benchmarks.titan_launch" not in cmd
    spec = get_train_spec("deepseek_v3")
    tokenizer = spec.build_tokenizer_fn(cfg)
    assert tokenizer.get_vocab_size() == spec.model_args["debugmodel"].vocab_size == 2048
    inputs, labels = next(iter(spec.build_dataloader_fn(dp_world_size=1, dp_rank=0, tokenizer=tokenizer,
                                                         job_config=cfg)))
    assert inputs["input"].shape == labels.shape == (2, 256)

    def run(nproc, offload, status, mismatch=False):
        return {"nproc": nproc, "offload": offload, "status": status, "device_mismatch": mismatch, "error": "e"}
    assert repro.verdict([run(1, True, "failed", True), run(1, False, "ok")]).startswith("torchtitan's:")
    assert repro.verdict([run(1, True, "ok"), run(1, False, "ok")]).startswith("not reproduced")
    assert repro.verdict([run(1, True, "failed", True), run(1, False, "failed")]).startswith("inconclusive")
    assert repro.verdict([run(1, True, "oom"), run(1, False, "ok")]).startswith("torchtitan's, another error")
    text = "step:  1  loss: 8.1\nstep:  2  loss: 7.9\n"
    assert repro.steps_logged(text) == 2 and repro.steps_logged("nothing") == 0
    assert repro.DEVICE_MISMATCH.search("RuntimeError: Expected all tensors to be on the same device, but got index "
                                        "is on cuda:0, different from other tensors on cpu")
