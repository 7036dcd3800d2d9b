"""CPU cost per parameter of OffloadStreamAdamW's host update, alone and while the copy engines
stream (the situation inside a step with host_fraction > 0).

Variants over M fp32 masters and moments in host memory, bf16 gradients arriving in a pinned buffer
and bf16 weights leaving through one:
  three_pass   upcast gradients into an fp32 scratch, torch's fused AdamW, cast the masters to bf16
  tiled        the same three passes per tile of --tile elements (scratch and masters stay in cache)
  fp32_grads   fused AdamW reading fp32 gradients directly (as if the device had upcast them), + cast
  adamw_only   fused AdamW with fp32 gradients, no cast (the kernel's own cost)
  compiled     one torch.compile'd pass: bf16 gradient in, masters/moments updated, bf16 weight out
"busy" repeats each with host->device and device->host copies of pinned buffers running meanwhile.

    python benchmarks/host_update_cpu.py              # GPU machine: 100M elements
    python benchmarks/host_update_cpu.py --smoke      # CPU, tiny (no copies)
JSON goes to $OUT/host_update_cpu.json if OUT is set, else benchmarks/results/host_update_cpu.json
(host_update_cpu_smoke.json for --smoke).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mop_train.ops.offload_adamw import adamw_reference_step  # noqa: E402

HP = dict(lr=1e-4, beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8)


def _adamw(p, g, m, v, step):
    torch._fused_adamw_([p], [g], [m], [v], [], [step], **HP, amsgrad=False, maximize=False)


def make_state(n, pin):
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(n, generator=gen)
    m = torch.randn(n, generator=gen) * 1e-3
    v = torch.rand(n, generator=gen) * 1e-6
    g16 = torch.empty(n, dtype=torch.bfloat16, pin_memory=pin).copy_(torch.randn(n, generator=gen) * 1e-3)
    out16 = torch.empty(n, dtype=torch.bfloat16, pin_memory=pin)
    g32 = torch.empty(n, dtype=torch.float32, pin_memory=pin).copy_(g16)
    return dict(p=p, m=m, v=v, g16=g16, g32=g32, out16=out16, step=torch.tensor(3.0))


def variants(st, tile):
    p, m, v, g16, g32, out16, step = (st[k] for k in ("p", "m", "v", "g16", "g32", "out16", "step"))
    scratch = torch.empty_like(p)

    def three_pass():
        scratch.copy_(g16)
        _adamw(p, scratch, m, v, step)
        out16.copy_(p)

    def tiled():
        for lo in range(0, p.numel(), tile):
            sl = slice(lo, lo + tile)
            scratch[sl].copy_(g16[sl])
            _adamw(p[sl], scratch[sl], m[sl], v[sl], step)
            out16[sl].copy_(p[sl])

    def fp32_grads():
        _adamw(p, g32, m, v, step)
        out16.copy_(p)

    def adamw_only():
        _adamw(p, g32, m, v, step)

    def one_pass(p, m, v, g16, out16, t):
        adamw_reference_step([p], [g16], [m], [v], [t], lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]),
                             eps=HP["eps"], weight_decay=HP["weight_decay"])
        out16.copy_(p)

    compiled_fn = torch.compile(one_pass, dynamic=False)

    def compiled():
        compiled_fn(p, m, v, g16, out16, 3)

    return dict(three_pass=three_pass, tiled=tiled, fp32_grads=fp32_grads, adamw_only=adamw_only,
                compiled=compiled)


class Copies:
    """Host<->device copies of pinned buffers on two streams, looping until stopped."""

    def __init__(self, nbytes):
        self.h_src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
        self.h_dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.d_dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        self.d_src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(2)
        self.streams = [torch.cuda.Stream() for _ in range(2)]
        self.stop = threading.Event()
        self.moved = 0

    def _loop(self):
        while not self.stop.is_set():
            with torch.cuda.stream(self.streams[0]):
                self.d_dst.copy_(self.h_src, non_blocking=True)
            with torch.cuda.stream(self.streams[1]):
                self.h_dst.copy_(self.d_src, non_blocking=True)
            for s in self.streams:
                s.synchronize()
            self.moved += 2 * self.h_src.numel()

    def __enter__(self):
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.t0 = time.perf_counter()
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.rate = self.moved / (time.perf_counter() - self.t0)
        self.stop.clear()
        self.moved = 0
        return False


def timed(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, default=100_000_000)
    ap.add_argument("--tile", type=int, default=1 << 20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    if args.smoke:
        args.numel, args.tile, args.repeats = 100_003, 4096, 2
    st = make_state(args.numel, pin=cuda)
    rows = []
    copies = Copies(256 << 20) if cuda else None
    for name, fn in variants(st, args.tile).items():
        try:
            row = dict(variant=name, idle_ns_per_param=timed(fn, args.repeats) / args.numel * 1e9)
            if copies is not None:
                with copies:
                    busy = timed(fn, args.repeats)
                row.update(busy_ns_per_param=busy / args.numel * 1e9, copy_gb_per_s=copies.rate / 1e9)
        except Exception as err:  # e.g. no C++ compiler for torch.compile: report, keep the others
            row = dict(variant=name, error=f"{type(err).__name__}: {str(err)[:300]}")
        rows.append(row)
        print(json.dumps(row), flush=True)
    if copies is not None:
        with copies:
            time.sleep(1.0)
        idle_copy_rate = copies.rate
    else:
        idle_copy_rate = None
    result = dict(numel=args.numel, tile=args.tile, threads=torch.get_num_threads(), torch=torch.__version__,
                  copies_alone_gb_per_s=idle_copy_rate and idle_copy_rate / 1e9, rows=rows,
                  date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out_dir, exist_ok=True)
    # a smoke run never overwrites a recorded result
    with open(os.path.join(out_dir, "host_update_cpu_smoke.json" if args.smoke else "host_update_cpu.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nthreads {result['threads']}, copies alone {result['copies_alone_gb_per_s'] or 0:.1f} GB/s (both ways)")
    print(f"{'variant':<12} {'idle ns/param':>13} {'busy ns/param':>13} {'copies GB/s':>11}")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:<12} error: {r['error'][:80]}")
        else:
            print(f"{r['variant']:<12} {r['idle_ns_per_param']:>13.3f} {r.get('busy_ns_per_param', 0):>13.3f} "
                  f"{r.get('copy_gb_per_s', 0):>11.1f}")


if __name__ == "__main__":
    main()
