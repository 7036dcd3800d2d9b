"""Where a training step's time goes: a few steps of our trainer under torch.profiler, kernel time by kind.

    python benchmarks/step_profile.py --config configs/small_1gpu.toml --auto --seq-len 4096 --batch 2 \
        --out $OUT/prof_4k                                   # ours as `plan --auto` picks it, one GPU
    python benchmarks/step_profile.py --config configs/small_1gpu.toml --out $OUT/prof -- \
        --training.seq_len 32768 --training.local_batch_size 1 --mop.moe.dispatch local   # given flags
    python benchmarks/step_profile.py --analyse $OUT/prof/trace.json --vocab 200000  # a trace again, no run

How: our trainer's run is built as `mop_train.train` builds it (build_run) and its `train_step` runs
--wait + --warmup + --active times under torch.profiler (CPU and CUDA activities, input shapes); the
active steps' Chrome trace is written and read back. Each device activity (kernel, memcpy, memset)
is tied to the CPU op that launched it (the trace's "External id") and that op's ancestors (CPU ops,
record_function ranges, Python frames with --with-stack); on CPU alone each CPU op's self time
stands in for kernels. `classify` names its kind from those names and the GEMM's shapes:
  communication   nccl / gloo / c10d collectives (the kernel, its op, or a c10d ancestor)
  copies          memcpy, memset, and copy / cast / cat kernels outside attention and the loss
  optimizer       under Optimizer.step, or adam kernels
  attention       flash / fmha / efficient / cudnn attention, SDPA and its math ops
  vocab_loss      the output projection (a GEMM with a vocabulary-wide dim: V, V/P, or Ring-DTP's block
                  when no token or hidden dim equals it) and the loss (cross-entropy, log-softmax,
                  NLL, log-sum-exp, Ring-DTP's kernels and backward)
  expert_gemm     grouped GEMMs (torch._grouped_mm, grouped kernels, the expert dispatch's frames)
  dense_gemm      every other GEMM (attention and dense-FFN projections, shared experts, router)
  elementwise     the rest: norms, RoPE, activations, routing (top-k, sort, scatter), reductions
  idle            the device window (first to last activity) not covered by any activity
Kernels on several streams overlap: each kind's time is its own kernels' sum; `exposed_*` is the part
of communication and copies that no compute kernel overlaps. Prints a table (ms per step, % of the
window), the largest kernels, the host link's busy share by phase (forward, backward, optimizer:
link_phases), and what the host did while the device waited (idle_causes: a gap after a blocking
call such as aten::item's sync, or the host behind the device, each by CPU op); writes
<out>/step_profile.json (and trace.json.gz; --analyse reads either form).
Taken as a model: Holistic Trace Analysis (HTA, Meta) kernel and temporal breakdowns over kineto traces.

Legend: V vocab, P vocab degree, S context, B local batch.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import math
import os
import re
import shutil
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

KINDS = ("communication", "copies", "optimizer", "attention", "vocab_loss", "expert_gemm", "dense_gemm",
         "elementwise")
_RE = {k: re.compile(v, re.IGNORECASE) for k, v in {
    "communication": r"nccl|gloo|c10d::|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|broadcast_|SendRecv",
    "collective": r"nccl|gloo:|c10d::",
    "memcpy": r"^Memcpy|^Memset|^cudaMemcpy",
    "optimizer": r"Optimizer\.step|adam|offload_adamw",
    "attention": r"flash|fmha|attention|sdpa|scaled_dot_product|_attn_",
    "attention_scope": r"scaled_dot_product|attention_backends|keep_attention|_attn_",  # not attention.py's projections
    "loss": r"cross_entropy|log_softmax|nll_loss|logsumexp|ring_dtp|RingDTP|lse_update|softmax_grad|train/loss\.py"
            r"|chunked_cross_entropy",
    "embedding": r"embedding",
    "expert": r"grouped|GroupedMm|moe_dispatch|experts_forward|grouped_swiglu|llep",
    "gemm": r"gemm|gemv|cutlass|cublas|nvjet|xmma|wgmma|^aten::(mm|bmm|addmm|baddbmm|matmul|linear|_grouped_mm)$",
    "copy": r"copy|_to_copy|aten::to$|clone|contiguous|^aten::cat$|CatArray",
}.items()}


def classify(name: str, ancestors: list[str], shapes=None, vocab_dims: frozenset = frozenset()) -> str:
    """The kind (a KINDS entry) of one activity. `name`: the kernel's (or leaf CPU op's) name;
    `ancestors`: its launching CPU op first, then that op's ancestors outward; `shapes`: the
    launching op's input shapes (nested lists); `vocab_dims`: the vocabulary widths (V, V/P)."""
    names = [name, *ancestors]

    def hit(key: str, among=names) -> bool:
        return any(_RE[key].search(n) for n in among)

    if hit("communication", names[:2]) or hit("collective"):  # FSDP's all_gather_copy_in is a copy
        return "communication"
    if hit("memcpy", [name]):
        return "copies"
    if hit("optimizer"):
        return "optimizer"
    if hit("attention", names[:2]) or hit("attention_scope"):
        return "attention"
    gemm = hit("gemm", names[:2])  # the kernel itself or the op that launched it
    if not hit("embedding") and (hit("loss") or (gemm and vocab_dims & set(_flat(shapes)))):
        return "vocab_loss"
    if gemm and hit("expert"):
        return "expert_gemm"
    if gemm:
        return "dense_gemm"
    if hit("copy", names[:2]) and not name.startswith("triton"):  # inductor names fused kernels by their ops
        return "copies"
    return "elementwise"


def _flat(shapes) -> list:
    if isinstance(shapes, (list, tuple)):
        return [d for s in shapes for d in _flat(s)]
    return [shapes] if isinstance(shapes, int) else []


# -- the trace ----------------------------------------------------------------------------------

CPU_CATS = ("cpu_op", "user_annotation", "python_function")
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def _thread_nesting(cpu: list[dict]) -> dict[tuple, tuple[list[dict], list[float], dict[int, int]]]:
    """Per (pid, tid): its spans by start (outer first at a tie), their starts, and each span's parent
    (the innermost span enclosing it), so the spans holding a time are one parent walk."""
    out = {}
    for e in cpu:
        out.setdefault((e["pid"], e["tid"]), []).append(e)
    for key, spans in out.items():
        spans.sort(key=lambda e: (e["ts"], -e["dur"]))
        parent, stack = {}, []
        for i, e in enumerate(spans):
            while stack and e["ts"] >= spans[stack[-1]]["ts"] + spans[stack[-1]]["dur"]:
                stack.pop()
            if stack:
                parent[i] = stack[-1]
            stack.append(i)
        out[key] = (spans, [e["ts"] for e in spans], parent)
    return out


def activities(trace: dict) -> tuple[list[dict], bool]:
    """([{name, ts, dur, ancestors, shapes}], on_device) from a Chrome trace: the device's kernels,
    memcpys and memsets when there are any (each with its launching op's ancestry), else the CPU ops'
    self time (the parts of each op's span its children do not cover)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    threads = _thread_nesting([e for e in events if e.get("cat") in CPU_CATS])

    def chain(key: tuple, i: int) -> list[str]:
        spans, _, parent = threads[key]
        out = []
        while i in parent:
            i = parent[i]
            out.append(spans[i]["name"])
        return out

    by_external = {e["args"]["External id"]: (key, i) for key, (spans, _, _) in threads.items()
                   for i, e in enumerate(spans) if e.get("cat") == "cpu_op" and "External id" in e.get("args", {})}
    device = [e for e in events if e.get("cat") in DEVICE_CATS]
    if device:
        out = []
        for e in device:
            key, i = by_external.get(e.get("args", {}).get("External id"), (None, None))
            op = threads[key][0][i] if key is not None else None
            out.append({"name": e["name"], "ts": e["ts"], "dur": e["dur"],
                        "ancestors": ([op["name"]] + chain(key, i)) if op else [],
                        "shapes": op.get("args", {}).get("Input Dims") if op else None})
        return out, True
    out = []  # CPU alone: each op's self time (its span less its children's), pieces on the timeline
    for key in sorted(threads):
        spans, _, parent = threads[key]
        children: dict[int, list[int]] = {}
        for i, p in sorted(parent.items()):
            children.setdefault(p, []).append(i)
        for i, e in enumerate(spans):
            if e.get("cat") != "cpu_op":
                continue
            for s, t in self_segments(e, [spans[c] for c in children.get(i, [])]):
                out.append({"name": e["name"], "ts": s, "dur": t - s, "ancestors": chain(key, i),
                            "shapes": e.get("args", {}).get("Input Dims")})
    return out, False


def self_segments(event: dict, kids: list[dict]) -> list[tuple[float, float]]:
    """[start, end) pieces of `event`'s span not covered by its children's spans."""
    pieces, at = [], event["ts"]
    for k in sorted(kids, key=lambda k: k["ts"]):
        if k["ts"] > at:
            pieces.append((at, k["ts"]))
        at = max(at, k["ts"] + k["dur"])
    if event["ts"] + event["dur"] > at:
        pieces.append((at, event["ts"] + event["dur"]))
    return pieces


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by [start, end) intervals."""
    total, end = 0.0, -math.inf
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def breakdown(acts: list[dict], *, vocab_dims: frozenset = frozenset(), steps: int = 1) -> dict:
    """Per kind: summed time (ms per step) and share of the window; idle; exposed communication and
    copies (not overlapped by compute); the 15 largest (name, kind) pairs by summed time."""
    if not acts:
        raise ValueError("the trace holds no activity: profile at least one active step (--active >= 1)")
    kinds = {k: [] for k in KINDS}
    top: dict[str, list] = {}
    for a in acts:
        kind = classify(a["name"], a["ancestors"], a.get("shapes"), vocab_dims)
        kinds[kind].append((a["ts"], a["ts"] + a["dur"]))
        entry = top.setdefault((a["name"][:120], kind), [0.0, 0])
        entry[0], entry[1] = entry[0] + a["dur"], entry[1] + 1
    start, end = min(a["ts"] for a in acts), max(a["ts"] + a["dur"] for a in acts)
    window = end - start
    busy = union_us([iv for ivs in kinds.values() for iv in ivs])
    compute = [iv for k, ivs in kinds.items() if k not in ("communication", "copies") for iv in ivs]
    ms = lambda us: round(us / 1e3 / steps, 3)  # noqa: E731
    out = {"window_ms_per_step": ms(window), "busy_ms_per_step": ms(busy), "steps": steps,
           "kinds": {k: {"ms_per_step": ms(sum(e - s for s, e in ivs)), "count": len(ivs),
                         "pct_of_window": round(100 * sum(e - s for s, e in ivs) / window, 2)} for k, ivs in kinds.items()},
           "idle": {"ms_per_step": ms(window - busy), "pct_of_window": round(100 * (window - busy) / window, 2)}}
    for k in ("communication", "copies"):
        exposed = union_us(kinds[k] + compute) - union_us(compute)
        out["kinds"][k]["exposed_ms_per_step"] = ms(exposed)
    out["largest"] = [{"name": n, "ms_per_step": ms(t), "count": c, "kind": k}
                      for (n, k), (t, c) in sorted(top.items(), key=lambda kv: -kv[1][0])[:15]]
    return out


PHASES = ("forward", "backward", "optimizer")


def phase_of(name: str, ancestors: list[str]) -> str:
    """The part of the step that launched an activity: under Optimizer.step (or an adam kernel),
    under autograd's engine (a *Backward op), else the forward."""
    names = [name, *ancestors]
    if any(_RE["optimizer"].search(n) for n in names):
        return "optimizer"
    if any(n.startswith("autograd::engine") or "Backward" in n for n in names):
        return "backward"
    return "forward"


def link_direction(name: str) -> str | None:
    """"h2d", "d2h" or "d2d" for a memcpy (its CUDA trace name: "Memcpy HtoD (Pinned -> Device)"), else None."""
    m = re.match(r"Memcpy (HtoD|DtoH|DtoD)", name)
    return {"HtoD": "h2d", "DtoH": "d2h", "DtoD": "d2d"}[m.group(1)] if m else None


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _per_bin(intervals: list[tuple[float, float]], start: float, width: float, n: int) -> list[float]:
    """Each of `n` bins' microseconds under `intervals` (an overlap counts twice: merge them first for coverage)."""
    out = [0.0] * n
    for s, e in intervals:
        first, last = int((s - start) // width), min(n - 1, int((e - start) // width))
        for b in range(max(first, 0), last + 1):
            lo, hi = start + b * width, start + (b + 1) * width
            out[b] += max(0.0, min(e, hi) - max(s, lo))
    return out


def link_phases(acts: list[dict], *, steps: int = 1, bin_us: float = 1000.0) -> dict:
    """Where the host link is busy and where it waits, by part of the step. The window is cut into bins
    of `bin_us`; each bin belongs to the phase (phase_of) whose activities cover most of it. Per phase:
    its time (ms per step) and the share of it each copy direction (h2d, d2h) and compute (every
    activity that is no copy or collective) is busy. A link-bound step shows h2d or d2h near 100% in
    every phase; the phases where both stay low while compute does too are the waits to remove."""
    if not acts:
        raise ValueError("the trace holds no activity: profile at least one active step (--active >= 1)")
    start = min(a["ts"] for a in acts)
    end = max(a["ts"] + a["dur"] for a in acts)
    n = max(1, math.ceil((end - start) / bin_us))
    lanes = {"h2d": [], "d2h": [], "compute": []}
    by_phase = {p: [] for p in PHASES}
    for a in acts:
        iv = (a["ts"], a["ts"] + a["dur"])
        by_phase[phase_of(a["name"], a["ancestors"])].append(iv)
        direction = link_direction(a["name"])
        if direction in lanes:
            lanes[direction].append(iv)
        elif direction is None and classify(a["name"], a["ancestors"], a.get("shapes")) not in ("copies", "communication"):
            lanes["compute"].append(iv)
    cover = {p: _per_bin(ivs, start, bin_us, n) for p, ivs in by_phase.items()}   # overlaps counted: a weight
    busy = {k: _per_bin(_merged(ivs), start, bin_us, n) for k, ivs in lanes.items()}
    owner = [max(PHASES, key=lambda p: cover[p][b]) for b in range(n)]
    ms = lambda us: round(us / 1e3 / steps, 3)  # noqa: E731
    out = {"bin_ms": bin_us / 1e3, "phases": {}}
    for p in PHASES:
        bins = [b for b in range(n) if owner[b] == p and any(cover[q][b] for q in PHASES)]
        span = sum(min(bin_us, end - (start + b * bin_us)) for b in bins)
        row = {"ms_per_step": ms(span)}
        for k in lanes:
            row[f"{k}_busy_pct"] = round(100 * sum(busy[k][b] for b in bins) / span, 1) if span else 0.0
        out["phases"][p] = row
    return out


SYNC_CALLS = re.compile(r"^cuda(Stream|Device|Event)Synchronize$|^cudaMemcpy$|^cudaMemcpyAsync$|^cuStreamSynchronize$")
RUNTIME_CATS = ("cuda_runtime", "cuda_driver")
SYNC_RETURN_US = 10.0  # a blocking call returns this soon, at most, before the trace shows the device idle
_WRAPPER_FRAMES = re.compile(r"torch/nn/modules/module\.py|torch/_ops\.py|torch/autograd/profiler\.py"
                             r"|torch/utils/_contextlib\.py|torch/_dynamo/eval_frame\.py|torch/_compile\.py|^threading\.py")


def idle_causes(trace: dict, *, steps: int = 1, min_gap_us: float = 50.0, top: int = 12) -> dict:
    """Why the device waits: each gap of at least `min_gap_us` between device activities (all streams
    merged) is charged to what the host did then. A gap that opens as a blocking runtime call
    (cudaStreamSynchronize, a copy to or from pageable memory: `.item()`, `.cpu()`, ...) returns, a call
    made while the device was still busy, was made by that call: the host waited for the device to
    drain, then had to refill its queue (a copy queued inside the gap blocked nothing); it is charged
    to "sync: <call> in
    <op chain>" (the CPU ops around the call, innermost first: aten::item, aten::nonzero, ...). Any
    other gap is the host falling behind the device (launch-bound: Python, kernel launches, host
    work); it is charged to "launch: <op chain>" of the op that launched the activity ending the gap.
    Returns {gaps_ms_per_step, attributed: [{cause, ms_per_step, count}], ...}; the same trace's
    `breakdown` idle also counts gaps shorter than `min_gap_us`.
    Taken as a model: HTA's idle-time breakdown (host wait / kernel wait) and CUDA sync debug mode."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    device = sorted(((e["ts"], e["ts"] + e["dur"], e) for e in events if e.get("cat") in DEVICE_CATS),
                    key=lambda t: t[:2])
    if not device:
        return {"gaps_ms_per_step": 0.0, "gaps": 0, "steps": steps, "min_gap_us": min_gap_us,
                "sync_ms_per_step": 0.0, "attributed": []}
    threads = _thread_nesting([e for e in events if e.get("cat") in CPU_CATS])
    pinned = {e["args"]["correlation"] for e in events  # copies from or to pinned memory never block the host
              if e.get("cat") == "gpu_memcpy" and "Pinned" in e["name"] and "correlation" in e.get("args", {})}
    syncs = sorted(((e["ts"] + e["dur"], e) for e in events
                    if e.get("cat") in RUNTIME_CATS and SYNC_CALLS.search(e["name"])
                    and e.get("args", {}).get("correlation") not in pinned), key=lambda t: t[0])
    sync_ends = [t for t, _ in syncs]
    by_external = {e["args"]["External id"]: e for e in events
                   if e.get("cat") == "cpu_op" and "External id" in e.get("args", {})}

    def around(e: dict) -> list[str]:
        """CPU ops and annotations on e's thread whose span holds e's start, innermost first."""
        if (e["pid"], e["tid"]) not in threads:
            return []
        spans, starts, parent = threads[(e["pid"], e["tid"])]
        t, out = e["ts"], []
        i = bisect.bisect_right(starts, t) - 1   # the last span to start by t; the others holding t enclose it
        while i >= 0:
            if spans[i] is not e and t < spans[i]["ts"] + spans[i]["dur"]:
                out.append(spans[i]["name"])
            i = parent.get(i, -1)
        return out

    def label(chain: list[str]) -> str:
        """The innermost op and, with --with-stack, the two innermost Python frames that say whose code it is
        (torch's module, dispatch and profiler wrappers skipped), else the three innermost names."""
        kept = [n for n in chain if not n.startswith("ProfilerStep")]
        frames = [n for n in kept if ".py(" in n and not _WRAPPER_FRAMES.search(n)]
        if frames:
            ops = [n for n in kept if ".py(" not in n and not n.startswith("<built-in")]
            return " < ".join(ops[:1] + frames[:2])
        return " < ".join(kept[:3]) if kept else "(no CPU op)"

    causes: dict[str, list[float]] = {}
    total, count, end = 0.0, 0, device[0][1]
    k = 0  # syncs ending before the current gap are behind k
    for start, stop, e in device[1:]:
        gap = start - end
        if gap >= min_gap_us:
            while k < len(syncs) and syncs[k][0] < end - SYNC_RETURN_US:
                k += 1
            waited = [c for _, c in syncs[k:bisect.bisect_right(sync_ends, start)] if c["ts"] <= end]
            hit = min(waited, key=lambda c: c["ts"]) if waited else None  # the one that waited longest
            if hit is not None:
                cause = f"sync: {hit['name']} in {label(around(hit))}"
            else:
                op = by_external.get(e.get("args", {}).get("External id"))
                cause = "launch: " + label(([op["name"]] + around(op)) if op is not None else [])
            entry = causes.setdefault(cause, [0.0, 0])
            entry[0] += gap
            entry[1] += 1
            total += gap
            count += 1
        end = max(end, stop)
    ms = lambda us: round(us / 1e3 / steps, 3)  # noqa: E731
    ranked = sorted(causes.items(), key=lambda kv: -kv[1][0])
    return {"gaps_ms_per_step": ms(total), "gaps": count, "steps": steps, "min_gap_us": min_gap_us,
            "sync_ms_per_step": ms(sum(v[0] for c, v in causes.items() if c.startswith("sync:"))),
            "attributed": [{"cause": c, "ms_per_step": ms(v[0]), "count": v[1]} for c, v in ranked[:top]]}


def format_idle_causes(ic: dict) -> str:
    lines = [f"device idle in gaps >= {ic['min_gap_us']:g} us: {ic['gaps_ms_per_step']} ms per step in "
             f"{ic['gaps']} gaps over {ic.get('steps', 1)} step(s), "
             f"{ic.get('sync_ms_per_step', 0.0)} ms after host syncs; largest causes:"]
    lines += [f"  {x['ms_per_step']:>9.3f} ms  x{x['count']:<5} {x['cause']}" for x in ic["attributed"]]
    return "\n".join(lines)


def format_link_phases(lp: dict) -> str:
    lines = [f"by phase ({lp['bin_ms']:g} ms bins, each to the phase that launched most of it):",
             f"{'phase':<10} {'ms/step':>9} {'h2d busy':>9} {'d2h busy':>9} {'compute':>8}"]
    for p, r in lp["phases"].items():
        lines.append(f"{p:<10} {r['ms_per_step']:>9.1f} {r['h2d_busy_pct']:>8.1f}% {r['d2h_busy_pct']:>8.1f}% "
                     f"{r['compute_busy_pct']:>7.1f}%")
    return "\n".join(lines)


def format_breakdown(b: dict, title: str) -> str:
    lines = [title, f"window {b['window_ms_per_step']} ms per step over {b['steps']} steps, busy {b['busy_ms_per_step']} ms",
             f"{'kind':<14} {'ms/step':>10} {'% window':>9} {'count':>8}  exposed ms/step"]
    for k, v in b["kinds"].items():
        lines.append(f"{k:<14} {v['ms_per_step']:>10.3f} {v['pct_of_window']:>9.2f} {v['count']:>8}  "
                     + (f"{v['exposed_ms_per_step']:.3f}" if "exposed_ms_per_step" in v else ""))
    lines.append(f"{'idle':<14} {b['idle']['ms_per_step']:>10.3f} {b['idle']['pct_of_window']:>9.2f}")
    lines.append("largest:")
    lines += [f"  {x['ms_per_step']:>10.3f} ms  x{x['count']:<6} {x['kind']:<13} {x['name']}" for x in b["largest"]]
    return "\n".join(lines)


# -- the run ------------------------------------------------------------------------------------

def auto_flags(config: str, seq_len: int, batch: int, *, world: int) -> list[str]:
    """The overrides `mop-train plan --auto` picks at (seq_len, batch) on this machine's GPU and host."""
    import torch

    from benchmarks.e2e_settings import AutoSettings
    from mop_train.ops.sco.budget import available_host_bytes

    if not torch.cuda.is_available():
        raise ValueError("--auto plans for the GPU's memory: run it on a GPU, or give the flags after --")
    auto = AutoSettings(config, world=world, gpu_bytes=torch.cuda.get_device_properties(0).total_memory,
                        host_bytes=available_host_bytes()).at(seq_len, batch)
    if auto is None:
        raise ValueError(f"plan --auto fits nothing at --seq-len {seq_len} --batch {batch}; give the flags after --")
    return auto.flags()


def profile_run(argv: list[str], *, out: str, wait: int, warmup: int, active: int, with_stack: bool) -> dict:
    """Build our run from job-config flags `argv`, run wait + warmup + active steps, the active ones
    profiled; rank 0 writes <out>/trace.json.gz. Returns {trace, step_s, tokens_per_step, vocab_dims}."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, schedule

    from mop_train.config import load_job_config
    from mop_train.models import zoo
    from mop_train.train.build import build_run
    from mop_train.train.loop import StepGuards, init_distributed, train_step
    from mop_train.train.reliability import NonFiniteGuard, StopFlag

    cfg = load_job_config([*argv, "--job.dump_folder", os.path.join(out, "run"), "--checkpoint.no-enable",
                           "--metrics.no-enable-tensorboard"], model_flavors=zoo.names())
    device = init_distributed(cfg.comm.init_timeout_seconds)
    rank, world = dist.get_rank(), dist.get_world_size()
    run = build_run(cfg, device)
    guards = StepGuards(NonFiniteGuard(cfg.mop.reliability, rank=rank, world=world, device=device), StopFlag(),
                        run.schedule_steps)
    batches, trace, step_s = iter(run.dataloader), os.path.join(out, "trace.json"), []
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts, schedule=schedule(wait=wait, warmup=warmup, active=active, repeat=1),
                 record_shapes=True, with_stack=with_stack,
                 on_trace_ready=(lambda p: p.export_chrome_trace(trace)) if rank == 0 else None) as prof:
        for step in range(1, wait + warmup + active + 1):
            start = time.perf_counter()
            if run.parts.sco is not None:
                run.parts.sco.begin_step()
            train_step(run.parts, run.layout, [next(batches) for _ in range(run.micro_batches)], run.optimizers,
                       run.lr_schedulers, max_norm=cfg.training.max_norm, bias_rate=cfg.mop.moe.bias_update_rate,
                       device=device, guards=guards, step=step, eos_id=run.eos_id)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            step_s.append(time.perf_counter() - start)
            prof.step()
    args, p = run.spec.args, cfg.mop.layout.vocab_degree
    tokens = cfg.training.seq_len * cfg.training.local_batch_size * run.micro_batches * world // cfg.mop.layout.seq_degree
    vocab = {args.vocab_size, math.ceil(args.vocab_size / p)}
    rows = cfg.training.seq_len * cfg.training.local_batch_size // cfg.mop.layout.seq_degree
    if (cfg.mop.ring_dtp.enable or p > 1) and cfg.mop.ring_dtp.block_size not in (rows, rows * p, args.dim):
        vocab.add(cfg.mop.ring_dtp.block_size)  # Ring-DTP's GEMMs are [N, H] x [H, block]
    dist.destroy_process_group()
    if rank == 0:   # compressed: a 2 x 4K step's trace is over 16 MiB plain, the device tool's limit per file
        with open(trace, "rb") as f, gzip.open(trace + ".gz", "wb") as g:
            shutil.copyfileobj(f, g)
        os.remove(trace)
        trace += ".gz"
    return {"trace": trace, "step_s": step_s, "tokens_per_step": tokens, "rank": rank,
            "vocab_dims": sorted(vocab)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/small_1gpu.toml", help="our job config")
    p.add_argument("--auto", action="store_true", help="take the flags `plan --auto` picks at --seq-len / --batch")
    p.add_argument("--seq-len", type=int, default=None, help="training.seq_len (with --auto, or as a flag)")
    p.add_argument("--batch", type=int, default=None, help="training.local_batch_size")
    p.add_argument("--wait", type=int, default=1, help="steps before profiling (allocation, autotuning)")
    p.add_argument("--warmup", type=int, default=1, help="profiler warm-up steps (traced, discarded)")
    p.add_argument("--active", type=int, default=2, help="profiled steps")
    p.add_argument("--with-stack", action="store_true", help="Python frames in the trace (finer kinds, more overhead)")
    p.add_argument("--analyse", default=None, metavar="TRACE", help="classify an existing trace.json, run nothing")
    p.add_argument("--vocab", type=int, nargs="*", default=[], help="with --analyse: the vocabulary widths (V, V/P)")
    p.add_argument("--out", default=os.environ.get("OUT", "outputs") + "/step_profile", help="output folder")
    p.add_argument("flags", nargs="*", help="job-config flags after --, e.g. -- --mop.moe.dispatch local")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.analyse:
        meta = {"trace": args.analyse, "vocab_dims": args.vocab, "steps": args.active}
    else:
        flags = ["--job.config_file", args.config]
        flags += ["--training.seq_len", str(args.seq_len)] if args.seq_len else []
        flags += ["--training.local_batch_size", str(args.batch)] if args.batch else []
        if args.auto:
            if not (args.seq_len and args.batch):
                p.error("--auto needs --seq-len and --batch")
            flags += auto_flags(args.config, args.seq_len, args.batch, world=int(os.environ.get("WORLD_SIZE", "1")))
        meta = {**profile_run(flags + args.flags, out=args.out, wait=args.wait, warmup=args.warmup,
                              active=args.active, with_stack=args.with_stack),
                "flags": flags + args.flags, "steps": args.active}
        if meta["rank"] != 0:
            return
        profiled = meta["step_s"][args.wait + args.warmup:]
        meta["tokens_per_s_profiled"] = meta["tokens_per_step"] * len(profiled) / sum(profiled)
    with (gzip.open if meta["trace"].endswith(".gz") else open)(meta["trace"], "rt") as f:
        trace = json.load(f)
    acts, on_device = activities(trace)
    result = {**meta, "on_device": on_device,
              **breakdown(acts, vocab_dims=frozenset(meta["vocab_dims"]), steps=meta["steps"]),
              "link_phases": link_phases(acts, steps=meta["steps"])}
    if on_device:
        result["idle_causes"] = idle_causes(trace, steps=meta["steps"])
    with open(os.path.join(args.out, "step_profile.json"), "w") as f:
        json.dump(result, f, indent=1)
    title = ("device kernels" if on_device else "CPU ops (no device: their self time stands in for kernels)") + \
        (f"; {result['tokens_per_s_profiled']:,.0f} tokens/s under the profiler" if "tokens_per_s_profiled" in result else "")
    print(format_breakdown(result, title))
    print(format_link_phases(result["link_phases"]))
    if "idle_causes" in result:
        print(format_idle_causes(result["idle_causes"]))
    print(f"results: {os.path.join(args.out, 'step_profile.json')}, trace {meta['trace']}")


if __name__ == "__main__":
    main()
