"""Expert dispatch: standard EP, LLEP and PipelinedLLEP over the paper's routing profiles (B.2).

One MoE expert layer at the paper's shape (H=7168, I=2048, E=384 experts, top-8, bf16; its models of
section 4 / Appendix A), N tokens per rank routed by each profile, sharded over all ranks (E_p = W).
Per schedule, profile and N: forward latency, forward+backward latency, forward+backward of the layer
inside a non-reentrant activation checkpoint (a residual block x + layer(x), as training runs it:
forward, recompute in backward, backward), and the largest peak allocated memory across ranks over
each pass (torch.cuda.max_memory_allocated, reset before the pass). Each repeat is the mean of
--iters passes timed with CUDA events after a warm-up; the table shows the lowest of --repeats
repeats (the paper's B.5 reading), the JSON keeps them all. Also per row: the plan's weight copies
and their bytes, and on CUDA the host syncs of one pass (torch.cuda.set_sync_debug_mode).
--experts takes several counts: on one GPU, 48, 24 and 6 are the per-rank shapes of 8, 16 and 64
ranks at E=384. --time-budget stops starting new rows once that many seconds have passed.

On one GPU nothing is relocated and nothing is sent: "ep" and "llep" are the unchunked local expert
compute and "pipelined_llep" is the chunked one (K chunks, reentrant checkpoint per chunk), so the
single-rank rows measure chunking alone; they are labelled "1-rank". On several GPUs a standard-EP
row whose busiest receiver would not fit (estimated from the routing counts) is reported as OOM
without running it, since an OOM on one rank would hang the others in a collective.

    torchrun --nproc_per_node=8 benchmarks/moe_dispatch.py          # all GPUs of a host
    torchrun --nproc_per_node=1 benchmarks/moe_dispatch.py          # one GPU (single-rank figures)
    python benchmarks/moe_dispatch.py --experts 48 24 6 --time-budget 500   # one GPU, per-rank shapes
    python benchmarks/moe_dispatch.py --smoke                       # CPU, 2 gloo ranks, tiny shapes
JSON goes to $OUT/moe_dispatch.json if OUT is set, else benchmarks/results/moe_dispatch.json
(moe_dispatch_smoke.json for --smoke).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mop_train.ops.moe_dispatch import (DispatchStats, LLEPOptions, PipelinedLLEPOptions,  # noqa: E402
                                        dispatch_options, moe_experts_forward)
from mop_train.ops.routing_profiles import PROFILES, routing_profile  # noqa: E402
from mop_train.train.metrics import DeviceSpan  # noqa: E402

GiB = 2 ** 30


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[65536, 32768], help="tokens per rank")
    p.add_argument("--profiles", nargs="+", default=list(PROFILES))
    p.add_argument("--modes", nargs="+", default=["ep", "llep", "pipelined_llep"])
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--inter", type=int, default=2048)
    p.add_argument("--experts", type=int, nargs="+", default=[384],
                   help="expert counts (all ranks together), one table block each")
    p.add_argument("--top-k", type=int, default=8)
    # The schedules' settings, named as their options' fields (dispatch_options reads them from args).
    p.add_argument("--token-budget", type=int, default=PipelinedLLEPOptions.token_budget, help="PipelinedLLEP c")
    p.add_argument("--max-chunks", type=int, default=PipelinedLLEPOptions.max_chunks, help="PipelinedLLEP K_max")
    p.add_argument("--membership", default=PipelinedLLEPOptions.membership, choices=["strided", "contiguous"])
    p.add_argument("--alpha", type=float, default=LLEPOptions.alpha)
    p.add_argument("--min-tokens-per-gemm", type=int, default=LLEPOptions.min_tokens_per_gemm)
    p.add_argument("--imbalance-threshold", type=float, default=LLEPOptions.imbalance_threshold)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--iters", type=int, default=2, help="timed passes per repeat")
    p.add_argument("--no-backward", action="store_true", help="forward passes only")
    p.add_argument("--no-checkpoint", action="store_true",
                   help="skip the forward+backward inside an activation checkpoint")
    p.add_argument("--time-budget", type=float, default=0.0,
                   help="seconds after which no new row starts (0: no limit)")
    p.add_argument("--smoke", action="store_true", help="CPU, 2 gloo ranks, tiny shapes")
    p.add_argument("--profile", action="store_true",
                   help="after timing, profile one forward+backward per row (rank 0 writes the top kernels "
                        "and a chrome trace to $OUT or benchmarks/results)")
    args = p.parse_args(argv)
    if args.smoke:
        args.tokens, args.hidden, args.inter, args.experts, args.top_k = [48, 20], 16, 16, [32], 4
        args.token_budget, args.min_tokens_per_gemm, args.repeats, args.iters = 8, 4, 2, 1
    return args


def measure(run_pass, device, group, args):
    """(lowest repeat seconds, all repeat seconds, max peak GiB across ranks or None on CPU)."""
    run_pass()                                                    # warm-up
    repeats, peak = [], 0.0
    for _ in range(args.repeats):
        times = []
        for _ in range(args.iters):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            if group is not None:
                dist.barrier(group)
            with DeviceSpan(device) as span:
                run_pass()
            times.append(span.seconds())
            if device.type == "cuda":
                peak = max(peak, torch.cuda.max_memory_allocated(device) / GiB)
        repeats.append(statistics.mean(times))
    stats = torch.tensor([max(repeats), peak], dtype=torch.float64, device=device)
    if group is not None:
        dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=group)  # the slowest rank sets the time
    return min(repeats), repeats, float(stats[1]) if device.type == "cuda" else None


def ep_exceeds_memory(profile, n, experts, group, device, dtype, args) -> bool:
    """Whether standard EP's busiest receiver would run out of memory (estimated, same on all
    ranks): an OOM on one rank would leave the others waiting in a collective forever."""
    if group is None or device.type != "cuda":
        return False
    world = dist.get_world_size(group)
    idx, _ = routing_profile(profile, n, experts, args.top_k)
    per_owner = torch.bincount(idx.reshape(-1), minlength=experts).view(world, -1).sum(1)
    received = int(per_owner.max()) * world                       # every rank routes alike
    elem = torch.finfo(dtype).bits // 8
    need = received * (8 * args.hidden + 6 * args.inter) * elem   # live route-sized tensors, fwd+bwd
    free = torch.tensor([torch.cuda.mem_get_info(device)[0]], dtype=torch.int64, device=device)
    dist.all_reduce(free, op=dist.ReduceOp.MIN, group=group)
    return need > 0.9 * int(free)


def count_syncs(run_pass, device):
    """Host syncs of one pass (CUDA only): the warnings of torch.cuda.set_sync_debug_mode."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run_pass()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def bench_row(mode, profile, n, experts, weights, group, device, dtype, args):
    if mode == "ep" and ep_exceeds_memory(profile, n, experts, group, device, dtype, args):
        return dict(mode=mode, profile=profile, tokens_per_rank=n, experts=experts, K=1, relocated_routes=0,
                    oom="estimated, not run")
    rank = dist.get_rank(group) if group is not None else 0
    gen = torch.Generator(device=device).manual_seed(1000 + rank)
    x = torch.randn(n, args.hidden, device=device, dtype=dtype, generator=gen).requires_grad_(True)
    idx, wts = routing_profile(profile, n, experts, args.top_k, device=device)
    wts.requires_grad_(True)
    grad = torch.randn(n, args.hidden, device=device, dtype=dtype, generator=gen)
    options = dispatch_options(mode, args)                        # None for "local"

    def layer(x_, wts_, *ws):
        return moe_experts_forward(x_, idx, wts_, *ws, options, group=group)

    def forward():
        return layer(x, wts, *weights)

    def clear_grads():
        x.grad = wts.grad = None
        for w in weights:
            w.grad = None

    def fwd_bwd():
        forward().backward(grad)
        clear_grads()

    def block(x_, wts_, *ws):                                     # a residual block, as training runs it
        return x_ + layer(x_, wts_, *ws)

    def ckpt_fwd_bwd():
        checkpoint(block, x, wts, *weights, use_reentrant=False).backward(grad)
        clear_grads()

    stats = DispatchStats()                                       # one untimed pass for the counters
    moe_experts_forward(x, idx, wts, *weights, options, group=group, stats=stats if options is not None else None)
    resident = torch.cuda.memory_allocated(device) / GiB if device.type == "cuda" else None
    row = dict(mode=mode, profile=profile, tokens_per_rank=n, experts=experts, K=stats.num_chunks,
               resident_gib=resident, relocated_routes=stats.relocated_routes,
               migrated_experts=stats.migrated_experts, weight_transfer_bytes=stats.weight_transfer_bytes,
               max_received=stats.last_chunk_max_received, received_bound=stats.received_bound)
    passes = [("fwd", lambda: forward())]
    if not args.no_backward:
        passes.append(("fwd_bwd", fwd_bwd))
        if not args.no_checkpoint:
            passes.append(("ckpt_fwd_bwd", ckpt_fwd_bwd))
    try:
        for name, run_pass in passes:
            row[f"{name}_s"], row[f"{name}_repeats_s"], row[f"{name}_peak_gib"] = measure(
                run_pass, device, group, args)
            row[f"{name}_host_syncs"] = count_syncs(run_pass, device)
        if args.profile and not args.no_backward:
            tag = f"{mode}_{profile.replace('/', '-')}_{n}_E{experts}"
            profile_pass(fwd_bwd, tag, device, rank)
            if not args.no_checkpoint:
                profile_pass(ckpt_fwd_bwd, f"{tag}_ckpt", device, rank)
    except torch.cuda.OutOfMemoryError:
        row["oom"] = True                 # only a 1-rank run survives this (see ep_exceeds_memory)
        clear_grads()
        torch.cuda.empty_cache()
    return row


def profile_pass(run_pass, name, device, rank):
    """One pass under torch.profiler: the top 30 ops by device (or CPU) time and a chrome trace."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        run_pass()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    if rank != 0:
        return
    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out_dir, exist_ok=True)
    key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=60)
    with open(os.path.join(out_dir, f"profile_{name}.txt"), "w") as f:
        f.write(table)
    prof.export_chrome_trace(os.path.join(out_dir, f"trace_{name}.json"))
    print(f"profile {name}\n{table}", flush=True)


def out_of_time(start, group, device, args) -> bool:
    """Whether --time-budget has run out (the same answer on every rank)."""
    if args.time_budget <= 0:
        return False
    over = torch.tensor([float(time.monotonic() - start > args.time_budget)], device=device)
    if group is not None:
        dist.all_reduce(over, op=dist.ReduceOp.MAX, group=group)
    return bool(over.item())


def run(args):
    start = time.monotonic()
    distributed = "RANK" in os.environ or args.smoke
    if distributed and not dist.is_initialized():
        backend = "gloo" if args.smoke or not torch.cuda.is_available() else "nccl"
        dist.init_process_group(backend)
    world = dist.get_world_size() if distributed else 1
    rank = dist.get_rank() if distributed else 0
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() \
        and not args.smoke else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    bad = [e for e in args.experts if e % world]
    if bad:
        raise ValueError(f"--experts {bad} must be divisible by the {world} ranks")
    group = dist.group.WORLD if world > 1 else None
    modes = args.modes if world > 1 else [m for m in args.modes if m != "llep"]  # llep == ep at 1 rank
    rows, stopped = [], False
    for experts in args.experts:
        M = experts // world
        gen = torch.Generator(device=device).manual_seed(rank)
        weights = [(torch.randn(M, *shape, device=device, dtype=dtype, generator=gen) * 0.02).requires_grad_(True)
                   for shape in ((args.inter, args.hidden), (args.hidden, args.inter),
                                 (args.inter, args.hidden))]
        for n in args.tokens:
            for profile in args.profiles:
                for mode in modes:
                    if out_of_time(start, group, device, args):
                        stopped = True
                        break
                    row = bench_row(mode, profile, n, experts, weights, group, device, dtype, args)
                    row["label"] = f"{world}-rank" if world > 1 else (
                        "1-rank unchunked" if mode == "ep" else "1-rank chunked")
                    rows.append(row)
                    if rank == 0:
                        print(json.dumps(row), flush=True)
        del weights
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if rank == 0:
        if stopped:
            print(f"--time-budget {args.time_budget:.0f} s reached: later rows were not run", flush=True)
        report(rows, args, world, device)
    return rows


def report(rows, args, world, device):
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                world_size=world, torch=torch.__version__, args=vars(args))
    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "moe_dispatch_smoke.json" if args.smoke else "moe_dispatch.json")  # smoke never overwrites
    with open(path, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(f"\n{meta['device']} x{world}, H={args.hidden} I={args.inter} k={args.top_k} "
          f"c={args.token_budget} K_max={args.max_chunks}; lowest of {args.repeats} repeats; peak = max "
          f"over ranks of max_memory_allocated (GiB, incl. resident weights); ckpt = forward+backward in "
          f"a non-reentrant checkpoint; copies = weight copies (MiB); syncs = host syncs of one "
          f"fwd/f+b/ckpt pass; JSON: {path}")
    head = f"{'E':>4} {'tokens':>7} {'profile':>8} {'mode':>15} {'label':>17} {'K':>3} {'reloc':>8} " \
           f"{'copies':>12} {'fwd ms':>9} {'fwd GiB':>8} {'f+b ms':>9} {'f+b GiB':>8} {'ckpt ms':>9} " \
           f"{'ckpt GiB':>8} {'syncs':>9}"
    print(head)
    print("-" * len(head))
    for r in rows:
        def cell(key, scale, width):
            if r.get(key) is not None:
                return f"{r[key] * scale:{width}.{1 if scale > 1 else 2}f}"
            return f"{'OOM' if r.get('oom') else '-':>{width}}"
        copies = f"{r.get('migrated_experts', 0)}/{r.get('weight_transfer_bytes', 0) / 2 ** 20:.0f}"
        syncs = "/".join("-" if r.get(f"{p}_host_syncs") is None else str(r[f"{p}_host_syncs"])
                         for p in ("fwd", "fwd_bwd", "ckpt_fwd_bwd"))
        print(f"{r['experts']:>4} {r['tokens_per_rank']:>7} {r['profile']:>8} {r['mode']:>15} {r['label']:>17} "
              f"{r['K']:>3} {r['relocated_routes']:>8} {copies:>12} {cell('fwd_s', 1e3, 9)} "
              f"{cell('fwd_peak_gib', 1, 8)} {cell('fwd_bwd_s', 1e3, 9)} {cell('fwd_bwd_peak_gib', 1, 8)} "
              f"{cell('ckpt_fwd_bwd_s', 1e3, 9)} {cell('ckpt_fwd_bwd_peak_gib', 1, 8)} {syncs:>9}")


def _smoke_worker(rank, world, port, argv):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        run(parse_args(argv))
    finally:
        dist.destroy_process_group()


def main(argv=None):
    args = parse_args(argv)
    if args.smoke and "RANK" not in os.environ:
        import socket
        import torch.multiprocessing as mp
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_smoke_worker, args=(2, port, argv if argv is not None else sys.argv[1:]), nprocs=2)
        return
    run(args)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
