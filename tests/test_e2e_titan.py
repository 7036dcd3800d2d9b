"""The torchtitan side of the end-to-end comparison (benchmarks/titan_launch.py, e2e_settings.py,
e2e_vs_torchtitan.py), checked on CPU: the DeepSeek-V3 flavor's parameter count equals ours, every
setting's flags parse into torchtitan's JobConfig, its dataloader over our embedded corpus and
tokenizer yields batches, its metrics are read as written, and the comparison's plan records every
point (ok / oom / failed / skipped) with a fake launcher. torchtitan's Trainer itself runs on CUDA
only (it takes its device type from the machine and builds NCCL groups): that test carries `gpu`."""

import json
import os
import subprocess

import pytest

from benchmarks import e2e_vs_torchtitan as e2e
from benchmarks import titan_launch
from benchmarks.e2e_settings import (AutoSetting, AutoSettings, TitanSetting, all_operators, candidates, our_command,
                                     read_titan_metrics, titan_command, titan_flags)

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


def test_every_candidate_setting_parses_into_torchtitans_config(tmp_path):
    settings = {s for kinds in candidates(2, 1).values() for lst in kinds.values() for s in lst
                if isinstance(s, TitanSetting)}
    assert len(settings) >= 6
    for s in settings:
        cfg = parse(titan_flags(str(tmp_path), s, flavor="small", seq_len=32768, local_batch=1, steps=2,
                                timeout_s=100, hf_assets_path=str(tmp_path)))
        assert (cfg.parallelism.context_parallel_degree, cfg.parallelism.expert_parallel_degree) == (s.cp, s.ep)
        assert cfg.activation_checkpoint.mode == s.ac and cfg.training.enable_cpu_offload == s.offload
        assert cfg.compile.enable == (s.compile != "off")
        if s.compile != "off":
            assert cfg.compile.components == s.compile.split("+")
        assert cfg.model.name == titan_launch.SPEC_NAME and cfg.training.seq_len == 32768
        assert cfg.comm.train_timeout_seconds >= 100 and cfg.metrics.log_freq == 1
    cmd = titan_command(2, str(tmp_path), TitanSetting(), flavor="small", seq_len=8, local_batch=1, steps=2,
                        timeout_s=10)
    assert cmd[cmd.index("-m", 2) + 1] == "benchmarks.titan_launch"


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


class FakeBench(e2e.Bench):
    """The plan against a fake machine: torchtitan completes up to 100K tokens, ours up to 300K;
    the first torchtitan throughput setting is broken; every run costs no time."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.launched = []

    def _launch(self, series, setting, seq_len, local_batch, steps, limit):
        self.launched.append((series, setting.name, seq_len, local_batch))
        if series == e2e.TITAN and setting == self.cands[e2e.TITAN]["tps"][0]:
            return {"status": "failed", "seconds": 1.0, "error": "RuntimeError: broken"}
        top = 100_000 if series == e2e.TITAN else 300_000
        if seq_len * local_batch > top:
            return {"status": "oom", "seconds": 1.0, "error": "CUDA out of memory"}
        return {"status": "ok", "seconds": 1.0, "steps": steps, "tokens_per_s": 1e9 / seq_len,
                "peak_mem_gib": seq_len / 1e4, "tflops": 1.0}


def test_plan_records_every_point_and_the_headline(tmp_path, capsys):
    args = e2e.parse_args(["--out", str(tmp_path), "--budget-s", "1000", "--max-seq", "1048576",
                           "--max-batch", "64"])
    bench = FakeBench(args, candidates(2, 1), assets="/nowhere", titan_error=None, meta={})
    for name in args.phases:
        bench.phase(name)
    h = bench.headline()
    assert h["reach"]["torchtitan"]["largest_ok"] == 98304 and h["reach"]["torchtitan"]["stopped_by"] == "oom"
    assert h["reach"]["ours-all"]["largest_ok"] == 294912
    assert h["titan_longest_seq"] == 98304 and h["tps_at_titan_longest"]["ours-all"] is not None
    assert h["tps_at_start_seq"]["torchtitan"]["setting"] != candidates(2, 1)["torchtitan"]["tps"][0].name
    assert h["batch_at_batch_seq"]["torchtitan"]["largest_ok"] == 12  # 12 x 8192 <= 100K < 13 x 8192
    statuses = {p["status"] for p in bench.points}
    assert statuses == {"ok", "oom", "failed"}
    broken = candidates(2, 1)["torchtitan"]["tps"][0].name
    assert sum(1 for s, n, *_ in bench.launched if n == broken) == 1, "a broken setting runs once"
    assert len(bench.launched) == len(set(bench.launched)), "no run is made twice"
    bench.save(plot=False)
    saved = json.loads((tmp_path / "e2e.json").read_text())
    assert len(saved["points"]) == len(bench.points) and saved["headline"]["titan_longest_seq"] == 98304
    assert (tmp_path / "e2e.csv").read_text().startswith("series,")
    print(e2e.format_headline(h))
    assert "s] torchtitan" in capsys.readouterr().out, "progress lines carry the elapsed time"


def test_plan_skips_what_the_budget_cannot_fit_and_titan_import_errors(tmp_path):
    args = e2e.parse_args(["--out", str(tmp_path), "--budget-s", "0"])
    bench = FakeBench(args, candidates(2, 1), assets="/nowhere", titan_error="ImportError: no", meta={})
    for name in args.phases:
        bench.phase(name)
    assert not bench.launched
    assert {p["status"] for p in bench.points if p["series"] == e2e.TITAN} == {"failed"}
    assert {p["status"] for p in bench.points if p["series"] != e2e.TITAN} == {"skipped"}
    assert bench.headline()["reach"]["ours-all"]["stopped_by"] == "budget"


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


def test_a_timeout_under_the_budgets_limit_ends_the_search_as_budget(tmp_path):
    class Slow(FakeBench):
        def _launch(self, series, setting, seq_len, local_batch, steps, limit):
            return {"status": "timeout", "seconds": limit, "error": f"killed after {limit} s"}

    args = e2e.parse_args(["--out", str(tmp_path), "--budget-s", "100", "--point-timeout-s", "150",
                           "--phases", "reach-ours"])
    bench = Slow(args, candidates(2, 1), assets="/nowhere", titan_error=None, meta={})
    bench.phase("reach-ours")
    assert bench.points[0]["status"] == "timeout" and bench.points[0]["budget_cut"]
    assert bench.headline()["reach"]["ours-all"] == {"largest_ok": None, "smallest_not_ok": None,
                                                    "not_ok_status": None, "stopped_by": "budget"}


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


class StubAuto:
    """The planner's answers without planning: fits up to 200K tokens."""

    def __init__(self):
        self.asked = []

    def at(self, seq_len, local_batch):
        self.asked.append((seq_len, local_batch))
        if seq_len > 200_000:
            return None
        return AutoSetting(("--mop.layout.seq_degree", "1"), f"D1 S{seq_len}", 1, 1e4, 50.0)


def test_the_bench_runs_ours_auto_at_each_point_and_records_what_it_skips(tmp_path):
    args = e2e.parse_args(["--out", str(tmp_path), "--budget-s", "1000", "--max-seq", "1048576",
                           "--phases", "tps32k", "reach-titan-double", "tps-at-titan-max"])
    stub = StubAuto()
    bench = FakeBench(args, candidates(2, 1), assets="/nowhere", titan_error=None, meta={}, auto=stub)
    for name in args.phases:
        bench.phase(name)
    auto_points = [p for p in bench.points if p["series"] == e2e.OURS_AUTO]
    assert {p["seq_len"] for p in auto_points} == {32768, 65536}, "the start context and torchtitan's longest"
    assert all(p["status"] == "ok" and p["flags"] == "--mop.layout.seq_degree 1" and p["predicted_tokens_per_s"] == 1e4
               for p in auto_points)
    assert bench.headline()["tps_at_start_seq"][e2e.OURS_AUTO]["setting"] == "auto-D1S32768"
    bench.auto.at = lambda seq_len, local_batch: None
    bench.best_of(e2e.OURS_AUTO, "tps", seq_len=262144, local_batch=1, steps=2, purpose="tps")
    assert bench.points[-1]["status"] == "skipped" and "plan --auto" in bench.points[-1]["error"]
