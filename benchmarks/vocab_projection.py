"""Vocabulary projection + cross-entropy, forward + backward: full logits vs Liger vs Cut CE vs Ring-DTP
(both schedules: "recompute", four GEMM passes; "grad_in_forward", three).

    python benchmarks/vocab_projection.py                 # one GPU: N=16384, H=7168, V=200000, bf16 + fp32
    python benchmarks/vocab_projection.py --smoke         # tiny shapes, runs on CPU too
    torchrun --nproc_per_node=8 benchmarks/vocab_projection.py --ring   # Table 2 shape on P GPUs

Every method sees the same inputs and is measured the same way, one method at a time:
  time: CUDA events around loss + backward, after warm-up, median of repeats (gradients reset to
        None before each pass, so their allocation is part of the pass);
  peak: torch.cuda.max_memory_allocated() after reset_peak_memory_stats(), over one pass, minus
        what was allocated before the pass: `above_inputs_gib` is the method's own working set plus
        the gradients it produces; `peak_gib` adds the bytes of the inputs X, W, targets.
The full-logits "standard" is F.cross_entropy(x @ w.T upcast to fp32). Liger and Cut CE run with
their defaults (Cut CE filters small softmax gradients by default, so it is not exact).
Accuracy (one device): `rel_err_*` against the first method (the standard), and `truth_err_*` against
an fp64 computation from the same (rounded) inputs, token chunk by chunk (--no-truth to skip it).
Writes JSON to $OUT/<name>.json if $OUT is set, else benchmarks/results/<name>.json (--name).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mop_train.ops.ring_dtp import ring_dtp_cross_entropy, ring_dtp_peak_bytes  # noqa: E402

GIB = 2 ** 30


def standard(x, w, t, group=None):
    return F.cross_entropy((x @ w.t()).float(), t, reduction="sum")


def liger(x, w, t, group=None):
    from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
    return LigerFusedLinearCrossEntropyLoss(reduction="sum")(w, x, t)


def cut_ce(x, w, t, group=None):
    from cut_cross_entropy import linear_cross_entropy
    return linear_cross_entropy(x, w, t, reduction="sum")


def ring_dtp(block_size, vocab_size, mode="auto", schedule="recompute", token_chunk=None):
    def run(x, w, t, group=None):
        return ring_dtp_cross_entropy(x, w, t, group, vocab_size=vocab_size, mode=mode, reduction="sum",
                                      block_size=block_size, schedule=schedule, token_chunk=token_chunk)
    return run


def truth(x, w, t, chunk=2048):
    """fp64 loss, dX, dW of the sum over tokens from x, w as given (already rounded), chunk by chunk."""
    w64 = w.detach().double().requires_grad_()
    dx = torch.empty(x.shape, dtype=torch.float64, device=x.device)
    loss = torch.zeros((), dtype=torch.float64, device=x.device)
    for start in range(0, x.shape[0], chunk):
        xc = x.detach()[start:start + chunk].double().requires_grad_()
        part = F.cross_entropy(xc @ w64.t(), t[start:start + chunk], reduction="sum")  # [chunk, V] logits
        part.backward()                                                 # dW accumulates in w64.grad
        loss += part.detach()
        dx[start:start + chunk] = xc.grad
    return loss, dx, w64.grad


class _FourGemms(torch.autograd.Function):
    """Only the GEMMs of an exact bounded-memory schedule: logits blocks in forward; recomputed
    logits, dX += g W_blk and dW_blk = g^T X in backward (no softmax, bf16 accumulation of dX).
    Its time is the floor of any design that recomputes the logits once (4 N*V*H passes)."""

    @staticmethod
    def forward(ctx, x, w, block_size):
        for start in range(0, w.shape[0], block_size):
            x @ w[start:start + block_size].t()
        ctx.save_for_backward(x, w)
        ctx.block_size = block_size
        return x.new_zeros(())

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        dx, dw = torch.zeros_like(x), torch.empty_like(w)
        for start in range(0, w.shape[0], ctx.block_size):
            w_blk = w[start:start + ctx.block_size]
            z = x @ w_blk.t()
            dx.addmm_(z, w_blk)
            torch.mm(z.t(), x, out=dw[start:start + ctx.block_size])
        return dx, dw, None


def four_gemms(block_size):
    def run(x, w, t, group=None):
        return _FourGemms.apply(x, w, block_size)
    return run


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _one_pass(fn, x, w, t, group):
    x.grad = w.grad = None
    fn(x, w, t, group).backward()


def measure(fn, x, w, t, *, group=None, warmup=1, repeats=3):
    """Median seconds of loss + backward and the peak of one pass (CUDA; CPU: time only)."""
    device = x.device
    for _ in range(warmup):
        _one_pass(fn, x, w, t, group)
    times = []
    for _ in range(repeats):
        _sync(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            _one_pass(fn, x, w, t, group)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            _one_pass(fn, x, w, t, group)
            times.append(time.perf_counter() - begin)
    result = {"time_s": statistics.median(times)}
    if device.type == "cuda":
        x.grad = w.grad = None
        _sync(device)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        _one_pass(fn, x, w, t, group)
        _sync(device)
        above = torch.cuda.max_memory_allocated(device) - base
        inputs = sum(a.numel() * a.element_size() for a in (x, w, t))
        result.update(peak_gib=(above + inputs) / GIB, above_inputs_gib=above / GIB)
    return result


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _inputs(n, h, v_rows, dtype, device, seed):
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(n, h, generator=gen, device=device, dtype=torch.float32).to(dtype).requires_grad_()
    w = (torch.randn(v_rows, h, generator=gen, device=device) / h ** 0.5).to(dtype).requires_grad_()
    return x, w


def single_device(args, device):
    rows = []
    for dtype in args.dtypes:
        x, w = _inputs(args.n, args.h, args.v, dtype, device, seed=0)
        t = torch.randint(0, args.v, (args.n,), device=device)
        methods = {"standard": standard}
        if device.type == "cuda":
            methods.update({"liger": liger, "cut_ce": cut_ce})
        for b in args.block_sizes:
            methods[f"ring_dtp recompute b={b}"] = ring_dtp(b, args.v)
        for c in args.token_chunks:
            methods[f"ring_dtp grad_in_forward c={c}"] = ring_dtp(args.block_sizes[-1], args.v,
                                                                  schedule="grad_in_forward", token_chunk=c)
        for b in args.gemm_floor_blocks:
            methods[f"4 GEMMs only b={b}"] = four_gemms(b)
        reference = None
        true = truth(x, w, t) if args.truth else None
        for name, fn in methods.items():
            row = {"method": name, "dtype": str(dtype).removeprefix("torch."), "N": args.n, "H": args.h,
                   "V": args.v, "P": 1}
            try:
                row.update(measure(fn, x, w, t, warmup=args.warmup, repeats=args.repeats))
                x.grad = w.grad = None
                loss = fn(x, w, t)
                loss.backward()
                got = (loss.detach(), x.grad, w.grad)
                if reference is None:
                    reference = got
                if not name.startswith("4 GEMMs"):  # a timing floor, not a loss
                    row.update({f"rel_err_{k}": _rel(a, r) for k, a, r in zip(("loss", "dx", "dw"), got, reference)})
                    if true is not None:
                        row.update({f"truth_err_{k}": _rel(a.double(), r) for k, a, r in
                                    zip(("loss", "dx", "dw"), got, true)})
            except Exception as err:  # a baseline missing or failing must not hide the others
                row["error"] = f"{type(err).__name__}: {str(err)[:200]}"
            if name.startswith("ring_dtp"):
                gif = "grad_in_forward" in name
                size = int(name.split("=")[1])
                row["bound_gib"] = ring_dtp_peak_bytes(
                    args.n, args.h, args.v, 1, dtype=dtype, block_size=args.block_sizes[-1] if gif else size,
                    schedule="grad_in_forward" if gif else "recompute", token_chunk=size if gif else None,
                    impl="triton" if device.type == "cuda" else "torch") / GIB
            x.grad = w.grad = None
            rows.append(row)
            print(json.dumps(row), flush=True)
        del x, w, t, reference, true
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def ring(args, device):
    """P ranks (torchrun): every rank its own N tokens; standard holds the full W, ours a shard."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))
    shard = -(-args.v // world)
    lo, hi = min(args.v, rank * shard), min(args.v, (rank + 1) * shard)
    rows = []
    for n in args.ring_tokens:
        for dtype in args.dtypes:
            x, w_full = _inputs(n, args.h, args.v, dtype, device, seed=rank)
            t = torch.randint(0, args.v, (n,), device=device)
            w_shard = w_full.detach()[lo:hi].clone().requires_grad_()
            cases = [("standard", standard, w_full, None)]
            cases += [(f"ring_dtp recompute {m}", ring_dtp(args.block_sizes[0], args.v, m), w_shard, group)
                      for m in ("auto", "move_activations", "move_weights")]
            cases += [(f"ring_dtp grad_in_forward c={c}", ring_dtp(args.block_sizes[0], args.v, "auto",
                                                                   "grad_in_forward", c), w_shard, group)
                      for c in args.token_chunks]
            for name, fn, w, g in cases:
                row = {"method": name, "dtype": str(dtype).removeprefix("torch."), "N": n, "H": args.h,
                       "V": args.v, "P": world}
                row.update(measure(fn, x, w, t, group=g, warmup=args.warmup, repeats=args.repeats))
                gathered = [None] * world
                dist.all_gather_object(gathered, row)
                if rank == 0:
                    worst = max(gathered, key=lambda r: r.get("peak_gib", r["time_s"]))
                    rows.append(worst | {"time_s": max(r["time_s"] for r in gathered)})
                    print(json.dumps(rows[-1]), flush=True)
            del x, w_full, w_shard
    return rows


def table(rows):
    lines = [f"{'method':<37}{'dtype':<10}{'N':>7}{'P':>3}{'time s':>9}{'peak GiB':>10}{'above in.':>10}"
             f"{'rel err dW':>12}{'dW vs fp64':>12}"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['method']:<37}{r['dtype']:<10}{r['N']:>7}{r['P']:>3}  {r['error'][:60]}")
            continue
        peak = f"{r['peak_gib']:>10.3f}{r['above_inputs_gib']:>10.3f}" if "peak_gib" in r else f"{'-':>10}{'-':>10}"
        err = "".join(f"{r[k]:>12.2e}" if k in r else f"{'-':>12}" for k in ("rel_err_dw", "truth_err_dw"))
        lines.append(f"{r['method']:<37}{r['dtype']:<10}{r['N']:>7}{r['P']:>3}{r['time_s']:>9.4f}{peak}{err}")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU or GPU)")
    parser.add_argument("--ring", action="store_true", help="P ranks under torchrun (Table 2 shape)")
    parser.add_argument("--n", type=int, default=16384)
    parser.add_argument("--h", type=int, default=7168)
    parser.add_argument("--v", type=int, default=200_000)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--block-sizes", default="2048,4096,8192")
    parser.add_argument("--token-chunks", default="2048,4096",
                        help="tokens per rank per grad_in_forward round, one row each ('' for none)")
    parser.add_argument("--no-truth", dest="truth", action="store_false",
                        help="skip the fp64 ground truth (one device)")
    parser.add_argument("--gemm-floor-blocks", default="8192",
                        help="block sizes of the GEMMs-only floor rows ('' for none)")
    parser.add_argument("--ring-tokens", default="16384,32768")
    parser.add_argument("--name", default="vocab_projection", help="JSON file name (no extension)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.smoke:
        args.n, args.h, args.v, args.ring_tokens, args.block_sizes = 96, 64, 1000, "64,160", "128,512"
        args.token_chunks = "16,96"
    args.dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    args.block_sizes = [int(b) for b in args.block_sizes.split(",")]
    args.gemm_floor_blocks = [min(int(b), args.v) for b in args.gemm_floor_blocks.split(",") if b]
    args.ring_tokens = [int(n) for n in args.ring_tokens.split(",")]
    args.token_chunks = [int(c) for c in args.token_chunks.split(",") if c]
    if args.ring:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() \
            else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        rows = ring(args, device)
        is_writer = dist.get_rank() == 0
    else:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        rows = single_device(args, device)
        is_writer = True
    if is_writer:
        meta = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                "torch": torch.__version__, "smoke": args.smoke, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
        os.makedirs(out_dir, exist_ok=True)
        name = f"{args.name}.json"
        with open(os.path.join(out_dir, name), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        print(table(rows))
    if args.ring:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
