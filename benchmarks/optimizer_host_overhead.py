"""Host time of one optimizer step over DTensor parameters: torch's AdamW against LocalShardAdamW.

    python benchmarks/optimizer_host_overhead.py [--params 160] [--side 8] [--implementation fused] [--device cuda]

One process, a one-rank mesh (gloo on CPU, NCCL on CUDA; the host cost of DTensor's dispatch does not
depend on the world size), `--params` parameters of `--side` x `--side` (tiny, so the kernels' own time is negligible
and what is timed is the host's), each sharded Shard(0) as FSDP2 shards them; the median of 5
repeats of 20 steps after 3 warm-up steps, both optimizers alternating; on CUDA each repeat ends with a
synchronize, so a step's time is the larger of its launches and its kernels. Prints ms per step and
checks that both leave the same bits.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=int, default=160, help="parameters (small: about 160 tensors)")
    p.add_argument("--side", type=int, default=8, help="each parameter is side x side")
    p.add_argument("--implementation", choices=("fused", "foreach", "for-loop"), default="fused")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = p.parse_args(argv)

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from mop_train.train.local_shard_optim import LocalShardAdamW

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=0, world_size=1)
    mesh = init_device_mesh(args.device, (1,))
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    flags = {"fused": dict(fused=True), "foreach": dict(foreach=True), "for-loop": dict(foreach=False)}

    def build(cls):
        g = torch.Generator().manual_seed(0)
        def draw(shape):
            return distribute_tensor(torch.randn(shape, generator=g).to(args.device), mesh, [Shard(0)])
        params = [torch.nn.Parameter(draw((args.side, args.side))) for _ in range(args.params)]
        for q in params:
            q.grad = draw(q.shape)
        return params, cls(params, lr=1e-3, weight_decay=0.1, **flags[args.implementation])

    runs = {name: build(cls) for name, cls in (("torch AdamW", torch.optim.AdamW),
                                                ("LocalShardAdamW", LocalShardAdamW))}
    for _, opt in runs.values():
        for _ in range(3):
            opt.step()
    sync()
    times = {name: [] for name in runs}
    for _ in range(5):
        for name, (_, opt) in runs.items():
            start = time.perf_counter()
            for _ in range(20):
                opt.step()
            sync()
            times[name].append((time.perf_counter() - start) / 20 * 1e3)
    (a, _), (b, _) = runs.values()
    same = all(torch.equal(x.to_local(), y.to_local()) for x, y in zip(a, b))
    for name, ts in times.items():
        print(f"{name:<16} {statistics.median(ts):7.2f} ms per step ({args.params} params of {args.side}x{args.side}, "
              f"{args.implementation}, {args.device}, median of 5 x 20 steps)")
    print(f"same parameters bit for bit after {3 + 5 * 20} steps: {same}")
    dist.destroy_process_group()
    if not same:
        raise SystemExit("the two optimizers disagree")


if __name__ == "__main__":
    main()
