"""Document-masked attention against plain causal attention: time and peak memory, forward+backward.

One core attention call of MLA's shape (h heads, d_qk = 192, d_v = 128, bf16) over a packed row of
S tokens whose documents have random lengths around --mean-doc tokens:
  causal_sdpa     F.scaled_dot_product_attention(is_causal=True): today's path (crosses documents)
  document_flex   mop_train's document core on CUDA (compiled FlexAttention, block-sparse mask),
                  the mask cached as every later layer of a step finds it; document_flex_new_ids
                  builds it in the call (once per step in training)
  causal_flex     the same FlexAttention with a plain causal mask (what the sparsity saves)
The document core is also checked against the per-document reference at the smallest S.
Time: CUDA events, median of repeats after warm-up; peak: max_memory_allocated above the inputs.

    python benchmarks/document_mask.py                      # H200: S = 8K, 32K, 128K
    python benchmarks/document_mask.py --smoke              # CPU, tiny (forward only, checks it runs)
JSON goes to $OUT/document_mask.json if OUT is set, else benchmarks/results/document_mask.json
(document_mask_smoke.json for --smoke).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mop_train.models.document_mask import document_attention, document_attention_reference  # noqa: E402

GIB = 2 ** 30


def packed_doc_ids(S, mean_doc, gen, device):
    """[1, S] int32 ids of documents with lengths drawn uniformly in [1, 2 * mean_doc]."""
    lengths = []
    while sum(lengths) < S:
        lengths.append(int(torch.randint(1, 2 * mean_doc + 1, (1,), generator=gen)))
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:S]
    return ids.to(torch.int32)[None].to(device), len(lengths)


def causal_sdpa(q, k, v, doc_ids):
    out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
    return out.transpose(1, 2)


def causal_flex():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    compiled = torch.compile(flex_attention, dynamic=False)
    masks = {}

    def run(q, k, v, doc_ids):
        S = q.shape[1]
        if S not in masks:
            masks[S] = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, S, S, device=q.device)
        out = compiled(*(t.transpose(1, 2) for t in (q, k, v)), block_mask=masks[S],
                       scale=1 / math.sqrt(q.shape[-1]))
        return out.transpose(1, 2)
    return run


def document_flex(q, k, v, doc_ids):
    return document_attention(q, k, v, doc_ids, impl="flex")


def document_flex_new_ids(q, k, v, doc_ids):
    """As a training step's first layer sees it: new ids, so the BlockMask is built in the call."""
    return document_attention(q, k, v, doc_ids.clone(), impl="flex")


def measure(fn, q, k, v, doc_ids, grad, backward, repeats):
    def once():
        for t in (q, k, v):
            t.grad = None
        out = fn(q, k, v, doc_ids)
        if backward:
            out.backward(grad)
    once()
    cuda = q.is_cuda
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            once()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            once()
            times.append(time.perf_counter() - t0)
    row = {"time_s": statistics.median(times)}
    if cuda:
        for t in (q, k, v):
            t.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        once()
        torch.cuda.synchronize()
        row["peak_above_inputs_gib"] = (torch.cuda.max_memory_allocated() - base) / GIB
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-lens", default="8192,32768,131072")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--mean-doc", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    seq_lens = [int(s) for s in args.seq_lens.split(",")]
    if args.smoke:
        seq_lens, args.heads, args.mean_doc, args.repeats = [64, 128], 2, 16, 1
    backward = device.type == "cuda"  # FlexAttention has no CPU backward
    methods = {"causal_sdpa": causal_sdpa, "document_flex": document_flex,
               "document_flex_new_ids": document_flex_new_ids}
    if device.type == "cuda":
        methods["causal_flex"] = causal_flex()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for S in seq_lens:
        doc_ids, n_docs = packed_doc_ids(S, args.mean_doc, gen, device)
        q = torch.randn(1, S, args.heads, 192, generator=gen).to(device, dtype).requires_grad_(backward)
        k = torch.randn(1, S, args.heads, 192, generator=gen).to(device, dtype).requires_grad_(backward)
        v = torch.randn(1, S, args.heads, 128, generator=gen).to(device, dtype).requires_grad_(backward)
        grad = torch.randn(1, S, args.heads, 128, generator=gen).to(device, dtype)
        if S == seq_lens[0]:
            with torch.no_grad():
                got = document_flex(q, k, v, doc_ids).float()
                want = document_attention_reference(q.float(), k.float(), v.float(), doc_ids)
            err = ((got - want).norm() / want.norm()).item()
            rows.append({"check": "document_flex vs per-document reference", "S": S, "rel_err": err})
            print(json.dumps(rows[-1]), flush=True)
        for name, fn in methods.items():
            row = {"method": name, "S": S, "documents": n_docs, "heads": args.heads, "dtype": str(dtype)}
            try:
                row.update(measure(fn, q, k, v, doc_ids, grad, backward, args.repeats))
            except Exception as err:  # report and keep the others
                row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
        del q, k, v, grad
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out_dir, exist_ok=True)
    meta = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", torch=torch.__version__,
                date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), backward=backward, mean_doc=args.mean_doc)
    # a smoke run never overwrites a recorded GPU result
    with open(os.path.join(out_dir, "document_mask_smoke.json" if args.smoke else "document_mask.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"\n{'method':<22} {'S':>7} {'docs':>5} {'time s':>9} {'peak GiB':>9}")
    for r in rows:
        if "method" in r:
            print(f"{r['method']:<22} {r['S']:>7} {r['documents']:>5} {r.get('time_s', float('nan')):>9.4f} "
                  f"{r.get('peak_above_inputs_gib', float('nan')):>9.3f} {r.get('error', '')[:60]}")


if __name__ == "__main__":
    main()
