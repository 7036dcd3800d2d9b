"""Training metrics: one console line, one `metrics.jsonl` record, TensorBoard and W&B per logged step.

    metrics = MetricLogger(cfg.metrics, dump_folder, rank=rank, device=device, run_config=cfg.to_dict(),
                           total_steps=cfg.training.steps, resume_step=train_state.step)
    metrics.log(step, {"loss": ..., "grad_norm": ..., "lr": ..., "tokens_per_s": ..., ...})

`{dump_folder}/metrics.jsonl` (rank 0) holds one JSON object per logged step with at least
step, loss, grad_norm, lr, tokens_per_s, peak_mem_gib, optimizer_s (the logged step's optimizer step
until the weights are ready for the next forward), run_elapsed_s and eta_s (this launch's
time since its first step, and the time left at its pace so far): scripts, sweeps and tests read it.
The console line reads `step 120/200 ... elapsed 0:01:23 eta 0:00:55`.
A run resumed from step N (or started afresh, N = 0) first moves the file's records past step N,
logged by a run that got further than its checkpoint, to `metrics.jsonl.superseded-<UTC time>`
(with any line that is not a record, such as one cut short by a crash), so the file reads as one
run; its TensorBoard writer purges events from step N+1 on (`SummaryWriter(purge_step=N+1)`, the
way TensorBoard drops the steps of a crashed run). W&B keeps what it was sent.
TensorBoard events go to `{dump_folder}/{metrics.save_tb_folder}` when enabled; W&B (torchtitan's
WandBLogger, offline when WANDB_MODE=offline) when enabled. Peak memory is the device allocator's
peak on GPU and the process's peak resident set on CPU (`peak_mem_kind` says which).
MFU divides achieved TFLOP/s by the device's dense bf16 peak (known devices only).
The file is strict JSON: a NaN/inf value is written as null and its key listed under "nonfinite";
a step skipped for non-finite values (mop.reliability.on_nonfinite) is always logged, with
"skipped": true and "skipped_steps" (the run's count so far).
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time

import torch
from torch.utils.tensorboard import SummaryWriter
from torchtitan.components.metrics import TensorBoardLogger, WandBLogger

GIB = 2**30
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}
"""Dense bf16 peak TFLOP/s per device, matched against the CUDA device name."""


def peak_tflops(device: torch.device, configured: float = 0.0) -> float | None:
    """MFU's denominator: `configured` ([mop.metrics] peak_tflops) when > 0, else the datasheet's
    dense bf16 peak of the CUDA device by name; None (no MFU) on CPU or an unknown device."""
    if device.type != "cuda":
        return None
    if configured > 0:
        return float(configured)
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


class DeviceSpan:
    """The duration of a span of device work, measured without a host sync: CUDA events on the
    current stream on GPU, wall clock on CPU. Read `seconds()` once the device has caught up (the
    loop synchronises before it logs).

        span = DeviceSpan(device)
        with span:
            optimizers.step()
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.start = self.end = None

    def __enter__(self):
        if self.cuda:
            self.start, self.end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            self.start.record()
        else:
            self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.end.record()
        else:
            self.end = time.perf_counter()
        return False

    def seconds(self) -> float:
        if self.cuda:
            self.end.synchronize()
            return self.start.elapsed_time(self.end) / 1e3
        return self.end - self.start


def peak_memory_gib(device: torch.device) -> tuple[float, str]:
    """(peak GiB, kind): CUDA allocator peak on GPU, peak resident set of this process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GIB, "cuda_max_allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss * (1 if sys.platform == "darwin" else 1024) / GIB, "host_max_rss"


def flops_per_token(args, seq_len: int, *, active_params: int) -> float:
    """Model FLOPs per trained token: the one count of benchmarks/e2e_vs_torchtitan.py's table for
    both sides (ours and torchtitan's DeepSeek-V3 at the same shape) and of the loop's TFLOP/s.

        F(S) = 6 * (active_params - V * H)  +  3 * L * h * (d_qk + d_v) * S

    6 per parameter a token multiplies (2 forward, 4 backward): the active parameters (shared and
    k of E routed experts, router, attention and dense weights, the output projection) less the
    input embedding, a lookup. Attention: the score (q k^T, d_qk wide) and value (p v, d_v wide)
    matmuls cost 2 * S_keys * h * (d_qk + d_v) forward per token and layer; causal, a token sees
    S/2 keys on average, so x3 for training gives 3 * L * h * (d_qk + d_v) * S. Recompute
    (activation checkpointing, the flash backward's replay) is not counted. torchtitan's
    get_moe_model_nparams_and_flops (models/utils.py) counts the same 6N but the attention term
    without the causal half (6 * L * h * (d_qk + d_v) * S).

    Args:
        args: the model's MoEModelArgs (dim, vocab_size, n_layers, n_heads, attention, head widths).
        seq_len: S, the whole sequence a token attends within (not a sequence shard S/D).
        active_params: parameters one token touches (zoo.param_counts(...)["active"]).
    """
    d_v = args.v_head_dim if args.attention == "mla" else args.head_dim
    weights = active_params - args.vocab_size * args.dim
    return 6.0 * weights + 3.0 * args.n_layers * args.n_heads * (args.qk_head_dim + d_v) * seq_len


class PurgingTensorBoardLogger(TensorBoardLogger):
    """torchtitan's TensorBoardLogger whose SummaryWriter purges the events at or after
    `purge_step` that earlier writers left in the folder (TensorBoard hides them)."""

    def __init__(self, log_dir: str, *, purge_step: int):
        self.tag = None
        self.writer = SummaryWriter(log_dir, max_queue=1000, purge_step=purge_step)


class MetricLogger:
    """Console + metrics.jsonl (rank 0) + TensorBoard + W&B for one run."""

    def __init__(self, metrics, dump_folder: str, *, rank: int, device: torch.device, run_config: dict,
                 total_steps: int | None = None, resume_step: int = 0):
        """Args:
            metrics: the `[metrics]` section (log_freq, enable_tensorboard, save_tb_folder,
                save_for_all_ranks, enable_wandb).
            total_steps: training.steps (the `/200` of `step 120/200` and the ETA); None: neither.
            resume_step: the step the run resumed from (0: a fresh start); later records go aside.
        """
        self.rank, self.device = rank, device
        self.total_steps, self.resume_step = total_steps, resume_step
        self.start = time.perf_counter()
        self.log_freq = metrics.log_freq
        self.jsonl_path = os.path.join(dump_folder, "metrics.jsonl")
        self.tb_dir = os.path.join(dump_folder, metrics.save_tb_folder)
        self.wandb_dir = os.path.join(dump_folder, "wandb")
        if metrics.save_for_all_ranks:
            self.tb_dir = os.path.join(self.tb_dir, f"rank_{rank}")
        writes = rank == 0 or metrics.save_for_all_ranks
        self.loggers = []
        if writes and metrics.enable_tensorboard:
            self.loggers.append(PurgingTensorBoardLogger(self.tb_dir, purge_step=resume_step + 1))
        if writes and metrics.enable_wandb:
            self.loggers.append(WandBLogger(self.wandb_dir, _AsDict(run_config)))
        self._jsonl = None
        self.note = None   # what was moved aside (rank 0), printed by the loop
        if rank == 0:
            os.makedirs(dump_folder, exist_ok=True)
            self.note = supersede_records(self.jsonl_path, after_step=resume_step)
            self._jsonl = open(self.jsonl_path, "a")

    def should_log(self, step: int, last_step: bool) -> bool:
        return step == 1 or last_step or step % self.log_freq == 0

    def log(self, step: int, values: dict) -> None:
        """Write one record (all ranks call this; rank 0 prints and writes the jsonl)."""
        peak, kind = peak_memory_gib(self.device)
        record = strict_json_record({"step": step, **values, "peak_mem_gib": peak, "peak_mem_kind": kind,
                                     **self._progress(step)})
        for logger in self.loggers:
            logger.log({k: v for k, v in record.items() if isinstance(v, (int, float))
                        and not isinstance(v, bool) and k not in ("step", "total_steps")}, step)
        if self._jsonl is None:
            return
        self._jsonl.write(json.dumps(record, allow_nan=False) + "\n")
        self._jsonl.flush()
        print(format_line(record), flush=True)

    def _progress(self, step: int) -> dict:
        """total_steps, run_elapsed_s and eta_s (None until a step of this launch has run)."""
        elapsed = time.perf_counter() - self.start
        done = step - self.resume_step
        if self.total_steps is None:
            return {"run_elapsed_s": elapsed}
        eta = elapsed / done * max(self.total_steps - step, 0) if done > 0 else None
        return {"total_steps": self.total_steps, "run_elapsed_s": elapsed, "eta_s": eta}

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()
        if self._jsonl is not None:
            self._jsonl.close()


def strict_json_record(record: dict) -> dict:
    """NaN/inf floats -> None, their keys listed under "nonfinite" (strict JSON parsers reject NaN)."""
    bad = [k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)]
    if not bad:
        return record
    return {**{k: (None if k in bad else v) for k, v in record.items()}, "nonfinite": bad}


def supersede_records(path: str, *, after_step: int) -> str | None:
    """Move the records of `path` whose step is past `after_step` (and any line that is not a
    record) to `path.superseded-<UTC time>`, keeping the rest in order; returns a note for the log,
    or None when nothing moved."""
    if not os.path.isfile(path):
        return None
    keep, gone, steps = [], [], []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            try:
                step = json.loads(line)["step"]
                later = not isinstance(step, int) or step > after_step
            except (ValueError, KeyError, TypeError):
                step, later = None, True
            (gone if later else keep).append(line if line.endswith("\n") else line + "\n")
            if later and isinstance(step, int):
                steps.append(step)
    if not gone:
        return None
    aside = f"{path}.superseded-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    with open(aside, "a") as f:
        f.writelines(gone)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(keep)
    os.replace(tmp, path)
    span = f" (steps {min(steps)}-{max(steps)})" if steps else ""
    odd = len(gone) - len(steps)
    return (f"{path}: moved the {len(steps)} records past step {after_step}{span}"
            + (f" and {odd} unreadable line{'s' if odd > 1 else ''}" if odd else "")
            + f", written by a run that went on past the checkpoint resumed from, to {aside}")


def _num(value, spec: str) -> str:
    return "nan" if value is None else format(value, spec)


def _clock(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def format_line(r: dict) -> str:
    total = r.get("total_steps")
    step = f"{r['step']:>{len(str(total))}}/{total}" if total else f"{r['step']:>5}"
    line = f"step {step}"
    if "run_elapsed_s" in r:
        line += f"  elapsed {_clock(r['run_elapsed_s'])}" + (f"  eta {_clock(r.get('eta_s'))}" if total else "")
    line += (f"  loss {_num(r['loss'], '.4f')}  grad_norm {_num(r['grad_norm'], '.4f')}  "
             f"lr {r['lr']:.3e}  tokens/s {r['tokens_per_s']:,.0f}")
    if r.get("skipped"):
        line += f"  SKIPPED (non-finite {', '.join(r.get('nonfinite', []))}; {r['skipped_steps']} so far)"
    if r.get("tflops") is not None:
        line += f"  TFLOP/s {r['tflops']:.1f}"
    if r.get("mfu_pct") is not None:
        line += f"  MFU {r['mfu_pct']:.1f}%"
    line += f"  peak_mem {r['peak_mem_gib']:.2f} GiB"
    if r.get("micro_batches", 1) > 1:
        line += f"  micro-batches {r['micro_batches']}"
    if r.get("optimizer_s") is not None:
        line += f"  opt {1e3 * r['optimizer_s']:.0f} ms"
    if r.get("optimizer_exposed_s") is not None:
        line += f" (exposed {1e3 * r['optimizer_exposed_s']:.0f} ms)"
    if r.get("offload_h2d_gib") is not None:
        line += f"  link h2d {r['offload_h2d_gib']:.2f} d2h {r['offload_d2h_gib']:.2f} GiB"
    if "sco_offloaded_layers" in r:
        line += (f"  sco {r['sco_offloaded_layers']} layers {r['sco_host_bytes'] / 2**30:.2f} GiB host "
                 f"wait {1e3 * r['sco_wait_s']:.1f} ms")
    if "moe_num_chunks" in r:
        line += (f"  moe K {r['moe_num_chunks']} relocated {r['moe_relocated_routes']:,} "
                 f"max_recv/chunk {r['moe_max_received_per_chunk']:,}")
    if r.get("fake_world"):
        line += f"  [{r['fake_world']}]"
    return line


class _AsDict:
    """What torchtitan's WandBLogger reads from a job config: `to_dict()`."""

    def __init__(self, config: dict):
        self._config = config

    def to_dict(self) -> dict:
        return self._config
