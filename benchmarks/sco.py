"""SCO benchmark: device peak, host bytes and step time across a host-budget sweep, and the largest
batch that completes with SCO off and on.

    python benchmarks/sco.py            # one H200, about 3-4 minutes
    python benchmarks/sco.py --smoke    # CPU, tiny shapes: checks that the script works

Model: the zoo's `gpt-oss-20b-shape` (H=2880, GQA 64/8 heads of width 64, 32 experts of I=2880,
top-4), all 24 blocks by default (`--layers`), bf16 weights, random init. The step is embeddings
-> blocks -> final norm, then backward from a random gradient on the hidden states [B, S, H]; the
vocabulary projection and loss are left out (that live set is Ring-DTP's). Every block is
activation-checkpointed (non-reentrant): plainly at budget 0, through SCO otherwise.

Sweep: host budget = k boundaries for k = 0, L/4, L/2, 3L/4, L at --batch x --seq tokens; per
budget, the device peak (max_memory_allocated over the timed steps), host bytes, median step time
(CUDA events, after a warm-up step that also allocates the pinned arena) and SCO's exposed wait.
Largest batch: sequences of --search-seq tokens, doubled then bisected until a step runs out of
memory, with SCO off and with a budget for every boundary. So that the search stays fast, the
device is capped (torch.cuda.set_per_process_memory_fraction) at the model state (bf16 weights +
gradients) plus --activation-gib; the gain is a property of the activation memory, which the cap
sets, not of the 141 GB the H200 has. Results go to benchmarks/results/sco.json (or $OUT/sco.json).

Legend: L blocks, B batch (sequences), S sequence length, H hidden, u = B*S*H*2 bytes per boundary.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mop_train.models.attention import rope_cos_sin  # noqa: E402
from mop_train.models.zoo import build_model, get_model_args  # noqa: E402
from mop_train.ops.sco import SelectiveCheckpointOffload, boundary_bytes, checkpointed  # noqa: E402
from mop_train.train.metrics import DeviceSpan  # noqa: E402

GIB = 1 << 30


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model and shapes")
    p.add_argument("--layers", type=int, default=24, help="blocks of gpt-oss-20b-shape (24 = all)")
    p.add_argument("--batch", type=int, default=2, help="sequences per step in the budget sweep")
    p.add_argument("--seq", type=int, default=16384, help="sequence length of the budget sweep")
    p.add_argument("--search-seq", type=int, default=4096, help="sequence length of the batch search")
    p.add_argument("--max-batch", type=int, default=64, help="largest batch the search tries")
    p.add_argument("--activation-gib", type=float, default=24.0,
                   help="device memory beyond the model state during the batch search")
    p.add_argument("--repeats", type=int, default=3, help="timed steps per budget")
    return p.parse_args(argv)


def build(args):
    """(model, device, dtype) for the benchmark; the smoke model keeps the family, shrinks sizes."""
    model_args = get_model_args("gpt-oss-20b-shape")
    if args.smoke:
        model_args = dataclasses.replace(model_args, dim=64, n_layers=args.layers, n_heads=4, n_kv_heads=2,
                                         head_dim=16, num_experts=4, top_k=2, moe_inter_dim=64,
                                         vocab_size=512)
        return build_model(model_args, "cpu"), torch.device("cpu"), torch.float32
    model_args = dataclasses.replace(model_args, n_layers=args.layers)
    device = torch.device("cuda")
    return build_model(model_args, device, dtype=torch.bfloat16), device, torch.bfloat16


def run_step(model, layers, tokens: torch.Tensor, grad: torch.Tensor) -> None:
    """Embeddings -> checkpointed blocks -> norm, backward from `grad` [B, S, H]."""
    positions = torch.arange(tokens.shape[1], device=tokens.device)
    rope = rope_cos_sin(positions, model.rope_inv_freq)                # [S, r/2, 2]
    h = model.tok_embeddings(tokens)                                   # [B, S, H]
    for layer in layers:
        h = layer(h, rope)
    model.norm(h).backward(grad)


def wrapped_layers(model, budget: int | None, device):
    """The model's blocks, each checkpointed plainly (budget None) or through one SCO."""
    blocks = list(model.layers.values())
    if budget is None:
        return [checkpointed(b) for b in blocks], None
    sco = SelectiveCheckpointOffload(budget, device=device)
    return [sco.wrap(b) for b in blocks], sco


def step_inputs(model, batch: int, seq: int, device, dtype, seed: int):
    gen = torch.Generator(device=device).manual_seed(seed)
    tokens = torch.randint(0, model.args.vocab_size, (batch, seq), device=device, generator=gen)
    grad = torch.randn(batch, seq, model.args.dim, device=device, generator=gen).to(dtype)
    return tokens, grad


def measure_budget(model, k: int, args, device, dtype) -> dict:
    """One row of the sweep: host budget of k boundaries (None = plain checkpointing at k = 0)."""
    u = boundary_bytes(args.batch * args.seq, model.args.dim, dtype)
    layers, sco = wrapped_layers(model, k * u if k else None, device)
    tokens, grad = step_inputs(model, args.batch, args.seq, device, dtype, seed=k)
    run_step(model, layers, tokens, grad)  # warm-up (pinned arena, kernels, allocator)
    times, peaks, waits = [], [], []
    for _ in range(args.repeats):
        if sco is not None:
            sco.begin_step()
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        with DeviceSpan(device) as span:
            run_step(model, layers, tokens, grad)
        times.append(span.seconds())
        peaks.append(torch.cuda.max_memory_allocated() if device.type == "cuda" else 0)
        waits.append(sco.last_step_stats()["wait_s"] if sco is not None else 0.0)
    stats = sco.last_step_stats() if sco is not None else {"offloaded_layers": 0, "host_bytes": 0}
    return {"boundaries_budget": k, "host_budget_bytes": k * u, "boundary_bytes": u,
            "offloaded_layers": stats["offloaded_layers"], "host_bytes": stats["host_bytes"],
            "pinned_bytes": sco.pinned_bytes if sco is not None else 0,
            "device_peak_bytes": max(peaks), "step_s": statistics.median(times),
            "wait_s": statistics.median(waits)}


def completes(model, batch: int, sco_on: bool, args, device, dtype) -> bool:
    """Does one step at `batch` x search-seq tokens run without running out of device memory?"""
    budget = len(model.layers) * boundary_bytes(batch * args.search_seq, model.args.dim, dtype) if sco_on else None
    ok = True
    try:
        layers, _ = wrapped_layers(model, budget, device)
        tokens, grad = step_inputs(model, batch, args.search_seq, device, dtype, seed=batch)
        run_step(model, layers, tokens, grad)
        if device.type == "cuda":
            torch.cuda.synchronize()
    except torch.OutOfMemoryError:
        ok = False
    layers = tokens = grad = None
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return ok


def largest_batch(model, sco_on: bool, args, device, dtype) -> int:
    """Largest batch <= --max-batch whose step completes (doubling, then bisection)."""
    lo, hi = 0, None  # lo completes (0 trivially), hi fails
    batch = 1
    while batch <= args.max_batch:
        if not completes(model, batch, sco_on, args, device, dtype):
            hi = batch
            break
        lo, batch = batch, batch * 2
    if hi is None:
        hi = args.max_batch + 1
        if lo < args.max_batch and completes(model, args.max_batch, sco_on, args, device, dtype):
            return args.max_batch
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if completes(model, mid, sco_on, args, device, dtype):
            lo = mid
        else:
            hi = mid
    return lo


def cap_device_memory(model, args, device, dtype) -> int:
    """Cap the allocator at model state (weights + grads, measured) + --activation-gib; return the cap."""
    layers, _ = wrapped_layers(model, None, device)
    tokens, grad = step_inputs(model, 1, 128, device, dtype, seed=0)
    run_step(model, layers, tokens, grad)  # allocates every gradient
    del layers, tokens, grad
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    state = torch.cuda.memory_allocated()
    cap = state + int(args.activation_gib * GIB)
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(cap / total, 1.0), torch.cuda.current_device())
    return cap


def report(rows, search, meta) -> str:
    lines = [f"SCO on {meta['device']}: {meta['model']}, L={meta['layers']}, sweep B={meta['batch']} x "
             f"S={meta['seq']}, boundary {rows[0]['boundary_bytes'] / (1 << 20):.1f} MiB",
             f"{'budget (bounds)':>15} {'offloaded':>9} {'host MiB':>10} {'peak GiB':>9} {'step s':>8} "
             f"{'vs off':>7} {'wait ms':>8}"]
    base = rows[0]["step_s"]
    for r in rows:
        peak = f"{r['device_peak_bytes'] / GIB:>9.3f}" if r["device_peak_bytes"] else f"{'n/a':>9}"
        lines.append(f"{r['boundaries_budget']:>15} {r['offloaded_layers']:>9} {r['host_bytes'] / (1 << 20):>10.1f} "
                     f"{peak} {r['step_s']:>8.3f} "
                     f"{100 * (r['step_s'] / base - 1):>+6.2f}% {1000 * r['wait_s']:>8.2f}")
    peaks = [r["device_peak_bytes"] for r in rows]
    worst = max(abs(r["step_s"] / base - 1) for r in rows)
    gain = search["on"] / search["off"] - 1 if search["off"] else float("nan")
    lines += [f"largest batch (S={meta['search_seq']}, cap {meta['cap_bytes'] / GIB:.1f} GiB): "
              f"SCO off {search['off']}, on {search['on']} ({100 * gain:+.1f}%)",
              f"goals: peak strictly decreasing {all(a > b for a, b in zip(peaks, peaks[1:]))}; "
              f"step within 2% {worst <= 0.02} (worst {100 * worst:.2f}%); batch >= +35% {gain >= 0.35}"]
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.smoke:
        args.layers, args.batch, args.seq, args.search_seq = min(args.layers, 4), 2, 64, 32
        args.max_batch, args.repeats = 4, 2
    else:
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run with --smoke on CPU")
    torch.manual_seed(0)
    model, device, dtype = build(args)
    L = len(model.layers)
    cap = cap_device_memory(model, args, device, dtype) if device.type == "cuda" else 0
    ks = sorted({0, L // 4, L // 2, (3 * L) // 4, L})
    rows = []
    for k in ks:  # progress goes to stderr; the table is printed last
        rows.append(measure_budget(model, k, args, device, dtype))
        print(f"budget {k} boundaries: {rows[-1]}", file=sys.stderr, flush=True)
    search = {}
    for mode, sco_on in (("off", False), ("on", True)):
        search[mode] = largest_batch(model, sco_on, args, device, dtype)
        print(f"largest batch, SCO {mode}: {search[mode]}", file=sys.stderr, flush=True)
    meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke)",
            "model": "gpt-oss-20b-shape" + (" (smoke-sized)" if args.smoke else ""),
            "params": sum(p.numel() for p in model.parameters()), "layers": L, "batch": args.batch,
            "seq": args.seq, "search_seq": args.search_seq, "cap_bytes": cap,
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    table = report(rows, search, meta)
    out_dir = Path(os.environ.get("OUT") or Path(__file__).resolve().parent / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    name = "sco_smoke.json" if args.smoke else "sco.json"
    (out_dir / name).write_text(json.dumps({"meta": meta, "sweep": rows, "largest_batch": search}, indent=2))
    print(table)


if __name__ == "__main__":
    main()
