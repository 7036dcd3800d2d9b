"""Optimizer step with fp32 AdamW state in host memory: OffloadStreamAdamW against CPU-side baselines.

Working weights and gradients are bf16 on the device, as a handful of big tensors. Every method
keeps the fp32 masters and both moments in host memory; each is reported as a fraction of the
host-link floor measured in the same run (12 B/param host->device and device->host at once):
  ours            OffloadStreamAdamW over bucket sizes x slots (staging bytes reported), then
                  host fractions (the CPU updates that share in place) at the --fraction-staging points
  torch_cpu       torch fused AdamW on (pinned) CPU fp32 tensors + gradient download + weight upload
  deepspeed       DeepSpeed CPUAdam (AVX, JIT-compiled on first use) with the same transfers
  fsdp2_offload   FSDP2 + CPUOffloadPolicy on 1 rank: iteration time minus the same model's
                  forward+backward without offload (the time the offloaded optimizer adds)
  overlap         (--overlap; issue 20) device_fraction (0, 0.25, 0.5) x overlap (off, on) at --overlap-staging,
                  each step followed by a synthetic forward (one unit per weight tensor, matmuls
                  calibrated to --forward-ms in all) that waits per unit with overlap on; reports the
                  step's exposed time (`exposed_seconds()`), step + forward against the forward alone,
                  and the device state bytes
Times are wall clock between device synchronisations, median of repeats after one warm-up.

    python benchmarks/optimizer_step.py                 # one GPU: 1B and 2.6B params
    python benchmarks/optimizer_step.py --overlap --skip sweep,torch_cpu,deepspeed,fsdp2_offload   # overlap rows only
    python benchmarks/optimizer_step.py --smoke         # CPU, tiny sizes, overlap rows included (checks that it runs)
JSON goes to $OUT/optimizer_step.json if OUT is set, else benchmarks/results/optimizer_step.json
(optimizer_step_smoke.json for --smoke).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mop_train.ops.offload_adamw import OffloadStreamAdamW, staging_bytes_bound  # noqa: E402

HP = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
PIECE = 1 << 27  # elements per tensor (512 MiB in fp32: pinned blocks are powers of two)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(fn, device, repeats, warmup=1):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def free_host_memory():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        if hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()


def make_working(total, piece, device):
    """bf16 working weights and gradients on the device, as ceil(total / piece) tensors."""
    gen = torch.Generator(device=device).manual_seed(0)
    params = []
    for start in range(0, total, piece):
        n = min(piece, total - start)
        p = nn.Parameter(torch.randn(n, generator=gen, device=device, dtype=torch.bfloat16) * 0.02)
        p.grad = torch.randn(n, generator=gen, device=device, dtype=torch.bfloat16) * 1e-3
        params.append(p)
    return params


def link_floor(total, device, chunk, repeats):
    """Seconds to move 12 B/param host->device and device->host concurrently (best of repeats)."""
    return concurrent_copies(12 * total, device, chunk, repeats)[0]


def concurrent_copies(nbytes, device, chunk, repeats):
    """`nbytes` host->device and `nbytes` device->host at once, one stream per direction, in copies of
    `chunk` bytes between pinned host buffers and device buffers: best-of-repeats seconds of
    (both directions, wall clock; the host->device stream's own span; the device->host stream's),
    the spans timed by CUDA events on each stream (on CPU: the wall clock for all three)."""
    pin = device.type == "cuda"
    host_src = torch.empty(chunk, dtype=torch.uint8, pin_memory=pin).fill_(1)
    host_dst = torch.empty(chunk, dtype=torch.uint8, pin_memory=pin)
    dev_dst = torch.empty(chunk, dtype=torch.uint8, device=device)
    dev_src = torch.empty(chunk, dtype=torch.uint8, device=device).fill_(2)
    streams = [torch.cuda.Stream(device) for _ in range(2)] if pin else [None, None]

    def move():
        spans = []
        for stream, dst, src in ((streams[0], dev_dst, host_src), (streams[1], host_dst, dev_src)):
            ctx = torch.cuda.stream(stream) if stream is not None else _Null()
            with ctx:
                start = torch.cuda.Event(enable_timing=True) if pin else None
                if pin:
                    start.record()
                for offset in range(0, nbytes, chunk):
                    n = min(chunk, nbytes - offset)
                    dst[:n].copy_(src[:n], non_blocking=True)
                end = torch.cuda.Event(enable_timing=True) if pin else None
                if pin:
                    end.record()
                spans.append((start, end))
        return spans

    best = [float("inf")] * 3
    move()
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        spans = move()
        sync(device)
        wall = time.perf_counter() - t0
        each = [s.elapsed_time(e) / 1e3 if pin else wall for s, e in spans]
        best = [min(b, t) for b, t in zip(best, [wall, *each])]
    return tuple(best)


def link_bandwidth(device, nbytes=8 * 2**30, chunk=256 * 2**20, repeats=3):
    """(host->device, device->host) bytes/s of pinned copies with both directions in flight at once
    (`concurrent_copies`), the figures a step's link floor is computed from."""
    _, up, down = concurrent_copies(nbytes, device, chunk, repeats)
    return nbytes / up, nbytes / down


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def time_step(opt, device, repeats):
    """Median wall time of opt.step() between device synchronisations, and (CUDA) the median time
    until the current stream has the refreshed weights (what the next forward waits for; the last
    bucket's write-back may still be running then)."""
    opt.step()
    walls, ready = [], []
    for _ in range(repeats):
        sync(device)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if device.type == "cuda" else []
        if events:
            events[0].record()
        t0 = time.perf_counter()
        opt.step()
        if events:
            events[1].record()
        sync(device)
        walls.append(time.perf_counter() - t0)
        if events:
            ready.append(events[0].elapsed_time(events[1]) / 1e3)
    return statistics.median(walls), (statistics.median(ready) if ready else None)


def bench_ours(params, points, repeats, device):
    """points: (bucket_params, slots, host_fraction) in the order to measure."""
    rows = []
    cuda = device.type == "cuda"
    sync(device)
    base = torch.cuda.memory_allocated(device) if cuda else 0  # before any staging exists
    t0 = time.perf_counter()
    opt = OffloadStreamAdamW(params, **HP, bucket_params=points[0][0], slots=points[0][1])
    build_s = time.perf_counter() - t0
    sync(device)
    if cuda:
        print(f"  built in {build_s:.1f} s; device bytes held after construction: "
              f"{torch.cuda.memory_allocated(device) - base:,} (staging counter {opt.staging_bytes:,})", flush=True)
    for bucket, slots, fraction in points:
        opt.resize_staging(bucket, slots, fraction)  # frees the previous staging first
        sync(device)
        staged = (torch.cuda.memory_allocated(device) - base) if cuda else opt.staging_bytes
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        sec, ready = time_step(opt, device, repeats)
        peak_extra = (torch.cuda.max_memory_allocated(device) - base) if cuda else 0
        rows.append(dict(bucket_params=bucket, slots=slots, host_fraction=fraction, seconds=sec,
                         weights_ready_seconds=ready, copy_span_seconds=opt.step_seconds(),
                         staging_bytes=staged, staging_counter_bytes=opt.staging_bytes,
                         staging_bound=staging_bytes_bound(bucket, slots),
                         step_peak_over_staging_bytes=max(peak_extra - staged, 0),
                         host_buffer_bytes=opt.host_buffer_bytes, h2d_bytes=opt.last_step.h2d_bytes,
                         d2h_bytes=opt.last_step.d2h_bytes, buckets=opt.last_step.buckets))
        print(f"  ours B={bucket:>11,} s={slots} f={fraction:.2f}: {sec:.4f} s (weights ready {ready or 0:.4f} s) "
              f"staging {staged / 2**20:.0f} MiB, host buffers {opt.host_buffer_bytes / 2**20:.0f} MiB", flush=True)
    del opt
    free_host_memory()
    return rows, build_s


class _Unit(nn.Module):
    """One weight tensor and a forward of `matmuls` [M, M] products (compute that takes time and
    bandwidth, as a block's forward does) that also reads the weight."""

    def __init__(self, weight: nn.Parameter, work: torch.Tensor, matmuls: int):
        super().__init__()
        self.weight = weight
        self.work, self.matmuls = work, matmuls

    def forward(self, x):
        for _ in range(self.matmuls):
            x = torch.mm(x, self.work)
        return x + self.weight[:1].float().sum().to(x.dtype)


def synthetic_forward(params, device, forward_s, smoke):
    """Units (one per tensor, in flat order) whose forwards take forward_s seconds in all."""
    M = 256 if smoke else 4096
    work = torch.randn(M, M, device=device, dtype=torch.bfloat16) / M ** 0.5
    x = torch.randn(M, M, device=device, dtype=torch.bfloat16)
    probe = _Unit(params[0], work, 8)
    one = median_time(lambda: probe(x), device, 3) / 8  # seconds per matmul
    per_unit = max(1, round(forward_s / one / len(params)))
    units = [_Unit(p, work, per_unit) for p in params]

    def forward():
        h = x
        for unit in units:
            h = unit(h)
        return h
    return units, forward


def bench_overlap(params, points, repeats, device, forward_s, smoke):
    """points: (bucket_params, slots, device_fraction, overlap). Each iteration = step + forward."""
    units, forward = synthetic_forward(params, device, forward_s, smoke)
    forward_alone = median_time(forward, device, repeats)
    rows = []
    for bucket, slots, share, overlap in points:
        opt = OffloadStreamAdamW(params, **HP, bucket_params=bucket, slots=slots, device_fraction=share,
                                 overlap=overlap)
        opt.wait_in_forward([(u, [u.weight]) for u in units])
        exposed, steps = [], []

        def iteration():
            t0 = time.perf_counter()
            opt.step()
            steps.append(time.perf_counter() - t0)
            forward()
        total = median_time(iteration, device, repeats)
        for _ in range(repeats):  # the optimizer's own figure, step by step
            iteration()
            sync(device)
            exposed.append(opt.exposed_seconds())
        row = dict(bucket_params=bucket, slots=slots, device_fraction=share, overlap=overlap,
                   step_plus_forward_seconds=total, forward_seconds=forward_alone,
                   exposed_measured_seconds=total - forward_alone, exposed_seconds=statistics.median(exposed),
                   step_host_seconds=statistics.median(steps), copy_span_seconds=opt.step_seconds(),
                   device_state_bytes=opt.device_state_bytes, staging_bytes=opt.staging_bytes,
                   h2d_bytes=opt.last_step.h2d_bytes, buckets=opt.last_step.buckets)
        rows.append(row)
        print(f"  d={share:.2f} overlap={'on ' if overlap else 'off'}: step+forward {total:.4f} s "
              f"(forward alone {forward_alone:.4f} s) exposed {row['exposed_seconds']:.4f} s "
              f"(measured {row['exposed_measured_seconds']:.4f} s), device state "
              f"{opt.device_state_bytes / 2**30:.2f} GiB", flush=True)
        opt.forward_waits.remove_hooks()
        opt = None  # the closures share this cell: their last reference goes too (del would read as undefined)
        free_host_memory()
    return rows


def bench_cpu_optimizer(params, make_optimizer, repeats, device):
    """fp32 master/grad copies in pinned host memory; the step downloads grads, updates on the CPU,
    uploads the weights (both transfers with the bf16<->fp32 cast on the device)."""
    pin = device.type == "cuda"
    masters = [nn.Parameter(torch.empty(p.numel(), dtype=torch.float32, pin_memory=pin)) for p in params]
    for m, p in zip(masters, params):
        m.data.copy_(p.detach())
        m.grad = torch.empty(p.numel(), dtype=torch.float32, pin_memory=pin)
    opt = make_optimizer(masters)

    def step():
        for m, p in zip(masters, params):
            m.grad.copy_(p.grad, non_blocking=True)
        sync(device)
        opt.step()
        for m, p in zip(masters, params):
            p.data.copy_(m.detach(), non_blocking=True)

    sec = median_time(step, device, repeats)
    opt = masters = None  # the closure shares these cells
    free_host_memory()
    return sec


def torch_cpu_adamw(params):
    return torch.optim.AdamW(params, **HP, fused=True)


def deepspeed_cpu_adam(params):
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    return DeepSpeedCPUAdam(params, **HP, adamw_mode=True)


class _Wide(nn.Module):
    """Linear layers that all read the same input: parameters without deep activations."""

    def __init__(self, total, width=8192):
        super().__init__()
        outs = [PIECE // width] * (total // PIECE) + ([(total % PIECE) // width] if total % PIECE else [])
        self.layers = nn.ModuleList(nn.Linear(width, o, bias=False) for o in outs if o)

    def forward(self, x):
        return sum(layer(x).float().square().mean() for layer in self.layers)


def bench_fsdp2_offload(total, repeats, device):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    if device.type != "cuda":
        raise RuntimeError("FSDP2 CPUOffloadPolicy needs a CUDA device")
    if not dist.is_initialized():
        dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29517", rank=0, world_size=1)
    mesh = init_device_mesh("cuda", (1,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    x = torch.randn(16, 8192, device=device)
    out = {}
    for offload in (False, True):
        with torch.device("meta"):
            model = _Wide(total)
        policy = dict(offload_policy=CPUOffloadPolicy(pin_memory=True)) if offload else {}
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp, **policy)
        fully_shard(model, mesh=mesh, mp_policy=mp, **policy)
        model.to_empty(device="cpu" if offload else device)
        for p in model.parameters():
            p.detach().fill_(0.01)  # values do not change the step's speed
        opt = torch.optim.AdamW(model.parameters(), **HP, fused=True)

        def fwd_bwd():
            opt.zero_grad(set_to_none=False)
            model(x).backward()

        def iteration():
            fwd_bwd()
            opt.step()

        out["numel"] = sum(p.numel() for p in model.parameters())
        out["offload_iteration_s" if offload else "fwd_bwd_s"] = median_time(
            iteration if offload else fwd_bwd, device, repeats)
        model = opt = None  # the closures share these cells
        free_host_memory()
    out["seconds"] = out["offload_iteration_s"] - out["fwd_bwd_s"]
    return out


def attempt(name, fn, *args):
    t0 = time.perf_counter()
    try:
        result = fn(*args)
        print(f"  {name}: {result if isinstance(result, float) else 'done'} ({time.perf_counter() - t0:.0f} s)",
              flush=True)
        return {"seconds": result} if isinstance(result, float) else result
    except Exception as err:  # a baseline that cannot run is reported, not fatal
        print(f"  {name}: FAILED {type(err).__name__}: {err}", flush=True)
        return {"error": f"{type(err).__name__}: {str(err)[:400]}"}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny sizes")
    ap.add_argument("--sizes", default="1000000000,2600000000")
    ap.add_argument("--buckets", default="25000000,50000000,100000000,200000000,400000000")
    ap.add_argument("--slots", default="1,2,3,4")
    ap.add_argument("--host-fractions", default="0.3,0.4,0.5,0.6",
                    help="host_fraction values measured at each --fraction-staging point")
    ap.add_argument("--fraction-staging", default="100000000x2,25000000x3",
                    help="comma list of BUCKETxSLOTS where the host fractions are measured")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--baseline-repeats", type=int, default=2)
    ap.add_argument("--overlap", action="store_true", help="also measure the device_fraction x overlap rows")
    ap.add_argument("--device-fractions", default="0,0.25,0.5", help="device_fraction values of the overlap rows")
    ap.add_argument("--overlap-staging", default="25000000x3", help="BUCKETxSLOTS of the overlap rows")
    ap.add_argument("--forward-ms", type=float, default=150.0,
                    help="synthetic forward after each step in the overlap rows (milliseconds in all)")
    ap.add_argument("--skip", default="", help="comma list of: sweep,overlap,torch_cpu,deepspeed,fsdp2_offload")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    buckets = [int(float(b)) for b in args.buckets.split(",")]
    piece, chunk = PIECE, 1 << 28
    if args.smoke:
        sizes, buckets, piece, chunk = [30_001, 78_000], [2_500, 5_000, 10_000, 20_000, 40_000], 7_001, 1 << 20
        args.repeats = args.baseline_repeats = 1
    slots_list = [int(s) for s in args.slots.split(",")]
    fractions = [float(f) for f in args.host_fractions.split(",") if f]
    staging = [tuple(int(float(v)) for v in point.split("x")) for point in args.fraction_staging.split(",") if point]
    if args.smoke:
        staging = [(buckets[2], 2)]
    points = [(b, s, 0.0) for b in buckets for s in slots_list] + [(b, s, f) for b, s in staging for f in fractions]
    ov_bucket, ov_slots = (int(float(v)) for v in args.overlap_staging.split("x"))
    if args.smoke:
        ov_bucket, ov_slots, args.forward_ms = buckets[0], 3, 20.0
    overlap_points = [(ov_bucket, ov_slots, float(d), o) for d in args.device_fractions.split(",") if d
                      for o in (False, True)]
    skip = set(filter(None, args.skip.split(",")))
    result = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  torch=torch.__version__, cpu_threads=torch.get_num_threads(), hyperparameters=HP,
                  argv=sys.argv[1:], sizes={})
    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "optimizer_step_smoke.json" if args.smoke else "optimizer_step.json")  # smoke never overwrites

    def save():
        with open(path, "w") as f:
            json.dump(result, f, indent=1)

    # ours first at every size (the numbers that matter most), then the slower baselines
    for total in sizes:
        print(f"== ours, {total:,} params on {device}", flush=True)
        entry = result["sizes"][str(total)] = {"ours": []}
        entry["floor_seconds"] = link_floor(total, device, chunk, repeats=3)
        print(f"  link floor (12 B/param each way, concurrent): {entry['floor_seconds']:.4f} s", flush=True)
        params = make_working(total, piece, device)
        if "sweep" not in skip:
            entry["ours"], entry["ours_build_seconds"] = bench_ours(params, points, args.repeats, device)
            save()
        if (args.overlap or args.smoke) and "overlap" not in skip:
            entry["overlap"] = bench_overlap(params, overlap_points, args.repeats, device, args.forward_ms / 1e3,
                                             args.smoke)
            save()
        del params
        free_host_memory()
    for total in sizes:
        print(f"== baselines, {total:,} params", flush=True)
        entry = result["sizes"][str(total)]
        params = make_working(total, piece, device)
        for name, fn in (("torch_cpu", torch_cpu_adamw), ("deepspeed", deepspeed_cpu_adam)):
            if name not in skip:
                entry[name] = attempt(name, bench_cpu_optimizer, params, fn, args.baseline_repeats, device)
                save()
        del params
        free_host_memory()
    for total in sizes:
        if "fsdp2_offload" not in skip:
            entry = result["sizes"][str(total)]
            entry["fsdp2_offload"] = attempt(f"fsdp2_offload {total:,}", bench_fsdp2_offload, total,
                                             args.baseline_repeats, device)
            save()
    print_table(result)
    print(f"wrote {path}")


def print_table(result):
    print(f"\n{'params':>14} {'method':<14} {'bucket':>12} {'slots':>5} {'host f':>6} {'seconds':>9} {'of floor':>8} "
          f"{'staging MiB':>11} {'ready s':>8}")
    for total, entry in result["sizes"].items():
        floor = entry["floor_seconds"]
        print(f"{int(total):>14,} {'link floor':<14} {'':>12} {'':>5} {'':>6} {floor:>9.4f} {1.0:>8.3f} {'':>11}")
        for row in entry["ours"]:
            print(f"{int(total):>14,} {'ours':<14} {row['bucket_params']:>12,} {row['slots']:>5} {row['host_fraction']:>6.2f} "
                  f"{row['seconds']:>9.4f} {floor / row['seconds']:>8.3f} {row['staging_bytes'] / 2**20:>11.0f} "
                  f"{row['weights_ready_seconds'] or 0:>8.4f}")
        for row in entry.get("overlap", []):
            print(f"{int(total):>14,} {'ours d=%.2f %s' % (row['device_fraction'], 'ovl' if row['overlap'] else 'seq'):<14} "
                  f"{row['bucket_params']:>12,} {row['slots']:>5} {'':>6} {row['exposed_seconds']:>9.4f} "
                  f"{floor / max(row['exposed_seconds'], 1e-9):>8.3f} {row['staging_bytes'] / 2**20:>11.0f} "
                  f"{'':>8}  step+fwd {row['step_plus_forward_seconds']:.4f} s, fwd {row['forward_seconds']:.4f} s")
        for name in ("torch_cpu", "deepspeed", "fsdp2_offload"):
            r = entry.get(name)
            if r is None:
                continue
            if "seconds" in r:
                print(f"{int(total):>14,} {name:<14} {'':>12} {'':>5} {'':>6} {r['seconds']:>9.4f} "
                      f"{floor / r['seconds']:>8.3f} {'':>11}")
            else:
                print(f"{int(total):>14,} {name:<14} error: {r['error'][:60]}")


if __name__ == "__main__":
    main()
