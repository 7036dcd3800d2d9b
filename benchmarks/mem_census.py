"""One fake-world rank of a zoo model on CPU, its tensor bytes counted by where they were allocated
(mop_train.train.census), beside the plan's terms: finds what a GPU peak holds that the plan does not.

    python benchmarks/mem_census.py --model mop-241b --world 64 --layers 1 --seq-len 8192 --vocab 32768
    python benchmarks/mem_census.py ... --set moe_inter_dim=512 --flag --mop.moe.token_budget=2048 --out x.json

The rank is built and stepped by the loop's own build_run and train_step, exactly as
benchmarks/fake_world.py's child does (same flags: the config's layout, `--comm.mode fake_backend`,
SCO's host budget = every boundary), on a variant of the model small enough for this host (fewer
layers, shorter sequence, smaller vocabulary; the widths, experts and layout unchanged unless --set).
Each step's peak is reported with its make-up by allocation site, and the bytes that would be on the
host on a GPU (OffloadStreamAdamW's state, SCO's boundary buffers) are counted apart, since on CPU
both sides are one memory. Model taken from: torch's memory snapshot (_record_memory_history), which
attributes a CUDA peak to its allocation stacks; this is the same view for a CPU run.

Legend: W ranks, L layers, S sequence, V vocabulary.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import mop_train  # noqa: F401,E402  (the triton stand-in before torchtitan)

GIB = 2**30
HOST_SITES = ("ops/offload_adamw/state.py", "ops/offload_adamw/buckets.py", "ops/sco/host_buffer.py",
              "ops/offload_adamw/host_update.py")
"""Allocation sites whose tensors live on the host in a GPU run (pinned): counted apart here."""


def on_host(label: tuple) -> bool:
    """True for a census label whose storage a GPU run keeps on the host."""
    return any(label[1].startswith(site) for site in HOST_SITES)


def census_flags(model: str, world: int, seq_len: int, n_layers: int, dim: int, extra: list[str]) -> list[str]:
    """fake_world.py's flags for the point, SCO's budget = every boundary of `n_layers` blocks (bf16)."""
    from benchmarks.fake_world import base_flags, config_of

    flags = ["--job.config_file", config_of(model), *base_flags(seq_len, f"/tmp/mop_census/{model}-w{world}", 2)]
    return flags + ["--mop.sco.host_budget", str(_sco_bytes(model, seq_len, n_layers, dim))] + extra


def _sco_bytes(model: str, seq_len: int, n_layers: int, dim: int) -> int:
    from mop_train.config import load_job_config
    from benchmarks.fake_world import config_of
    from mop_train.models import zoo

    cfg = load_job_config(["--job.config_file", config_of(model)], model_flavors=zoo.names())
    return n_layers * cfg.training.local_batch_size * seq_len // cfg.mop.layout.seq_degree * dim * 2


def run(model: str, world: int, n_layers: int, seq_len: int, vocab: int | None, sets: dict, extra: list[str],
        steps: int = 2, resolution: int = 8 * 2**20) -> dict:
    """Build and step the rank under a StorageCensus; per step its peak, the peak's make-up by site
    (device side) and the plan of the built run."""
    from mop_train.config import load_job_config
    from mop_train.models import zoo
    from mop_train.plan.job import plan_from_parts
    from mop_train.train.build import build_run
    from mop_train.train.census import StepPhases, StorageCensus, group_labels
    from mop_train.train.loop import StepGuards, init_distributed, train_step
    from mop_train.train.reliability import NonFiniteGuard, StopFlag

    args = replace(zoo.get_model_args(model), n_layers=n_layers, **({"vocab_size": vocab} if vocab else {}), **sets)
    os.environ.update(WORLD_SIZE=str(world), RANK="0")
    flags = census_flags(model, world, seq_len, n_layers, args.dim, extra)
    cfg = load_job_config(flags, model_flavors=zoo.names())
    device = init_distributed(cfg.comm.init_timeout_seconds, cfg.comm.mode)
    census = StorageCensus("cpu", resolution=resolution, fp32_gemms=True)
    out = {"model": model, "world": world, "n_layers": n_layers, "seq_len": seq_len, "vocab": args.vocab_size,
           "sets": sets, "flags": flags, "steps": []}
    t0 = time.perf_counter()
    with census:
        census.phase = "build"
        run_ = build_run(cfg, device, model_args=args)
        share = next((o.device_fraction for o in run_.optimizers if hasattr(o, "device_fraction")), None)
        terms, host_terms = plan_from_parts(cfg, run_.layout.plan, run_.parts, run_.spec.args,
                                            run_.spec.total_params, device_fraction=share)
        print(f"built at {time.perf_counter() - t0:.1f} s", flush=True)
        out["plan_device_gib"] = sum(b for _, b, _ in terms) / GIB
        out["plan_terms_gib"] = {n: b / GIB for n, b, _ in terms}
        out["plan_host_gib"] = sum(b for _, b, _ in host_terms) / GIB
        with StepPhases(census, run_.optimizers):
            guards = StepGuards(NonFiniteGuard(cfg.mop.reliability, rank=0, world=1, device=device), StopFlag(),
                                run_.schedule_steps)
            batches = iter(run_.dataloader)
            for k in range(1, steps + 1):
                batch = [next(batches) for _ in range(run_.micro_batches)]
                census.phase = "forward"
                census.reset_peak()
                train_step(run_.parts, run_.layout, batch, run_.optimizers, run_.lr_schedulers,
                           max_norm=cfg.training.max_norm, bias_rate=cfg.mop.moe.bias_update_rate, device=device,
                           guards=guards, step=k)
                print(f"step {k} done at {time.perf_counter() - t0:.1f} s", flush=True)
                peak = census.peak_labels
                device_side = {lb: b for lb, b in peak.items() if not on_host(lb)}
                out["steps"].append({
                    "step": k, "peak_gib": census.peak_bytes / GIB, "peak_phase": census.peak_phase,
                    "device_peak_gib": sum(device_side.values()) / GIB,
                    "host_at_peak_gib": (sum(peak.values()) - sum(device_side.values())) / GIB,
                    "by_site_gib": {s: b / GIB for s, b in group_labels(device_side) if b > 2**20},
                    "by_phase_site_gib": {f"{p} | {s}": b / GIB for (p, s), b in
                                          group_labels(device_side, key=lambda lb: (lb[0], lb[1])) if b > 2**20},
                    "by_op_gib": {f"{s} | {o} {d}": b / GIB for (s, o, d), b in
                                  group_labels(device_side, key=lambda lb: (lb[1], lb[2], lb[3])) if b > 2**20}})
    return out


def report(out: dict) -> str:
    lines = [f"{out['model']} W={out['world']} L={out['n_layers']} S={out['seq_len']} V={out['vocab']} {out['sets']}",
             f"plan {out['plan_device_gib']:.3f} GiB: " + ", ".join(f"{n} {g:.3f}" for n, g in out["plan_terms_gib"].items())]
    for s in out["steps"]:
        lines.append(f"step {s['step']}: device-side peak {s['device_peak_gib']:.3f} GiB in {s['peak_phase']!r} "
                     f"(host-side alive then {s['host_at_peak_gib']:.3f})")
        lines += [f"    {g:9.3f}  {name}" for name, g in list(s["by_phase_site_gib"].items())[:40]]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mop-241b")
    ap.add_argument("--world", type=int, default=64)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=0, help="vocab_size override (0: the model's)")
    ap.add_argument("--set", action="append", default=[], help="MoEModelArgs field=int, e.g. moe_inter_dim=512")
    ap.add_argument("--flag", action="append", default=[], help="extra config flag, --key=value")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    sets = {k: int(v) for k, v in (s.split("=", 1) for s in a.set)}
    extra = [p for f in a.flag for p in f.split("=", 1)]
    out = run(a.model, a.world, a.layers, a.seq_len, a.vocab or None, sets, extra, steps=a.steps)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    print(report(out))


if __name__ == "__main__":
    main()
