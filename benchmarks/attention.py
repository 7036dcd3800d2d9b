"""Core attention backends at long context: forward and forward+backward time, TFLOP/s, peak memory.

One core attention call (B = 1, bf16, causal) at the per-rank shapes after Ulysses (heads / D):
  mla-h16   small at D = 1                                   h = 16, d_qk = 192, d_v = 128
  mla-h8    small at D = 2; mop-37b / mop-120b at D = 8      h = 8
  mla-h4    mop-241b / mop-667b at D = 16                    h = 4
  gqa-h8    gpt-oss-20b-shape at D = 8                       h = 8, h_kv = 1, d = 64
S is the sequence length the core sees: under Ulysses the whole context (S positions, h/D heads).
Methods (a method that fails records its error and is not retried at longer S for that shape):
  sdpa_default          F.scaled_dot_product_attention as the model calls it today (`picks`: its choice)
  sdpa_<b>              forced one at a time with torch.nn.attention.sdpa_kernel: flash, efficient, cudnn
  sdpa_<b>_pad_v        v zero-padded to d_qk and the output sliced back (MLA; flash and cudnn)
  flex_block_mask       compiled FlexAttention, causal BlockMask (blocks above the diagonal skipped)
  flex_score_mod        compiled FlexAttention, causal as a score_mod and no BlockMask (every block)
  kernels_<b>           the explicit kernel pairs of mop_train/models/attention_backends.py, through
                        keep_attention's autograd.Function (what keep runs): flash(_pad_v), efficient, cudnn
  flex_document_<L>     compiled FlexAttention with the document BlockMask, documents ~L tokens (--doc-lens)
  checkpointed_plain    the model's core (ScaledDotProductAttention) under non-reentrant checkpointing:
                        backward recomputes the forward kernel first (what a checkpointed block does)
  checkpointed_keep     the same with keep on: the recompute returns the kept output (no kernel);
                        the difference to checkpointed_plain is what keeping saves per layer
FLOPs, causal counted once: forward 2 * h * S^2/2 * (d_qk + d_v) (B = 1), backward 2.5x that
(flex_document rows too: their TFLOP/s is the causal-equivalent rate, not the masked work).
Time: CUDA events, median of --repeats after one warm-up (compilation happens in the warm-up).
Peak: max_memory_allocated after reset_peak_memory_stats over one forward+backward, minus inputs.
Check: each method's output on 64 query rows x 2 heads against fp32 math; ok when its rms error is
at most 1.25x that of PyTorch's own bf16 math on the same rows plus 1/256 of the output's scale. At
the first length also its gradients on one key/value-head group (fp32 math fwd+bwd of that group).
--time-budget: a row whose predicted time (its time at the previous length x (S ratio)^2) does not
fit in what is left is skipped and recorded.

    python benchmarks/attention.py --shapes mla-h8,gqa-h8 --time-budget 540      # H200
    python benchmarks/attention.py --smoke                                      # CPU, tiny, seconds
JSON to $OUT/attention_<shapes>.json if OUT is set, else benchmarks/results/; a table to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mop_train.models.attention_backends import AttentionCall, sdpa_choice  # noqa: E402
from mop_train.models.keep_attention import explicit_attention  # noqa: E402

GIB = 2 ** 30
SHAPES = {"mla-h16": (16, 16, 192, 128), "mla-h8": (8, 8, 192, 128), "mla-h4": (4, 4, 192, 128),
          "gqa-h8": (8, 1, 64, 64)}                       # (h, h_kv, d_qk, d_v)
SMOKE_SHAPES = {"mla-h2": (2, 2, 24, 16), "gqa-h4": (4, 2, 16, 16)}
SDPA = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}


# ------------------------------------------------------------------------------------------------
# Methods: fn(q [B, S, h, d_qk], k [B, S, h_kv, d_qk], v [B, S, h_kv, d_v]) -> [B, S, h, d_v]
# ------------------------------------------------------------------------------------------------

def sdpa_method(backend: str | None, pad_v: bool = False):
    def run(q, k, v):
        d_v = v.shape[-1]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if pad_v:
            v = F.pad(v, (0, q.shape[-1] - d_v))
        with sdpa_kernel([SDPA[backend]]) if backend else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
        return out[..., :d_v].transpose(1, 2)
    return run


def kernels_method(backend: str):
    owner = nn.Module()   # stands for one core module: keep pairs its recompute by this identity

    def run(q, k, v):
        call = AttentionCall(backend=backend, gqa=k.shape[2] != q.shape[2], keep=True)
        return explicit_attention(q, k, v, None, call, owner)
    return run


def checkpointed_method(keep: bool):
    from torch.utils.checkpoint import checkpoint

    from mop_train.models.attention import ScaledDotProductAttention
    core = ScaledDotProductAttention()
    core.keep = keep

    def run(q, k, v):
        return checkpoint(core, q, k, v, use_reentrant=False)
    return run


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _causal_score(score, b, h, q_idx, kv_idx):
    return torch.where(q_idx >= kv_idx, score, -float("inf"))


class Flex:
    """FlexAttention methods sharing one compiled function (eager with --smoke: no CPU compile)."""

    def __init__(self, compiled: bool):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        # Compiled create_block_mask evaluates the mask block by block (eager would build S x S).
        self.create_block_mask = torch.compile(create_block_mask, dynamic=False) if compiled else create_block_mask
        self.flex = torch.compile(flex_attention) if compiled else flex_attention
        self.masks, self.doc_ids, self.compiled = {}, {}, compiled

    def _run(self, q, k, v, block_mask=None, score_mod=None):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if not self.compiled:  # eager FlexAttention (CPU) has no backward: forward only
            q, k, v = (t.detach() for t in (q, k, v))
        out = self.flex(q, k, v, score_mod=score_mod, block_mask=block_mask,
                        enable_gqa=k.shape[1] != q.shape[1])
        return out.transpose(1, 2)

    def block_mask(self, q, k, v):
        S = q.shape[1]
        if ("causal", S) not in self.masks:
            self.masks = {("causal", S): self.create_block_mask(_causal, None, None, S, S, device=q.device)}
        return self._run(q, k, v, block_mask=self.masks[("causal", S)])

    def score_mod(self, q, k, v):
        return self._run(q, k, v, score_mod=_causal_score)

    def document(self, mean_doc: int):
        """Documents of lengths uniform in [1, 2 * mean_doc]; `run.ids(S, device)` gives their ids."""
        def ids(S, device):
            if (mean_doc, S) not in self.doc_ids:
                gen = torch.Generator().manual_seed(mean_doc)
                lengths = torch.randint(1, 2 * mean_doc + 1, (2 * S // mean_doc + 2,), generator=gen)
                self.doc_ids[(mean_doc, S)] = torch.repeat_interleave(torch.arange(len(lengths)), lengths)[:S]
            return self.doc_ids[(mean_doc, S)].to(device)

        def run(q, k, v):
            S = q.shape[1]
            key = ("document", mean_doc, S)
            if key not in self.masks:
                doc = ids(S, q.device)

                def same_document_causal(b, h, q_idx, kv_idx):
                    return (q_idx >= kv_idx) & (doc[q_idx] == doc[kv_idx])
                self.masks[key] = self.create_block_mask(same_document_causal, None, None, S, S, device=q.device)
            return self._run(q, k, v, block_mask=self.masks[key])
        run.ids = ids
        return run


def methods_for(device: torch.device, shape, doc_lens, smoke: bool) -> dict:
    h, h_kv, d_qk, d_v = shape
    flex = Flex(compiled=not smoke)
    out = {"sdpa_default": sdpa_method(None)}
    for b in (("math", "flash", "efficient") if device.type == "cpu" else ("flash", "efficient", "cudnn")):
        out[f"sdpa_{b}"] = sdpa_method(b)
        if d_v < d_qk and b in ("flash", "cudnn"):
            out[f"sdpa_{b}_pad_v"] = sdpa_method(b, pad_v=True)
    out["flex_block_mask"] = flex.block_mask
    out["flex_score_mod"] = flex.score_mod
    kernels = ("cpu_flash", "math") if device.type == "cpu" else ("flash", "efficient", "cudnn")
    for b in kernels:
        if b in ("flash", "cpu_flash") and d_v < d_qk:
            b = "flash_pad_v" if b == "flash" else "math"
        out[f"kernels_{b}"] = kernels_method(b)
    out["checkpointed_plain"] = checkpointed_method(keep=False)
    out["checkpointed_keep"] = checkpointed_method(keep=True)
    for L in doc_lens:
        out[f"flex_document_{L}"] = flex.document(L)
    return out


# ------------------------------------------------------------------------------------------------
# Measuring
# ------------------------------------------------------------------------------------------------

class Timer:
    def __init__(self, cuda: bool):
        self.cuda = cuda

    def __call__(self, fn) -> float:
        if not self.cuda:
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3


def flops_forward(S: int, h: int, d_qk: int, d_v: int) -> float:
    return 2.0 * h * (S * S / 2) * (d_qk + d_v)


def measure(fn, q, k, v, gout, repeats: int, timer: Timer) -> dict:
    """Forward, then forward+backward; a backward that fails leaves the forward's numbers and
    `backward_error`."""
    def forward():
        fn(q, k, v)

    def forward_backward():
        for t in (q, k, v):
            t.grad = None
        fn(q, k, v).backward(gout)

    warm = timer(forward)
    n = repeats if warm < 1.0 else 2
    row = {"warmup_s": warm, "repeats": n, "fwd_ms": statistics.median(timer(forward) for _ in range(n)) * 1e3}
    try:
        row["warmup_s"] += timer(forward_backward)
    except Exception as err:  # recorded, not fatal
        row["backward_error"] = f"{type(err).__name__}: {str(err)[:400]}"
        return row
    fwd_bwd = [timer(forward_backward) for _ in range(n - 1)]
    if timer.cuda:
        for t in (q, k, v):
            t.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fwd_bwd.append(timer(forward_backward))
        row["peak_gib"] = (torch.cuda.max_memory_allocated() - base) / GIB
    else:
        fwd_bwd.append(timer(forward_backward))
    row["fwd_bwd_ms"] = statistics.median(fwd_bwd) * 1e3
    return row


def _errors(ours: torch.Tensor, base: torch.Tensor, truth: torch.Tensor) -> dict:
    """ours / base (PyTorch's bf16 math) against the fp32 truth; ok under the rule in the docstring."""
    diff = lambda a: (a.float() - truth).abs()  # noqa: E731
    scale = truth.abs().max().item()
    rms, base_rms = (diff(a).pow(2).mean().sqrt().item() for a in (ours, base))
    return {"rms": rms, "max": diff(ours).max().item(), "base_rms": base_rms,
            "ok": rms <= 1.25 * base_rms + scale / 256}


def check_output(out, q, k, v, gen, doc_ids=None) -> dict:
    """out [B, S, h, d_v] on 64 rows x 2 heads (the first and the last) against math on those rows
    (doc_ids [S]: a document mask as well)."""
    B, S, h, _ = q.shape
    group = h // k.shape[2]
    rows = torch.cat([torch.randint(0, S, (63,), generator=gen), torch.tensor([S - 1])]).to(q.device)
    heads = [0, h - 1]
    qs = q[0, rows][:, heads].transpose(0, 1)                         # [2, n, d_qk]
    ks = k[0][:, [x // group for x in heads]].transpose(0, 1)          # [2, S, d_qk]
    vs = v[0][:, [x // group for x in heads]].transpose(0, 1)          # [2, S, d_v]
    mask = torch.arange(S, device=q.device)[None, :] <= rows[:, None]  # [n, S]
    if doc_ids is not None:
        mask &= doc_ids[None, :] == doc_ids[rows][:, None]
    with torch.no_grad(), sdpa_kernel([SDPBackend.MATH]):
        truth = F.scaled_dot_product_attention(qs.float(), ks.float(), vs.float(), attn_mask=mask)
        base = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask)
    ours = out[0, rows][:, heads].transpose(0, 1)
    return _errors(ours, base, truth)


def check_grads(fn, q, k, v, gout) -> dict:
    """Gradients of key/value head 0 and its query heads against fp32 math of that group alone."""
    group = q.shape[2] // k.shape[2]
    for t in (q, k, v):
        t.grad = None
    fn(q, k, v).backward(gout)
    ours = [q.grad[:, :, :group], k.grad[:, :, :1], v.grad[:, :, :1]]

    def math(dtype):
        leaves = [t.detach()[:, :, sl].to(dtype).requires_grad_() for t, sl in
                  ((q, slice(0, group)), (k, slice(0, 1)), (v, slice(0, 1)))]
        with sdpa_kernel([SDPBackend.MATH]):
            out = sdpa_method(None)(*leaves)
        out.backward(gout[:, :, :group].to(dtype))
        return [t.grad for t in leaves]
    truth, base = math(torch.float32), math(q.dtype)
    result = {name: _errors(a, b, t) for name, a, b, t in zip(("dq", "dk", "dv"), ours, base, truth)}
    for t in (q, k, v):
        t.grad = None
    return {"grads_ok": all(r["ok"] for r in result.values()), "grads": result}


# ------------------------------------------------------------------------------------------------
# Driver
# ------------------------------------------------------------------------------------------------

def _parse_lengths(text: str) -> list[int]:
    return [int(x[:-1]) * 1024 if x.endswith("K") else int(x) for x in text.split(",") if x]


def run_row(name, fn, q, k, v, gout, args, timer, gen, first_length) -> dict:
    row = measure(fn, q, k, v, gout, args.repeats, timer)
    doc_ids = fn.ids(q.shape[1], q.device) if hasattr(fn, "ids") else None
    with torch.no_grad():
        row["check"] = check_output(fn(q, k, v), q, k, v, gen, doc_ids)
    if first_length and doc_ids is None and "backward_error" not in row:
        row.update(check_grads(fn, q, k, v, gout))
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {list(SHAPES)}")
    ap.add_argument("--seq-lens", default="16K,32K,64K,128K,256K,512K")
    ap.add_argument("--methods", default="", help="comma list of method names to run (default: all)")
    ap.add_argument("--doc-lens", default="2048,16384", help="mean document lengths for flex_document")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--time-budget", type=float, default=540.0, help="seconds for the whole run")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: checks that everything runs")
    args = ap.parse_args()
    started = time.monotonic()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    shapes = SMOKE_SHAPES if args.smoke else {s: SHAPES[s] for s in args.shapes.split(",")}
    lengths = [64, 128] if args.smoke else _parse_lengths(args.seq_lens)
    doc_lens = [16] if args.smoke else [int(x) for x in args.doc_lens.split(",") if x]
    if args.smoke:
        args.repeats = 2
    wanted = set(filter(None, args.methods.split(",")))
    timer, dtype = Timer(device.type == "cuda"), torch.bfloat16
    gen, gen_inputs = torch.Generator().manual_seed(0), torch.Generator(device=device).manual_seed(0)
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(torch._dynamo.config, name):  # a compiled FlexAttention per shape, mask and length
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 256))
    method_sets = {s: methods_for(device, shape, doc_lens, args.smoke) for s, shape in shapes.items()}
    rows, last_time, failed = [], {}, {}
    for i, S in enumerate(lengths):
        for shape_name, (h, h_kv, d_qk, d_v) in shapes.items():
            make = lambda n, d: torch.randn(1, S, n, d, generator=gen_inputs, device=device, dtype=dtype)  # noqa: E731
            q, k, v = (make(n, d).requires_grad_() for n, d in ((h, d_qk), (h_kv, d_qk), (h_kv, d_v)))
            gout = make(h, d_v)
            picks = sdpa_choice(*(t.transpose(1, 2) for t in (q, k, v)))
            flops = flops_forward(S, h, d_qk, d_v)
            for name, fn in method_sets[shape_name].items():
                if wanted and name not in wanted:
                    continue
                row = {"shape": shape_name, "S": S, "h": h, "h_kv": h_kv, "d_qk": d_qk, "d_v": d_v,
                       "method": name, "picks": picks if name == "sdpa_default" else None}
                key = (shape_name, name)
                left = args.time_budget - (time.monotonic() - started)
                seconds, at = last_time.get(key, (0.0, S))
                predicted = seconds * (S / at) ** 2
                if key in failed:
                    row["skipped"] = f"failed at S={failed[key]}"
                elif predicted > left:
                    row["skipped"] = f"time budget: predicted {predicted:.0f}s > {left:.0f}s left"
                else:
                    try:
                        row.update(run_row(name, fn, q, k, v, gout, args, timer, gen, first_length=i == 0))
                        row["fwd_tflops"] = flops / (row["fwd_ms"] / 1e3) / 1e12
                        if "backward_error" in row:
                            failed[key] = S
                        else:
                            row["fwd_bwd_tflops"] = 3.5 * flops / (row["fwd_bwd_ms"] / 1e3) / 1e12
                            # What scales with S^2 (compilation and checks do not): the timed runs.
                            last_time[key] = ((row["fwd_bwd_ms"] * (row["repeats"] + 1)
                                               + row["fwd_ms"] * (row["repeats"] + 1)) / 1e3, S)
                    except Exception as err:  # recorded, not fatal
                        row["error"] = f"{type(err).__name__}: {str(err)[:400]}"
                        failed[key] = S
                    for t in (q, k, v):
                        t.grad = None
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                rows.append(row)
                print(json.dumps(row), flush=True)
            del q, k, v, gout
    write(rows, args, device, started, list(shapes))


def write(rows, args, device, started, shape_names):
    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out_dir, exist_ok=True)
    meta = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", torch=torch.__version__,
                cudnn=torch.backends.cudnn.version() if device.type == "cuda" else None,
                date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), args=vars(args),
                wall_s=time.monotonic() - started, dtype="bfloat16", batch=1)
    path = os.path.join(out_dir, "attention_smoke.json" if args.smoke else f"attention_{'+'.join(shape_names)}.json")
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"\n{'shape':<8} {'S':>7} {'method':<22} {'fwd ms':>9} {'TF/s':>6} {'f+b ms':>9} {'TF/s':>6} "
          f"{'peak GiB':>8} {'out':>4} {'grad':>4}  note")
    for r in rows:
        ok = lambda x: "" if x is None else ("ok" if x else "BAD")  # noqa: E731
        note = (r.get("error") or r.get("skipped") or r.get("backward_error")
                or (f"picks {r['picks']}" if r.get("picks") else ""))
        print(f"{r['shape']:<8} {r['S']:>7} {r['method']:<22} {r.get('fwd_ms', math.nan):>9.2f} "
              f"{r.get('fwd_tflops', math.nan):>6.1f} {r.get('fwd_bwd_ms', math.nan):>9.2f} "
              f"{r.get('fwd_bwd_tflops', math.nan):>6.1f} {r.get('peak_gib', math.nan):>8.2f} "
              f"{ok(r.get('check', {}).get('ok')):>4} {ok(r.get('grads_ok')):>4}  {note[:70]}")
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
