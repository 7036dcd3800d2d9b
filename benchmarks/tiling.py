"""Sequence tiling ([mop.tiling], mop_train.ops.tiling) on the GPU: bytes per token, a block's peak, steps.

Phases (one per command; each fits a 600 s device command at the sizes below):
  core   the attention core alone at `small`'s per-rank shape at D = 1 (MLA, h = 16, d_qk = 192, d_v = 128,
         bf16, causal), as the block calls it (plain, and keep's explicit kernels): bytes per token it adds in
         forward (its output, log-sum-exp, anything else it saves) and the peak beyond that in backward (dq, dk,
         dv and the backward kernel's workspace; q, k, v and the output's gradient are inputs here), against the
         plan's per-token figures: out + lse (part of models.memory.core_saved_bytes) and dq + dk + dv +
         models.memory.core_workspace_bytes (cuDNN's fp32 dQ accumulator and row sums) = plan_backward.
         These are what stay whole under tiling.
  block  one `small` block (the dense-FFN block 0 and the MoE block 1, local experts) under activation
         checkpointing at --seq-len: peak memory of forward + backward beyond its input and weights, and
         its time, untiled / FFN tiled / attention stages tiled / both (tiles "auto"), against the plan's
         block term (plan.block.block_bound); the tiled results' forward output and input gradient against
         the untiled ones (bf16 on the GPU: the GEMMs pick kernels by row count, so not bitwise).
  train  real steps of `small` on one GPU with every operator (PipelinedLLEP, Ring-DTP, SCO auto,
         OffloadStreamAdamW) plus tiling, per --variants: tiled ("auto" tiles), tiled+keep, untiled; tokens/s,
         peak, and the plan's total printed at launch. At 131K "tiled" vs "untiled" is the 0.97x speed goal;
         at 524K "tiled" vs "tiled+keep" says which is faster, and each run's peak against its plan says
         which reaches further (keep adds B*S/D*h*(2 d_v + 4) bytes per layer).

    python benchmarks/tiling.py --phase core                                   # H200, ~1 min
    python benchmarks/tiling.py --phase block --seq-len 131072                 # H200, ~3 min
    python benchmarks/tiling.py --phase train --seq-len 524288 --variants tiled  # H200, one step, ~4 min
    python benchmarks/tiling.py --smoke                                        # CPU, every phase tiny
JSON to $OUT/tiling_<phase>.json if OUT is set, else benchmarks/results/; a table to stdout last.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import sys
import time
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mop_train.models import zoo  # noqa: E402
from mop_train.models.attention import ScaledDotProductAttention, rope_cos_sin, rope_inv_freq  # noqa: E402
from mop_train.models.attention_backends import sdpa_choice  # noqa: E402
from mop_train.models.memory import (core_gradient_bytes, core_saved_bytes, core_workspace_bytes,  # noqa: E402
                                     kept_core_bytes, tiling_options)
from mop_train.models.model import TransformerBlock, tile_blocks  # noqa: E402
from mop_train.ops.moe_dispatch.memory import RoutedShapes, device_bound  # noqa: E402
from mop_train.ops.sco.reference import checkpointed  # noqa: E402
from mop_train.ops.tiling import TilingOptions  # noqa: E402
from mop_train.plan.block import dense_block_bound, moe_block_bound  # noqa: E402
from mop_train.sweep import run_point  # noqa: E402

GIB = 2 ** 30
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EVERY_OPERATOR = ["--mop.moe.dispatch", "pipelined_llep", "--mop.ring_dtp.enable", "--mop.sco.host_budget", "auto",
                  "--optimizer.name", "OffloadStreamAdamW", "--training.local_batch_size", "1"]
TILES = ["--mop.tiling.ffn_tokens", "auto", "--mop.tiling.block_tokens", "auto"]
VARIANTS = {"tiled": TILES, "tiled+keep": TILES + ["--mop.attention.keep"], "untiled": []}


class Meter:
    """Allocated bytes and elapsed time on CUDA (events); on CPU only time (memory is None)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def allocated(self) -> int | None:
        return torch.cuda.memory_allocated() if self.cuda else None

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def peak(self) -> int | None:
        return torch.cuda.max_memory_allocated() if self.cuda else None

    def sync(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


def _per_token(value: int | None, tokens: int) -> int | None:
    return None if value is None else round(value / tokens)


def phase_core(args, device, meter: Meter) -> list[dict]:
    h, d_qk, d_v = (2, 24, 16) if args.smoke else (16, 192, 128)
    lengths = [256] if args.smoke else [int(s) for s in args.core_lengths.split(",")]
    model_args = zoo.get_model_args("small")
    rows = []
    for S in lengths:
        for keep in (False, True):
            core = ScaledDotProductAttention()
            core.keep = keep                      # keep: the explicit kernels, out and lse kept on the node
            gen = torch.Generator(device=device).manual_seed(S)
            q, k, v = (torch.randn(1, S, h, d, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_()
                       for d in (d_qk, d_qk, d_v))

            gout = torch.randn(1, S, h, d_v, device=device, dtype=torch.bfloat16, generator=gen)
            for _ in range(2):                    # the first call is the warm-up (kernel selection, workspace)
                q.grad = k.grad = v.grad = None
                meter.reset_peak()
                before = meter.allocated()
                start = meter.sync()
                out = core(q, k, v)
                after_forward = meter.allocated()
                out.backward(gout)
                seconds = meter.sync() - start
                peak = meter.peak()
                del out
            saved = None if before is None else after_forward - before
            backward = None if peak is None else peak - after_forward
            row = {"S": S, "method": "keep (explicit kernels)" if keep else "plain (as the block calls it)",
                   "backend": sdpa_choice(*(t.detach().transpose(1, 2) for t in (q, k, v))),
                   "forward_B_per_token": _per_token(saved, S), "backward_B_per_token": _per_token(backward, S),
                   "seconds": round(seconds, 4)}
            if not args.smoke:
                grads = (2 * h * d_qk + h * d_v) * 2                      # dq, dk, dv (bf16)
                planned = grads + core_workspace_bytes(model_args, S) / S
                row["plan_forward_B_per_token"] = kept_core_bytes(model_args, 1, 2)
                row["plan_backward_B_per_token"] = round(planned)
                row["plan_workspace_B_per_token"] = round(core_workspace_bytes(model_args, S) / S)
                row["backward_vs_plan"] = None if backward is None else round(backward / S / planned, 3)
                row["plan_core_saved_B_per_token"] = core_saved_bytes(model_args, 1, 2)
                row["plan_core_grads_B_per_token"] = core_gradient_bytes(model_args, 1, 2)
                row["inputs_B_per_token"] = (2 * h * d_qk + h * d_v) * 2
            rows.append(row)
            del q, k, v, gout
    return rows


def _block_args(args):
    a = zoo.get_model_args("small")
    if args.smoke:
        a = replace(zoo.get_model_args("debug"), n_heads=4)
    return a


def _run_block(block, x, rope, meter: Meter):
    xl = x.detach().clone().requires_grad_()
    meter.reset_peak()
    before = meter.allocated()
    start = meter.sync()
    y = block(xl, rope)
    y.backward(torch.ones_like(y) / y.shape[-1] ** 0.5)
    seconds = meter.sync() - start
    peak = meter.peak()
    return y.detach(), xl.grad, seconds, None if peak is None else peak - before


def _planned(a, S: int, layer: int, tiling: TilingOptions) -> int:
    """The plan's peak for this block (plan.block) with local experts."""
    if layer < a.n_dense_layers:
        return dense_block_bound(a, S, 2, tiling)[0]
    routed = device_bound(None, RoutedShapes(tokens=S, hidden=a.dim, inter=a.moe_inter_dim, top_k=a.top_k,
                                             group_size=1, local_experts=a.num_experts, act_bytes=2))
    return moe_block_bound(a, S, 2, tiling, routed)[0]


def phase_block(args, device, meter: Meter) -> list[dict]:
    a = _block_args(args)
    S = 512 if args.smoke else args.seq_len
    rope = rope_cos_sin(torch.arange(S, device=device), rope_inv_freq(a.rope_dim, a.rope_theta, device=device))
    resolved = tiling_options(argparse.Namespace(ffn_tokens="auto", block_tokens="auto"), a, tokens=S, act_bytes=2)
    tiles = (resolved.ffn_tokens or 64, resolved.block_tokens or 64) if args.smoke else \
        (resolved.ffn_tokens, resolved.block_tokens)
    rows = []
    for layer in (0, a.n_dense_layers):
        torch.manual_seed(layer)
        block = TransformerBlock(layer, a).to(device)
        block.init_weights()
        block = block.to(torch.bfloat16)
        x = torch.randn(1, S, a.dim, device=device, dtype=torch.bfloat16)
        _run_block(checkpointed(copy.deepcopy(block)), x, rope, meter)            # warm-up, not recorded
        base = None
        for name, (ffn, blk) in (("untiled", (0, 0)), ("ffn tiled", (tiles[0], 0)), ("block tiled", (0, tiles[1])),
                                 ("both tiled", tiles)):
            wrapped = checkpointed(copy.deepcopy(block))
            tile_blocks(wrapped, ffn, blk)
            y, dx, seconds, peak = _run_block(wrapped, x, rope, meter)
            planned = _planned(a, S, layer, TilingOptions(ffn, blk))
            row = {"layer": layer, "kind": "MoE" if layer >= a.n_dense_layers else "dense", "S": S, "variant": name,
                   "tiles": f"{ffn}/{blk}", "peak_gib": None if peak is None else round(peak / GIB, 3),
                   "plan_gib": round(planned / GIB, 3), "seconds": round(seconds, 3)}
            if base is None:
                base = (y, dx, seconds)
            else:
                row["max_err_y"] = (y.float() - base[0].float()).abs().max().item()
                row["max_err_dx"] = (dx.float() - base[1].float()).abs().max().item()
                row["time_vs_untiled"] = round(seconds / base[2], 3)
            rows.append(row)
            del wrapped, y, dx
    return rows


def _plan_total(log_path: str) -> float | None:
    """The launch's device plan total (GiB), from the run's output."""
    try:
        with open(log_path, errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    found = re.search(r"per-rank memory plan \(estimate\):.*?\n\s+total\s+([\d.]+) GiB", text, re.S)
    return float(found.group(1)) if found else None


def phase_train(args) -> list[dict]:
    config = "configs/debug_cpu.toml" if args.smoke else "configs/small_1gpu.toml"
    seq_lens = [256] if args.smoke else [int(s) for s in args.seq_len_list.split(",")]
    rows = []
    for S in seq_lens:
        for variant in args.variants.split(","):
            folder = os.path.join(args.root, f"tiling-{variant}-S{S}")
            extra = [] if args.smoke else EVERY_OPERATOR
            point = run_point(os.path.join(ROOT, config), 1, folder,
                              ["--training.seq_len", str(S), *extra, *VARIANTS[variant]],
                              steps=args.steps, timeout_s=args.point_timeout)
            point.update(S=S, variant=variant, plan_gib=_plan_total(os.path.join(folder, "output.log")))
            rows.append(point)
            print(json.dumps(point), flush=True)
    return rows


def _table(rows: list[dict]) -> str:
    cols = list(dict.fromkeys(k for r in rows for k in r if k not in ("error", "peak_mem_kind", "final_loss")))
    cells = [[str(r.get(c, "-")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(x.rjust(w) for x, w in zip(cell, widths)) for cell in cells]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phase", choices=("core", "block", "train"), default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, every phase (checks the logic)")
    ap.add_argument("--core-lengths", default="32768,65536,131072", help="core: sequence lengths")
    ap.add_argument("--seq-len", type=int, default=131072, help="block: tokens")
    ap.add_argument("--seq-len-list", default="524288", help="train: comma-separated contexts")
    ap.add_argument("--variants", default="tiled,tiled+keep", help=f"train: any of {', '.join(VARIANTS)}")
    ap.add_argument("--steps", type=int, default=1, help="train: steps per point")
    ap.add_argument("--point-timeout", type=float, default=540, help="train: seconds per point")
    ap.add_argument("--root", default="outputs/tiling", help="train: dump folders")
    args = ap.parse_args()
    if args.phase is None and not args.smoke:
        ap.error("give --phase core|block|train (or --smoke)")
    if args.phase == "train" or args.smoke:
        bad = [v for v in args.variants.split(",") if v not in VARIANTS]
        if bad:
            ap.error(f"--variants {bad}: expected some of {list(VARIANTS)}")
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    meter = Meter(device)
    phases = ("core", "block", "train") if args.smoke and args.phase is None else (args.phase,)
    results = {}
    for phase in phases:
        if phase == "core":
            results[phase] = phase_core(args, device, meter)
        elif phase == "block":
            results[phase] = phase_block(args, device, meter)
        else:
            results[phase] = phase_train(args)
    out_dir = os.environ.get("OUT") or os.path.join(ROOT, "benchmarks", "results")
    os.makedirs(out_dir, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
            "argv": sys.argv[1:], "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    for phase, rows in results.items():
        path = os.path.join(out_dir, f"tiling_{phase}{'_smoke' if args.smoke else ''}.json")
        with open(path, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        print(f"\n{phase} ({path}):\n{_table(rows)}", flush=True)


if __name__ == "__main__":
    main()
