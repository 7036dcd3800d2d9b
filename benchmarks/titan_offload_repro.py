"""Does torchtitan 0.2.2's `training.enable_cpu_offload` run at one rank? A minimal reproduction (issue 37).

    python benchmarks/titan_offload_repro.py --out $OUT/offload_repro            # one GPU, about 1 minute
    python benchmarks/titan_offload_repro.py --nproc 2 --out $OUT/offload_repro  # also at 2 ranks

Runs torchtitan's own entry point (`torchrun -m torchtitan.train`: its Trainer, nothing of ours in
the process) on its own train spec `deepseek_v3` at its own flavor `debugmodel`, reading its own
dataset entry `c4_test` (DATASETS in torchtitan/hf_datasets/text_datasets.py: a local folder read by
its own loader and text processor), 2 steps, with CPU offload on and off. The wheel ships neither
tests/assets/c4_test nor tests/assets/tokenizer and the GPU host has no network, so --c4-test-dir /
--tokenizer-dir take a torchtitan checkout's folders; by default the c4_test folder is written from
our embedded corpus in c4's format (one {"text": ...} per line of data.json) and the tokenizer is our
embedded 2048-token BPE (debugmodel's vocabulary is 2048 too). Neither touches the device code path.

What reading torchtitan 0.2.2 says (file:line in the installed package):
  train.py:184-186   with enable_cpu_offload the Trainer builds the model with init_device = "cpu"
                     and buffer_device = the GPU; train.py:256-258 `model.to_empty(device=init_device)`,
                     `init_weights(buffer_device=...)`: parameters on the CPU, buffers (freqs_cis,
                     the MoE's tokens_per_expert and expert_bias, models/moe/moe.py:567-572) on the GPU.
  models/deepseek_v3/infra/parallelize.py:162
                     `if parallel_dims.fsdp_enabled or parallel_dims.ep_enabled:` guards apply_fsdp,
                     the only place CPUOffloadPolicy is set (llama4/infra/parallelize.py:355-356,
                     `fsdp_config["offload_policy"] = CPUOffloadPolicy()`). At one rank dp_shard = 1 and
                     cp = 1 (distributed/parallel_dims.py:334-335, 346-347): no FSDP, so nothing ever
                     moves the CPU parameters to the GPU.
  train.py:581-582   the batch goes to the GPU; models/deepseek_v3/model/model.py:499 `tok_embeddings(tokens)`
                     is the first op: index_select with a GPU index into a CPU weight, "Expected all tensors
                     to be on the same device ... index is on cuda:0, different from other tensors on cpu".
So the failure is torchtitan's (a configuration its one-rank path does not support: offload needs
FSDP), not its MoE (the MoE buffers are on the GPU) and not our launcher (benchmarks/titan_launch.py
only registers a train spec with the same parallelize function and a dataset). This script checks
that on the GPU: the verdict says which.
Prints a table last and writes <out>/titan_offload_repro.json (each run's status, error line, log).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from mop_train.sweep import launch, point_from_launch  # noqa: E402

DEVICE_MISMATCH = re.compile(r"(different from other tensors on cpu|Expected all tensors to be on the same device)")
STEP_LINE = re.compile(r"step:\s*(\d+)\s+loss:")


def write_c4_test(folder: str, *, documents: int = 64) -> str:
    """A c4_test-shaped folder (data.json, one {"text": ...} per line) from our embedded corpus."""
    from mop_train.train.data import EMBEDDED, default_cache_dir, load_documents

    os.makedirs(folder, exist_ok=True)
    docs = load_documents(EMBEDDED, None, cache_dir=default_cache_dir())
    with open(os.path.join(folder, "data.json"), "w") as f:
        for i in range(min(documents, len(docs))):
            f.write(json.dumps({"text": docs[i]["text"]}) + "\n")
    return folder


def titan_flags(folder: str, *, tokenizer_dir: str, c4_dir: str, offload: bool, steps: int = 2) -> list[str]:
    """torchtitan's own flags: spec deepseek_v3, flavor debugmodel, dataset c4_test from `c4_dir`."""
    return ["--job.dump_folder", folder, "--model.name", "deepseek_v3", "--model.flavor", "debugmodel",
            "--model.hf_assets_path", tokenizer_dir, "--training.dataset", "c4_test",
            "--training.dataset_path", c4_dir, "--training.seq_len", "256", "--training.local_batch_size", "2",
            "--training.steps", str(steps), "--lr_scheduler.warmup_steps", "1", "--metrics.log_freq", "1",
            "--metrics.disable_color_printing", "--checkpoint.no-enable", "--activation_checkpoint.mode", "none",
            "--compile.no-enable", "--training.enable_cpu_offload" if offload else "--training.no-enable_cpu_offload"]


def titan_command(nproc: int, flags: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", "torchtitan.train", *flags]


def steps_logged(log_text: str) -> int:
    return max((int(m.group(1)) for m in STEP_LINE.finditer(log_text)), default=0)


def run_one(name: str, nproc: int, offload: bool, args, *, tokenizer_dir: str, c4_dir: str) -> dict:
    folder = os.path.join(os.path.abspath(args.out), name)
    log = os.path.join(folder, "output.log")
    cmd = titan_command(nproc, titan_flags(folder, tokenizer_dir=tokenizer_dir, c4_dir=c4_dir, offload=offload))
    # torchtitan only: nothing of ours importable (the repo off the path; where torchtitan itself was
    # installed, e.g. a --target folder on PYTHONPATH, stays)
    ours = {os.path.realpath(REPO), os.path.realpath(os.getcwd())}
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.realpath(p) not in ours]
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, **({"PYTHONPATH": os.pathsep.join(path)} if path else {})}
    # In its own folder: `python -m` puts the working directory first on sys.path, and the repo root holds mop_train.
    result = launch(cmd, log, timeout_s=args.timeout_s, env=env, cwd=(os.makedirs(folder, exist_ok=True), folder)[1])
    text = result.text()

    def summarize():
        n = steps_logged(text)
        if n < 2:
            raise ValueError(f"exited 0 after {n} logged steps")
        return {"steps": n}
    point = point_from_launch(result, summarize)
    return {"run": name, "nproc": nproc, "offload": offload, **point,
            "device_mismatch": bool(DEVICE_MISMATCH.search(text)), "log": log, "command": " ".join(cmd)}


def verdict(runs: list[dict]) -> str:
    """Whose failure it is, from the one-rank runs with and without offload."""
    by = {(r["nproc"], r["offload"]): r for r in runs}
    off, on = by.get((1, False)), by.get((1, True))
    if off is None or on is None:
        return "inconclusive: both one-rank runs (offload on and off) are needed"
    if off["status"] != "ok":
        return f"inconclusive: torchtitan's debugmodel fails at one rank without offload too ({off.get('error')})"
    if on["status"] == "ok":
        return ("not reproduced: torchtitan's own entry point runs CPU offload at one rank; the failure seen "
                "through benchmarks/titan_launch.py is ours (or its flavor / data)")
    if on["device_mismatch"]:
        return ("torchtitan's: with its own entry point, model (deepseek_v3 debugmodel) and dataset (c4_test), "
                "enable_cpu_offload at one rank fails on a CPU/GPU device mismatch and runs without it; "
                "no FSDP is applied at one rank, so the CPU-built parameters are never moved")
    return f"torchtitan's, another error: offload at one rank fails ({on['status']}: {on.get('error')})"


def format_table(runs: list[dict]) -> str:
    lines = [f"{'run':<18} {'ranks':>5} {'offload':>7} {'status':>8} {'steps':>5}  error"]
    for r in runs:
        lines.append(f"{r['run']:<18} {r['nproc']:>5} {str(r['offload']):>7} {r['status']:>8} {r.get('steps', 0):>5}  "
                     f"{(r.get('error') or '')[-140:]}")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=1, choices=(1, 2), help="2: also run offload at 2 ranks")
    p.add_argument("--c4-test-dir", default=None, help="a torchtitan checkout's tests/assets/c4_test")
    p.add_argument("--tokenizer-dir", default=None, help="a torchtitan checkout's tests/assets/tokenizer")
    p.add_argument("--timeout-s", type=float, default=240, help="time limit of one run")
    p.add_argument("--out", default=os.environ.get("OUT", "outputs") + "/offload_repro", help="output folder")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    from mop_train.train.data import default_cache_dir, embedded_assets

    c4_dir = args.c4_test_dir or write_c4_test(os.path.join(os.path.abspath(args.out), "c4_test"))
    tokenizer_dir = args.tokenizer_dir or embedded_assets(default_cache_dir())
    plan = [("offload-1rank", 1, True), ("no-offload-1rank", 1, False)] + \
        ([("offload-2rank", 2, True)] if args.nproc == 2 else [])
    runs = []
    for name, nproc, offload in plan:
        runs.append(run_one(name, nproc, offload, args, tokenizer_dir=tokenizer_dir, c4_dir=c4_dir))
        print(f"{name}: {runs[-1]['status']} {runs[-1].get('error') or ''}", flush=True)
    result = {"c4_test_dir": c4_dir, "tokenizer_dir": tokenizer_dir, "runs": runs, "verdict": verdict(runs)}
    with open(os.path.join(args.out, "titan_offload_repro.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(format_table(runs))
    print("verdict: " + result["verdict"])


if __name__ == "__main__":
    main()
