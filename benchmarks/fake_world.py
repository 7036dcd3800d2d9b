"""One rank of the paper's jobs on one GPU (`--comm.mode fake_backend`): its peak memory beside the
plan's total, and the compute time of its step with every collective a local stand-in (issue 35).

    python benchmarks/fake_world.py list                          # points: layers, plan, host, time estimate (CPU)
    python benchmarks/fake_world.py smoke --out $OUT              # GPU path check: debug widened, W=64 (~1 min)
    python benchmarks/fake_world.py run mop-37b-w8-64k --out $OUT # one point (< 600 s): JSON under --out
    python benchmarks/fake_world.py run mop-241b-w64-1024k --snapshot --out $OUT   # + torch memory snapshot
    python benchmarks/fake_world.py run mop-241b-w64-64k --census --out $OUT       # + the peak's make-up by site
    python benchmarks/fake_world.py peak benchmarks/results/h200_2026-12-03/mop-667b-w64-256k_snapshot.pickle.gz

Points: mop-37b at W=8; mop-120b at W=16 and 64; mop-241b and mop-667b at W=64; each at 64K, 256K and
1M tokens, with the layout (D, E_p, P) and operators of configs/mop_*.toml, rank 0, the balanced routing
profile. One rank's host state (OffloadStreamAdamW's fp32 master and moments of its parameters, and
SCO's boundaries: all of them, as the configs' "auto" budget means on a 2 TiB node) must fit this host
(--host-limit, default 112 GiB of the H200 machine's 128): a model whose state does not runs its
largest layer count that does, named in the point (`n_layers`, `MoEModelArgs` otherwise unchanged).
A point runs in a child process (`child`: WORLD_SIZE=W RANK=0, the loop's own build_run and
train_step), which records max_memory_allocated after each step, the step's wall time (collectives
are local copies: compute, the host link and the stand-ins), and the plan of the built run
(mop_train.plan.job.plan_from_parts, the one the launch prints). Model taken from: Megatron-LM's
--fake-process-group with --record-memory-history (one rank of a large job profiled on one GPU).

Legend: W ranks, D / E_p / P degrees, S context, L layers, N = S / D tokens per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import replace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
GIB = 2**30
JOBS = [("mop-37b", 8), ("mop-120b", 16), ("mop-120b", 64), ("mop-241b", 64), ("mop-667b", 64)]
CONTEXTS = (65536, 262144, 1048576)
SETUP_S = 90.0
"""Estimated setup of a point on the H200 before its first step: imports, building and initialising the
shards, pinning OffloadStreamAdamW's host state (~100 GB)."""


def config_of(model: str) -> str:
    """configs/<model>.toml (mop-241b -> mop_241b.toml), else the one-GPU config (small -> small_1gpu.toml)."""
    name = os.path.join(ROOT, "configs", model.replace("mop-", "mop_"))
    if not os.path.isfile(name + ".toml") and os.path.isfile(name + "_1gpu.toml"):
        return name + "_1gpu.toml"
    return name + ".toml"   # (when missing, the config loader names it)


def point_name(model: str, world: int, seq_len: int) -> str:
    return f"{model}-w{world}-{seq_len // 1024}k"


def base_flags(seq_len: int, dump: str, steps: int) -> list[str]:
    return ["--training.seq_len", str(seq_len), "--training.steps", str(steps), "--checkpoint.no-enable",
            "--metrics.no-enable-tensorboard", "--metrics.log_freq", "1", "--job.dump_folder", dump,
            "--comm.mode", "fake_backend"]


def host_plan(cfg, args, world: int) -> tuple[int, int]:
    """(host bytes of one rank with every checkpointed boundary on the host, that SCO budget) for the
    job `cfg` on `world` ranks with model `args` (a meta model: no memory)."""
    import torch

    from mop_train.layout import plan_layout
    from mop_train.models.model import MoETransformer
    from mop_train.ops.offload_adamw import OFFLOAD_ADAMW
    from mop_train.parallel.parallelize import checkpointed_layer_ids
    from mop_train.parallel.precision import MixedPrecision
    from mop_train.plan.job import local_param_count
    from mop_train.plan.terms import host_memory_plan

    lay, t = cfg.mop.layout, cfg.training
    layout = plan_layout(world, lay.seq_degree, lay.expert_degree, lay.vocab_degree)
    with torch.device("meta"):
        model = MoETransformer(args)
    local = local_param_count(model, layout, dispatch=cfg.mop.moe.dispatch)
    act = MixedPrecision.from_training(t).activation_bytes
    layers = len(checkpointed_layer_ids(cfg.activation_checkpoint, args.n_layers))
    sco = layers * t.local_batch_size * t.seq_len // lay.seq_degree * args.dim * act
    terms = host_memory_plan(local, offload_optimizer=cfg.optimizer.name == OFFLOAD_ADAMW,
                             host_fraction=cfg.mop.offload_adamw.host_fraction, sco_host_budget=sco)
    return sum(b for _, b, _ in terms), sco


def resolve_point(model: str, world: int, seq_len: int, host_limit: int, steps: int = 2) -> dict:
    """A point's flags, its layer count (the largest whose host state fits `host_limit`) and plan."""
    from mop_train.config import load_job_config
    from mop_train.models import zoo

    full = zoo.get_model_args(model)
    name = point_name(model, world, seq_len)
    flags = base_flags(seq_len, f"/tmp/mop_fake_world/{name}", steps)
    cfg = load_job_config(["--job.config_file", config_of(model), *flags], model_flavors=zoo.names())
    for layers in range(full.n_layers, 0, -1):
        args = replace(full, n_layers=layers)
        host, sco = host_plan(cfg, args, world)
        if host <= host_limit:
            break
    flags += ["--mop.sco.host_budget", str(sco)]
    return {"name": name, "model": model, "world": world, "seq_len": seq_len, "n_layers": layers,
            "full_layers": full.n_layers, "host_gib": host / GIB, "host_fits": host <= host_limit,
            "config": os.path.relpath(config_of(model), ROOT), "flags": flags}


def estimate_seconds(point: dict) -> float:
    """Setup plus one step as the ranking model predicts it without the communication terms
    (Ulysses, dispatch), scaled by the share of layers run (mop_train.plan.cost_model)."""
    from mop_train.config import load_job_config
    from mop_train.models import zoo
    from mop_train.plan.auto import AutoPlanner
    from mop_train.plan.settings import settings_of

    cfg = load_job_config(["--job.config_file", os.path.join(ROOT, point["config"]), *point["flags"]],
                          model_flavors=zoo.names())
    planner = AutoPlanner(cfg, fixed=set(), world=point["world"], ranks_per_node=min(point["world"], 8),
                          gpu_bytes=141 * GIB, host_bytes=2 * 1024 * GIB)
    terms = planner.predict(settings_of(cfg)).terms
    step = sum(sec for name, sec, _ in terms if name not in ("ulysses", "dispatch"))
    return SETUP_S + step * point["n_layers"] / point["full_layers"]


def all_points(host_limit: int) -> list[dict]:
    return [resolve_point(m, w, s, host_limit) for m, w in JOBS for s in CONTEXTS]


# ---------------------------------------------------------------------------------------------
# The child: one fake rank, built and stepped by the loop's own functions
# ---------------------------------------------------------------------------------------------

def child(point: dict, steps: int, snapshot: str | None, model_args=None) -> dict:
    import torch

    from mop_train.config import load_job_config
    from mop_train.models import zoo
    from mop_train.plan.job import plan_from_parts
    from mop_train.plan.terms import format_plan
    from mop_train.train.build import build_run
    from mop_train.train.loop import StepGuards, init_distributed, train_step
    from mop_train.train.metrics import peak_memory_gib
    from mop_train.train.reliability import NonFiniteGuard, StopFlag

    cfg = load_job_config(["--job.config_file", os.path.join(ROOT, point["config"]), *point["flags"]],
                          model_flavors=zoo.names())
    device = init_distributed(cfg.comm.init_timeout_seconds, cfg.comm.mode)
    if model_args is None:
        model_args = replace(zoo.get_model_args(point["model"]), n_layers=point["n_layers"])
    start = time.perf_counter()
    run = build_run(cfg, device, model_args=model_args)
    share = next((o.device_fraction for o in run.optimizers if hasattr(o, "device_fraction")), None)
    plan_terms, host_terms = plan_from_parts(cfg, run.layout.plan, run.parts, run.spec.args,
                                             run.spec.total_params, device_fraction=share)
    out = {**point, "device": str(torch.cuda.get_device_name(device)) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "setup_s": time.perf_counter() - start,
           "plan_device_gib": sum(b for _, b, _ in plan_terms) / GIB,
           "plan_terms_gib": {n: b / GIB for n, b, _ in plan_terms},
           "plan_host_gib": sum(b for _, b, _ in host_terms) / GIB, "steps": []}
    print(format_plan(plan_terms), flush=True)
    guards = StepGuards(NonFiniteGuard(cfg.mop.reliability, rank=0, world=1, device=device), StopFlag(),
                        run.schedule_steps)
    batches = iter(run.dataloader)
    census = _census(point, device, run.optimizers)
    for step in range(1, steps + 1):
        if census is not None:
            census[0].phase = "forward"
            census[0].reset_peak()
        batch = [next(batches) for _ in range(run.micro_batches)]
        last = step == steps
        if last and snapshot and device.type == "cuda":
            torch.cuda.memory._record_memory_history(stacks="python", max_entries=SNAPSHOT_EVENTS)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        res = train_step(run.parts, run.layout, batch, run.optimizers, run.lr_schedulers,
                         max_norm=cfg.training.max_norm, bias_rate=cfg.mop.moe.bias_update_rate, device=device,
                         guards=guards, step=step)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t0
        peak, kind = peak_memory_gib(device)
        out["steps"].append({"step": step, "seconds": seconds, "optimizer_s": res["optimizer_span"].seconds()
                             if not res["verdict"].skip else None, "peak_gib": peak, "peak_kind": kind,
                             "skipped": res["verdict"].skip, "dispatch": res["dispatch"]})
        print(f"step {step}: {seconds:.2f} s, peak {peak:.2f} GiB ({kind})", flush=True)
        if census is not None:
            out["steps"][-1]["census"] = _census_record(census[0])
            print(json.dumps(out["steps"][-1]["census"], indent=1), flush=True)
        if last and snapshot and device.type == "cuda":
            out["snapshot"] = write_snapshot(torch.cuda.memory._snapshot(), snapshot)
            torch.cuda.memory._record_memory_history(enabled=None)
    if census is not None:
        for part in reversed(census):
            part.__exit__(None, None, None)
    out["measured_gib"] = max(s["peak_gib"] for s in out["steps"])
    out["plan_over_measured"] = out["plan_device_gib"] / out["measured_gib"]
    return out


SNAPSHOT_EVENTS = 150_000
SNAPSHOT_LIMIT = 15 * 2**20
"""Allocator events the snapshot keeps (the step's last ones: backward's peak and the optimizer), and the
largest gzipped file the device machine returns (16 MiB a file)."""


def write_snapshot(snap: dict, path: str) -> dict:
    """Write torch's memory snapshot gzipped at `path` + ".gz", its stacks cut to the frames that name
    an allocation's owner (ours, FSDP2's), fewer of them until it fits SNAPSHOT_LIMIT; the file opens in
    https://pytorch.org/memory_viz after gunzip. Returns where it went, its size and the frames kept."""
    import gzip
    import pickle

    def owners(frames, keep):
        ours = [f for f in frames if "mop_train" in f["filename"] or "fsdp" in f["filename"]]
        return (ours or frames)[:keep]

    events = [e for trace in snap["device_traces"] for e in trace]
    blocks = [b for seg in snap["segments"] for b in seg["blocks"]]
    full = {id(x): x.get("frames", []) for x in events + blocks}
    for keep in (8, 4, 2, 1):
        for x in events + blocks:
            x["frames"] = owners(full[id(x)], keep)
        with gzip.open(path + ".gz", "wb", compresslevel=9) as f:
            pickle.dump(snap, f)
        size = os.path.getsize(path + ".gz")
        if size <= SNAPSHOT_LIMIT:
            break
    return {"path": path + ".gz", "bytes": size, "frames_kept": keep, "events": len(events)}


def snapshot_peak(path: str, top: int = 15) -> dict:
    """The allocations alive at the largest total inside a `write_snapshot` file's event window, grouped
    by their first frame of ours (file:line function): the peak's make-up, read offline. Walks the events
    back from the blocks alive at the dump; an allocation made before the window and freed inside it is
    counted as made before the window, one alive at the dump without a stack as made before recording
    began (the snapshot records the last step only)."""
    import gzip
    import pickle

    if not os.path.isfile(path):
        raise SystemExit(f"peak: {path} is not a file; pass a snapshot `run --snapshot` wrote "
                         f"(<out>/<point>_snapshot.pickle.gz)")
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        snap = pickle.load(f)
    events = [e for trace in snap.get("device_traces", []) for e in trace]
    if not events:
        raise SystemExit(f"peak: {path} holds no allocator events (a snapshot taken without "
                         f"torch.cuda.memory._record_memory_history); nothing to replay")
    live = {b["address"]: (b["size"], b.get("frames", [])) for seg in snap["segments"]
            for b in _block_addresses(seg) if b["state"] == "active_allocated"}
    total = sum(size for size, _ in live.values())
    best, best_at, alive_at_best = total, len(events), dict(live)
    for i in range(len(events) - 1, -1, -1):
        e = events[i]
        if e["action"] == "alloc":
            live.pop(e["addr"], None)
            total -= e["size"]
        elif e["action"] == "free_requested":
            live[e["addr"]] = (e["size"], None)
            total += e["size"]
        else:
            continue
        if total > best:
            best, best_at, alive_at_best = total, i, dict(live)
    made_in_window = {e["addr"]: e.get("frames", []) for e in events[:best_at] if e["action"] == "alloc"}
    groups: dict[str, int] = {}
    for addr, (size, frames) in alive_at_best.items():
        if addr in made_in_window:
            frames = made_in_window[addr]
            key = _owner(frames) if frames else "no Python stack (made on autograd's backward thread)"
        else:
            key = ("made in the step, before the window" if frames is None else _owner(frames) if frames
                   else "made before recording began (parameters, optimizer state)")
        groups[key] = groups.get(key, 0) + size
    ranked = sorted(groups.items(), key=lambda kv: -kv[1])
    return {"peak_gib": best / GIB, "event": best_at, "events": len(events),
            "make_up_gib": {k: round(b / GIB, 3) for k, b in ranked[:top]},
            "rest_gib": round(sum(b for _, b in ranked[top:]) / GIB, 3)}


def _block_addresses(segment: dict):
    """A segment's blocks with their addresses (the snapshot stores only the segment's base and sizes)."""
    address = segment["address"]
    for block in segment["blocks"]:
        yield {**block, "address": address}
        address += block["size"]


def _owner(frames: list) -> str:
    for f in frames:
        if "mop_train" in f["filename"]:
            return f"{f['filename'].split('mop_train/')[-1]}:{f['line']} {f['name']}"
    return f"{frames[0]['filename'].rsplit('/', 1)[-1]}:{frames[0]['line']} {frames[0]['name']}"


def _census(point: dict, device, optimizers):
    """`--census`: (StorageCensus, StepPhases) entered on the run's device, or None. Storages made before
    the first step (parameters, gradients of step 0, OffloadStreamAdamW's staging) are not counted, so
    the census peak is the step's own allocations beside `peak_gib`'s total (mop_train.train.census)."""
    if not point.get("census"):
        return None
    from mop_train.train.census import StepPhases, StorageCensus

    census = StorageCensus(device.type, resolution=64 * 2**20)
    phases = StepPhases(census, optimizers)
    census.__enter__()
    phases.__enter__()
    return census, phases


def _census_record(census) -> dict:
    """The step's census peak, its phase, and its make-up by (phase, site, op, dtype), largest first (GiB)."""
    from mop_train.train.census import group_labels

    parts = group_labels(census.peak_labels, key=lambda lb: " | ".join(lb))
    return {"peak_gib": census.peak_bytes / GIB, "phase": census.peak_phase,
            "make_up_gib": {k: round(b / GIB, 4) for k, b in parts[:40] if b >= 2**24}}


def run_point(point: dict, *, steps: int, snapshot: bool, out_dir: str, timeout_s: float) -> dict:
    """`child` in a fresh process (WORLD_SIZE=W RANK=0); its JSON line, or how it failed (log kept)."""
    os.makedirs(out_dir, exist_ok=True)
    log_path = os.path.join(out_dir, f"{point['name']}.log")
    snap = os.path.join(out_dir, f"{point['name']}_snapshot.pickle") if snapshot else ""
    env = {**os.environ, "WORLD_SIZE": str(point["world"]), "RANK": "0",
           "PYTHONPATH": os.pathsep.join([ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
           "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")}
    cmd = [sys.executable, os.path.abspath(__file__), "child", json.dumps(point), str(steps), snap]
    start = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    text = open(log_path).read()
    lines = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
    result = json.loads(lines[-1][7:]) if lines else {**point, "error": _failure(text)}
    result.update(rc=rc, wall_s=time.perf_counter() - start, log=log_path)
    with open(os.path.join(out_dir, f"{point['name']}.json"), "w") as f:
        json.dump(result, f, indent=1)
    return result


def _failure(text: str) -> str:
    oom = [ln for ln in text.splitlines() if "out of memory" in ln.lower() or "Tried to allocate" in ln]
    errors = [ln for ln in text.splitlines() if "Error" in ln]
    return (oom or errors or text.splitlines()[-1:] or ["no output"])[-1][:600]


def row(r: dict) -> str:
    layers = f"{r['n_layers']}/{r['full_layers']}"
    if "measured_gib" not in r:
        return f"{r['name']:<22} {layers:>6}  {'-':>9} {'-':>9} {'-':>6} {'-':>8}  {r.get('error', '')[:80]}"
    step = r["steps"][-1]
    return (f"{r['name']:<22} {layers:>6}  {r['plan_device_gib']:>9.2f} {r['measured_gib']:>9.2f} "
            f"{r['plan_over_measured']:>6.3f} {step['seconds']:>8.1f}  opt {step['optimizer_s'] or 0:.1f} s")


HEADER = f"{'point':<22} {'layers':>6}  {'plan GiB':>9} {'peak GiB':>9} {'ratio':>6} {'step s':>8}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    lst = sub.add_parser("list", help="the points, their layer counts, host state and time estimates")
    lst.add_argument("--host-limit", default="112GiB")
    for name in ("run", "smoke"):
        p = sub.add_parser(name)
        if name == "run":
            p.add_argument("points", nargs="+", help="point names (`list` prints them)")
        p.add_argument("--steps", type=int, default=0, help="steps per point (0: 2 when they fit the timeout, else 1)")
        p.add_argument("--snapshot", action="store_true", help="torch memory snapshot of the last step")
        p.add_argument("--census", action="store_true",
                       help="count the steps' tensors by allocation site (mop_train.train.census): the peak's make-up")
        p.add_argument("--out", default=os.environ.get("OUT", os.path.join(ROOT, "benchmarks", "results", "fake_world")))
        p.add_argument("--timeout", type=float, default=570.0)
        p.add_argument("--host-limit", default="112GiB")
        if name == "smoke":
            p.add_argument("--seq-len", type=int, default=16 * 4096, help="tokens per sequence (a multiple of 16)")
    pk = sub.add_parser("peak", help="the make-up of a --snapshot file's peak, by allocating frame of ours")
    pk.add_argument("snapshot_file")
    ch = sub.add_parser("child")
    ch.add_argument("point")
    ch.add_argument("steps", type=int)
    ch.add_argument("snapshot")
    a = ap.parse_args()
    if a.cmd == "child":
        point = json.loads(a.point)
        model_args = None
        if point.get("variant") == "debug-wide":
            from mop_train.models import zoo
            model_args = replace(zoo.get_model_args("debug"), n_heads=16, num_experts=64)
        print("RESULT " + json.dumps(child(point, a.steps, a.snapshot or None, model_args)), flush=True)
        return
    if a.cmd == "peak":
        print(json.dumps(snapshot_peak(a.snapshot_file), indent=1))
        return
    from mop_train.units import parse_bytes
    limit = parse_bytes(a.host_limit, key="--host-limit")
    if a.cmd == "list":
        print(f"{'point':<22} {'layers':>6} {'host GiB':>9} {'est. s':>7}  flags")
        for p in all_points(limit):
            print(f"{p['name']:<22} {p['n_layers']:>3}/{p['full_layers']:<2} {p['host_gib']:>9.1f} "
                  f"{estimate_seconds(p):>7.0f}  {' '.join(p['flags'][:2])}")
        return
    if a.cmd == "smoke":
        points = [smoke_point(a.seq_len)]
    else:
        by_name = {p["name"]: p for p in all_points(limit)}
        unknown = [n for n in a.points if n not in by_name]
        if unknown:
            raise SystemExit(f"unknown points {unknown}; `list` prints them: {', '.join(by_name)}")
        points = [by_name[n] for n in a.points]
    results = []
    for p in points:
        steps = a.steps or (1 if p.get("variant") is None and 2 * estimate_seconds(p) - SETUP_S > a.timeout else 2)
        p["flags"] = [*p["flags"][:2], "--training.steps", str(steps), *p["flags"][4:]]
        if a.census:
            p["census"] = True
        results.append(run_point(p, steps=steps, snapshot=a.snapshot, out_dir=a.out, timeout_s=a.timeout))
    print(HEADER)
    for r in results:
        print(row(r))


def smoke_point(seq_len: int) -> dict:
    """`debug` widened to 16 heads and 64 experts at the paper's 64-rank layout (D=16, E_p=64, P=8), every
    operator of the paper configs on: checks the fake world's GPU path in about a minute."""
    flags = base_flags(seq_len, "/tmp/mop_fake_world/smoke", 2) + [
        "--model.flavor", "debug", "--mop.layout.seq_degree", "16", "--mop.layout.expert_degree", "64",
        "--mop.layout.vocab_degree", "8", "--training.mixed_precision_param", "bfloat16",
        "--mop.moe.token_budget", "1024", "--mop.sco.host_budget", "1GiB", "--training.local_batch_size", "1"]
    return {"name": "smoke-debug-wide-w64", "model": "debug", "variant": "debug-wide", "world": 64,
            "seq_len": seq_len, "n_layers": 3, "full_layers": 3, "config": "configs/mop_667b.toml", "flags": flags}


if __name__ == "__main__":
    main()
