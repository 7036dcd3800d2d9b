"""`small` trained a few steps under several option sets, side by side in one run on one machine:
tokens/s (median of the logged steps after the warm-up), step time, exposed optimizer time, peak
memory, the plan's device total and the loss of the last step; with OffloadStreamAdamW on CUDA also
the step's host-link floor.

    python benchmarks/train_variants.py --variants plain streamed streamed-overlap auto-overlap all-auto \
        --steps 8 --warmup 3 --out $OUT        # one H200: issue 20's goals at B=2 x 4K
    python benchmarks/train_variants.py --variants ops-device all all-bf16 all-gstream all-stream \
        --base all --compute ops-device --steps 6 --warmup 2 --out $OUT   # issue 32 at B=2 x 4K
    python benchmarks/train_variants.py --variants all all-control all-stream --base all \
        --extra=--debug.deterministic --steps 4 --warmup 1 --out $OUT      # bitwise on the GPU too?

On CUDA the every-operator step of `small` is not deterministic from run to run (2026-12-01: `all` and
`all-control` differ; top-8 combines add with atomics), so its `bitwise` column means something there only
under `--debug.deterministic` (torch.use_deterministic_algorithms), with `all-control` showing the base repeats.

Link floor (issue 32's 2 x 4K goal). Before the first variant of a CUDA run, a child process measures
pinned host<->device bandwidth with both directions in flight at once (bw_h2d, bw_d2h:
optimizer_step.link_bandwidth, 8 GiB each way). Per variant, from its metrics.jsonl (medians over the
timed steps): the bytes the step moves over the link, h2d = offload_h2d_gib + M x sco_host_bytes and
d2h = offload_d2h_gib + M x sco_host_bytes (OffloadStreamAdamW's own account of its step, weight
windows and streamed gradients, mop_train/ops/offload_adamw/link.py; SCO's boundaries go down in the
forward and up in backward, M micro-batches); `floor s` = max(h2d / bw_h2d, d2h / bw_d2h); `x floor`
= step s / max(compute s, floor s), where compute s is the step s of the `--compute` variant (default
plain; `ops-device` is every operator with AdamW on the device and no SCO, so nothing crosses the
link: the compute-only step of the `all*` variants). Not counted: the input tokens and the loop's
scalars. Without CUDA or without those fields the floor columns read "-".

A variant is a list of overrides of configs/small_1gpu.toml (or --config; see VARIANTS); every run is a plain
`torchrun -m mop_train.train`, so this measures what users run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from plan_vs_measured import ALL_OPS, CONFIG, planned_gib, train_small  # noqa: E402

OFFLOAD = ["--optimizer.name", "OffloadStreamAdamW"]
TILED = ["--mop.tiling.ffn_tokens", "auto", "--mop.tiling.block_tokens", "auto", "--mop.attention.keep"]
VARIANTS = {
    "plain": [],
    "streamed": OFFLOAD,
    "streamed-overlap": [*OFFLOAD, "--mop.offload_adamw.overlap"],
    "auto": [*OFFLOAD, "--mop.offload_adamw.device_fraction", "auto"],
    "auto-overlap": [*OFFLOAD, "--mop.offload_adamw.device_fraction", "auto", "--mop.offload_adamw.overlap"],
    "all": ALL_OPS,
    # the same run again: does "all" repeat itself bit for bit on this device (the bitwise column's control)?
    "all-control": list(ALL_OPS),
    # the compute of "all" with nothing on the host link: AdamW on the device, no SCO
    "ops-device": ["--mop.moe.dispatch", "pipelined_llep", "--mop.ring_dtp.enable"],
    # what `mop-train plan --auto` picks for one 80 GB GPU at 2 x 4K (2026-12-07): no activation checkpointing,
    # Ring-DTP's grad_in_forward as the P = 1 loss, one FSDP2 gather a block per step; AdamW on the device
    "auto-1gpu-2x4k": ["--activation_checkpoint.mode", "none", "--mop.ring_dtp.enable", "--mop.ring_dtp.schedule",
                       "grad_in_forward", "--parallelism.fsdp_reshard_after_forward", "never"],
    # its choice at 1 x 32K on 80 GB (2026-12-07): PipelinedLLEP as one chunk (it saves only the rows, not the
    # [R, I] activations), no activation checkpointing, grad_in_forward
    "auto-80gb-32k": ["--training.seq_len", "32768", "--training.local_batch_size", "1", "--activation_checkpoint.mode",
                      "none", "--mop.moe.dispatch", "pipelined_llep", "--mop.moe.token_budget", "32768",
                      "--mop.ring_dtp.enable", "--mop.ring_dtp.schedule", "grad_in_forward"],
    "all-auto": [*ALL_OPS, "--mop.offload_adamw.device_fraction", "auto", "--mop.offload_adamw.overlap"],
    "accum4-plain": ["--training.global_batch_size", "8"],
    "accum4-streamed": ["--training.global_batch_size", "8", *OFFLOAD],
    # issue 32: the model's own weights and gradients, every operator on ("all" is device/device)
    "streamed-bf16": [*OFFLOAD, "--mop.offload_adamw.weights", "bf16"],
    "all-bf16": [*ALL_OPS, "--mop.offload_adamw.weights", "bf16"],
    "all-gstream": [*ALL_OPS, "--mop.offload_adamw.gradients", "stream"],
    "all-bf16-gstream": [*ALL_OPS, "--mop.offload_adamw.weights", "bf16", "--mop.offload_adamw.gradients", "stream"],
    "all-stream": [*ALL_OPS, "--mop.offload_adamw.weights", "stream", "--mop.offload_adamw.gradients", "stream"],
    "all-stream-overlap": [*ALL_OPS, "--mop.offload_adamw.weights", "stream", "--mop.offload_adamw.gradients",
                           "stream", "--mop.offload_adamw.overlap"],
    # issue 32's 2 x 4K: the first 28 buckets' state (8.4 GB of staging) copied in during the last backward, while
    # the gradients leave (stage_in_backward); the update still waits for the clipping norm
    "all-stream-staged": [*ALL_OPS, "--mop.offload_adamw.weights", "stream", "--mop.offload_adamw.gradients",
                          "stream", "--mop.offload_adamw.overlap", "--mop.offload_adamw.stage_in_backward",
                          "--mop.offload_adamw.slots", "28"],
    # a CPU share beside the streams (2026-12-06): the CPU updates the share's state from the streamed gradients
    # where they landed and writes its working weights on the host, so its 30 B/param leave the optimizer's link
    "all-stream-host": [*ALL_OPS, "--mop.offload_adamw.weights", "stream", "--mop.offload_adamw.gradients",
                        "stream", "--mop.offload_adamw.overlap", "--mop.offload_adamw.host_fraction", "0.3"],
    # the start-up without the fp32 model on the device ([mop.offload_adamw] host_init)
    "all-stream-hostinit": [*ALL_OPS, "--mop.offload_adamw.weights", "stream", "--mop.offload_adamw.gradients",
                            "stream", "--mop.offload_adamw.host_init"],
    # the 2 x 4K link-floor goal with the state kept on the device where it fits (fewer bytes on the link)
    "all-stream-auto": [*ALL_OPS, "--mop.offload_adamw.weights", "stream", "--mop.offload_adamw.gradients",
                        "stream", "--mop.offload_adamw.overlap", "--mop.offload_adamw.device_fraction", "auto"],
    # issues 32 and 36 at long context: every operator with sequence tiling and the attention kept
    "all-tiled": [*ALL_OPS, *TILED],
    "all-tiled-stream": [*ALL_OPS, *TILED, "--mop.offload_adamw.weights", "stream",
                         "--mop.offload_adamw.gradients", "stream"],
    # one window slot: no prefetch, one block's weights and its expert gradients at the peak (plan P+G 1.62 GiB
    # at 524K against 2.11 with two slots); at long context a block's compute hides nothing it needs to
    "all-tiled-stream-w1": [*ALL_OPS, *TILED, "--mop.offload_adamw.weights", "stream",
                            "--mop.offload_adamw.gradients", "stream", "--mop.offload_adamw.weight_window", "1"],
}
"""Name -> overrides of CONFIG (B=2 x 4K unless --shape says otherwise)."""


def run_variant(name: str, overrides: list[str], *, config: str, nproc: int, steps: int, warmup: int,
                timeout_s: float, out: str) -> dict:
    run = train_small(name, overrides, config=config, nproc=nproc, steps=steps, timeout_s=timeout_s, out=out)
    records, rc = run["records"], run["rc"]
    timed = [r for r in records if r["step"] > warmup]
    row = {"variant": name, "overrides": overrides, "rc": rc, "wall_s": run["wall_s"], "log": run["log"],
           "steps_logged": len(records), "command": run["command"]}
    row["losses"] = [r["loss"] for r in records]
    row["link_bytes"] = _link_bytes(timed)
    if timed:
        tps = statistics.median(r["tokens_per_s"] for r in timed)
        exposed = [r["optimizer_exposed_s"] for r in timed if r.get("optimizer_exposed_s") is not None]
        row.update(tokens_per_s=tps, step_s=statistics.median(r["elapsed_s"] for r in timed),
                   optimizer_s=statistics.median(r["optimizer_s"] for r in timed if r.get("optimizer_s") is not None)
                   if any(r.get("optimizer_s") is not None for r in timed) else None,
                   optimizer_exposed_s=statistics.median(exposed) if exposed else None,
                   peak_gib=max(r["peak_mem_gib"] for r in records), last_loss=records[-1]["loss"])
    return row


def _link_bytes(timed: list[dict]) -> dict | None:
    """Median bytes (h2d, d2h) a timed step moves over the host link (module docstring), or None."""
    if not timed or any(r.get("offload_h2d_gib") is None for r in timed):
        return None
    sco = [r.get("sco_host_bytes", 0) * r.get("micro_batches", 1) for r in timed]
    return {"h2d": statistics.median(r["offload_h2d_gib"] * 2**30 + b for r, b in zip(timed, sco)),
            "d2h": statistics.median(r["offload_d2h_gib"] * 2**30 + b for r, b in zip(timed, sco)),
            "sco": statistics.median(sco)}


def measure_link(out: str) -> dict | None:
    """Pinned host<->device bytes/s, both directions at once ({"h2d", "d2h"}), measured in a child
    process (this one stays off the GPU); None without CUDA."""
    code = ("import json, sys; sys.path.insert(0, 'benchmarks'); import torch\n"
            "if not torch.cuda.is_available(): print(json.dumps(None)); raise SystemExit\n"
            "from optimizer_step import link_bandwidth\n"
            "up, down = link_bandwidth(torch.device('cuda'))\n"
            "print(json.dumps({'h2d': up, 'd2h': down, 'device': torch.cuda.get_device_name()}))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    with open(os.path.join(out, "link_bandwidth.log"), "w") as log:
        log.write(done.stdout + done.stderr)
    if done.returncode != 0:
        print(f"link bandwidth not measured (rc {done.returncode}): {done.stderr.strip()[-300:]}", flush=True)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def link_floor_s(row: dict, link: dict | None) -> float | None:
    """max(h2d / bw_h2d, d2h / bw_d2h) of the row's step, or None."""
    moved = row.get("link_bytes")
    if link is None or moved is None:
        return None
    return max(moved["h2d"] / link["h2d"], moved["d2h"] / link["d2h"])


def launch_plan(log_path: str | None) -> dict | None:
    """The device plan a launch printed ("per-rank memory plan (estimate):", its lines to "total"), in
    planned_gib's form; None where the log holds none."""
    try:
        with open(log_path, errors="replace") as f:
            text = f.read()
    except (OSError, TypeError):
        return None
    block = re.search(r"per-rank memory plan \(estimate\):\n(.*?\n\s+total\s+[\d.]+ GiB)", text, re.S)
    if block is None:
        return None
    terms = {m.group(1): float(m.group(2))
             for m in re.finditer(r"^\s+(\S(?:.*?\S)?)\s{2,}([\d.]+) GiB", block.group(1), re.M)}
    total = terms.pop("total", None)
    return None if total is None else {"device_gib": total, "terms_gib": terms, "source": "launch"}


def table(rows: list[dict], base_name: str = "plain", compute_name: str = "plain", link: dict | None = None) -> str:
    """One line per variant; `x base` and `bitwise` (every logged loss equal to the base's, bit for
    bit) against the variant `base_name`; `plan P+G` is the plan's parameters + gradients lines;
    `floor s` and `x floor` (step s / max(step s of `compute_name`, floor s)) as the module docstring says."""
    base = next((r for r in rows if r["variant"] == base_name and r.get("step_s")), None)
    compute = next((r for r in rows if r["variant"] == compute_name and r.get("step_s")), None)
    lines = [f"{'variant':<18} {'rc':>4} {'tok/s':>9} {'step s':>7} {'x ' + base_name:>9} {'opt s':>6} {'exposed':>8} "
             f"{'peak GiB':>9} {'plan GiB':>9} {'plan P+G':>9} {'loss':>8} {'bitwise':>8} {'h2d GiB':>8} "
             f"{'d2h GiB':>8} {'floor s':>8} {'x floor':>8}"]
    for r in rows:
        if not r.get("step_s"):
            lines.append(f"{r['variant']:<18} {r['rc']!s:>4}  (no timed steps)")
            continue
        rel = f"{r['step_s'] / base['step_s']:.3f}" if base else "-"
        f = (lambda v: "-" if v is None else f"{v:.3f}")
        terms = r["planned"]["terms_gib"]
        same = "-" if base is None else ("yes" if r["losses"] == base["losses"] else "NO")
        lines.append(f"{r['variant']:<18} {r['rc']!s:>4} {r['tokens_per_s']:>9,.0f} {r['step_s']:>7.3f} {rel:>9} "
                     f"{f(r['optimizer_s']):>6} {f(r['optimizer_exposed_s']):>8} {r['peak_gib']:>9.2f} "
                     f"{r['planned']['device_gib']:>9.2f} {terms['parameters'] + terms['gradients']:>9.2f} "
                     f"{r['last_loss']:>8.4f} {same:>8} {_floor_columns(r, compute, link)}")
    if link is not None:
        lines.append(f"link: {link['h2d'] / 1e9:.1f} GB/s host->device and {link['d2h'] / 1e9:.1f} GB/s device->host "
                     f"at once (pinned); x floor = step s / max(step s of {compute_name!r}, floor s)")
    return "\n".join(lines)


def _floor_columns(r: dict, compute: dict | None, link: dict | None) -> str:
    moved, floor = r.get("link_bytes"), link_floor_s(r, link)
    gib = (lambda key: "-" if moved is None else f"{moved[key] / 2**30:.2f}")
    x = "-" if floor is None or compute is None else f"{r['step_s'] / max(compute['step_s'], floor):.3f}"
    return f"{gib('h2d'):>8} {gib('d2h'):>8} {'-' if floor is None else f'{floor:.3f}':>8} {x:>8}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", default=["plain", "streamed", "auto-overlap", "all-auto"],
                    choices=sorted(VARIANTS))
    ap.add_argument("--shape", default="2x4096", help="BxS per rank, e.g. 1x32768")
    ap.add_argument("--config", default=CONFIG, help="the base TOML (a CPU smoke: configs/debug_cpu.toml)")
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3, help="logged steps left out of the medians")
    ap.add_argument("--point-timeout-s", type=float, default=180)
    ap.add_argument("--budget-s", type=float, default=540)
    ap.add_argument("--out", default=os.environ.get("OUT", "train_variants_out"))
    ap.add_argument("--extra", nargs="+", action="extend", default=[], metavar="OVERRIDE",
                    help="overrides appended to every variant, e.g. --extra=--debug.deterministic (one token per item; "
                         "repeat --extra=... for several)")
    ap.add_argument("--base", default="plain", help="the variant the x-column and the bitwise check compare with")
    ap.add_argument("--compute", default="plain", choices=sorted(VARIANTS), help="the variant whose step is the compute-only step of `x floor`")
    a = ap.parse_args(argv)
    if a.warmup >= a.steps:
        ap.error(f"--warmup ({a.warmup}) must be below --steps ({a.steps}) to leave timed steps")
    batch, seq = (int(v) for v in a.shape.split("x"))
    shape = ["--training.local_batch_size", str(batch), "--training.seq_len", str(seq)]
    os.makedirs(a.out, exist_ok=True)
    rows, start = [], time.perf_counter()
    link = measure_link(a.out)
    if link is not None:
        print(f"link: {link['h2d'] / 1e9:.1f} GB/s h2d, {link['d2h'] / 1e9:.1f} GB/s d2h at once", flush=True)
    for name in a.variants:
        left = a.budget_s - (time.perf_counter() - start)
        if left < 30:
            print(f"budget spent: {name} not run", flush=True)
            continue
        overrides = [*shape, *VARIANTS[name], *a.extra]
        row = run_variant(name, overrides, config=a.config, nproc=a.nproc, steps=a.steps, warmup=a.warmup,
                          timeout_s=min(a.point_timeout_s, left), out=a.out)
        # The launch's own plan where it printed one: it has resolved what only a launch can (a device
        # share of "auto" from the GPU's free memory); the offline plan of the same flags cannot.
        offline = planned_gib(overrides, a.nproc, 128 * 2**30, config=a.config)
        row["planned"] = launch_plan(row.get("log")) or offline
        row["planned_offline"] = offline
        row["floor_s"] = link_floor_s(row, link)
        rows.append(row)
        print(f"{name}: rc={row['rc']} {row.get('tokens_per_s', 0):,.0f} tok/s in {row['wall_s']:.0f}s", flush=True)
    with open(os.path.join(a.out, "train_variants.json"), "w") as f:
        json.dump({"rows": rows, "argv": sys.argv, "shape": a.shape, "date": time.strftime("%Y-%m-%d"),
                   "link_bandwidth": link, "compute": a.compute}, f, indent=1)
    print(table(rows, a.base, a.compute, link))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
