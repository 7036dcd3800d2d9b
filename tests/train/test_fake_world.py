"""`--comm.mode fake_backend` (mop_train.parallel.fake_world): one process runs rank r of a W-rank job.

- the stand-in collectives deliver what a world of identical ranks would (random inputs, exact);
- fidelity: at W=2 and W=4 under the balanced profile (LLEP relocating, chunked), the fake rank's
  dispatch figures (chunks, routes sent and received per chunk, relocated routes, weight copies and
  their bytes) and Ring-DTP's rounds (ring shifts, shard meetings) equal the same rank's in a real
  gloo run of the same layout; under a skewed profile placed on rank 1's experts too (where the
  plan's receive sizes depend on the sender: the count exchange alone cannot give them);
- the paper's 64-rank layout (W=64, D=16, E_p=64, P=8) runs a step on CPU on `debug` widened to
  16 heads and 64 experts (`debug` has 4 heads and 8 experts: too few for D=16 and E_p=64), with
  every group of the layout's size and the receive sizes of an identical world;
- the CLI: every log line says losses are meaningless; what it cannot stand in for is refused by name.
"""

from __future__ import annotations

import json
import os
import traceback
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from mop_train.models import zoo
from tests.dist_utils import rank_context, run_distributed
from tests.train.cli import DEBUG_CONFIG, REPO, check_ok, read_metrics
from tests.utils import fresh_seed

DEBUG_WIDE = replace(zoo.get_model_args("debug"), n_heads=16, num_experts=64)
"""The smallest change to `debug` that takes the paper's 64-rank layout: 16 heads for D=16, 64
experts for E_p=64 (its V=2048 already splits over P=8)."""


def _alone(fn, args, errors, environ):
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(1)
    try:
        fn(*args)
    except BaseException:
        errors.put(traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_alone(fn, *args, timeout_s: float = 300) -> None:
    """fn(*args) in one fresh process (a fake world needs a process without a default group), forked
    from the tests' fork server (tests.dist_utils.rank_context: torch and mop_train imported, nothing
    run), so each child starts as a spawned process would, without its imports; it gets the caller's
    environment."""
    ctx = rank_context()
    errors = ctx.SimpleQueue()
    proc = ctx.Process(target=_alone, args=(fn, args, errors, dict(os.environ)))
    proc.start()
    proc.join(timeout_s)
    if proc.is_alive():
        proc.kill()
        raise AssertionError(f"{fn.__name__} did not finish within {timeout_s} s")
    if not errors.empty():
        raise AssertionError(errors.get())
    assert proc.exitcode == 0, f"{fn.__name__} exited {proc.exitcode}"


# ---------------------------------------------------------------------------------------------
# The stand-ins, collective by collective
# ---------------------------------------------------------------------------------------------

def _check_collectives(seed: int) -> None:
    from mop_train.parallel.fake_world import init_fake_world

    W, r, G = 8, 5, 4
    init_fake_world(W, r, torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    group = dist.new_group(list(range(4, 8)))                          # r is position 1 of 4
    assert dist.get_world_size(group) == G and dist.get_rank(group) == 1 and dist.get_rank() == r
    x = torch.randn(3, 5, generator=g)
    slots = [torch.full_like(x, float("nan")) for _ in range(G)]
    dist.all_gather(slots, x, group=group)                             # every slot is the local tensor
    assert all(torch.equal(s, x) for s in slots)
    flat = torch.full((W * 15,), float("nan"))
    dist.all_gather_into_tensor(flat, x.reshape(-1))
    assert torch.equal(flat.view(W, 15), x.reshape(1, -1).expand(W, -1))
    y = x.clone()
    dist.all_reduce(y, group=group)                                    # a reduce leaves the local value
    assert torch.equal(y, x)
    big = torch.randn(G * 6, generator=g)
    part = torch.empty(6)
    dist.reduce_scatter_tensor(part, big, group=group)                 # the local slice of position 1
    assert torch.equal(part, big[6:12])
    # Split counts: row s is what this rank sends peer s; identical peers send this rank its own row 1.
    sends = torch.randint(0, 9, (G, 3), generator=g)                   # [G(dst), 3] counts
    got = torch.empty_like(sends)
    dist.all_to_all_single(got, sends, group=group)
    assert torch.equal(got, sends[1].expand(G, 3))
    splits = sends.sum(1).tolist()
    rows = torch.randn(sum(splits), 2, generator=g)
    recv = [int(n) for n in got.sum(1)]                                # the transpose: splits[1] from each
    out = torch.full((sum(recv), 2), float("nan"))
    dist.all_to_all_single(out, rows, recv, splits, group=group)
    own = rows[splits[0]:splits[0] + splits[1]]                        # what this rank sends itself
    assert torch.equal(out, own.repeat(G, 1))
    # A caller's own receive sizes (LLEP's plan): each received chunk cycles chunk 1, never NaN.
    odd = [splits[1] + 1, 0, max(splits[1] - 1, 0), 2]
    out = torch.full((sum(odd), 2), float("nan"))
    dist.all_to_all_single(out, rows, odd, splits, group=group)
    src = own if len(own) else rows
    expect = torch.cat([src[torch.arange(n) % len(src)] for n in odd])
    assert torch.equal(out, expect)
    # A ring shift: the recv gets what this rank sent (matched by shape and dtype, in order).
    a, b = torch.randn(4, 3, generator=g), torch.randint(0, 100, (4,), generator=g)
    ra, rb, lonely = torch.full_like(a, float("nan")), torch.full_like(b, -1), torch.full((2, 2), float("nan"))
    ops = [dist.P2POp(dist.irecv, lonely, 4, group=group), dist.P2POp(dist.isend, a, 6, group=group),
           dist.P2POp(dist.isend, b, 6, group=group), dist.P2POp(dist.irecv, ra, 4, group=group),
           dist.P2POp(dist.irecv, rb, 4, group=group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    assert torch.equal(ra, a) and torch.equal(rb, b)
    assert torch.equal(lonely, torch.zeros(2, 2))                      # nothing of its shape was sent
    objects = [None] * W
    dist.all_gather_object(objects, {"rank": r})
    assert objects == [{"rank": r}] * W


def test_stand_in_collectives_deliver_what_identical_ranks_would():
    run_alone(_check_collectives, fresh_seed(3501))


# ---------------------------------------------------------------------------------------------
# Fidelity: the fake rank against the same rank of a real gloo world
# ---------------------------------------------------------------------------------------------

def _argv(folder: str, W: int, D: int, Ep: int, P: int, dispatch: str, seq_len: int, extra=()) -> list[str]:
    return ["--job.config_file", DEBUG_CONFIG, "--job.dump_folder", folder, "--checkpoint.no-enable",
            "--metrics.no-enable-tensorboard", "--training.seq_len", str(seq_len),
            "--training.local_batch_size", "1", "--debug.seed", "3", "--mop.layout.seq_degree", str(D),
            "--mop.layout.expert_degree", str(Ep), "--mop.layout.vocab_degree", str(P),
            "--mop.moe.dispatch", dispatch, *extra]


def _record_step(argv: list[str], out_path: str | None, *, model_args=None, profile_at: int | None = None) -> dict:
    """Build the run of `argv` in this process's world, run one training step and return (and write
    to out_path, when given) this rank's dispatch figures per MoE layer and Ring-DTP's rounds."""
    from mop_train.config import load_job_config
    from mop_train.ops.ring_dtp import function as ring_function
    from mop_train.ops.ring_dtp.ring import Ring
    from mop_train.parallel.fake_world import apply_routing_profile
    from mop_train.train.build import build_run
    from mop_train.train.loop import StepGuards, train_step
    from mop_train.train.reliability import NonFiniteGuard, StopFlag

    cfg = load_job_config(argv, model_flavors=zoo.names())
    device = torch.device("cpu")
    run = build_run(cfg, device, model_args=model_args)
    if profile_at is not None:    # every real rank routes as the fake rank `profile_at` does
        apply_routing_profile(run.parts.model, cfg.mop.moe.routing_profile, expert_position=profile_at,
                              expert_degree=run.layout.expert_size)
    rounds = {"shifts": 0, "meetings": 0}
    shift, fold, backward = Ring.shift, ring_function.fold_shard, ring_function.shard_backward

    def counted(fn, key):
        def wrapper(*a, **k):
            rounds[key] += 1
            return fn(*a, **k)
        return wrapper
    Ring.shift = counted(shift, "shifts")
    ring_function.fold_shard, ring_function.shard_backward = counted(fold, "meetings"), counted(backward, "meetings")
    try:
        guards = StepGuards(NonFiniteGuard(cfg.mop.reliability, rank=dist.get_rank(), world=dist.get_world_size(),
                                           device=device), StopFlag(), run.schedule_steps)
        out = train_step(run.parts, run.layout, [next(iter(run.dataloader))], run.optimizers, run.lr_schedulers,
                         max_norm=cfg.training.max_norm, bias_rate=cfg.mop.moe.bias_update_rate, device=device,
                         guards=guards, step=1)
    finally:
        Ring.shift, ring_function.fold_shard, ring_function.shard_backward = shift, fold, backward
    layers = []
    for moe in run.parts.model.moe_layers():
        s = moe.dispatch.stats
        layers.append({"num_chunks": s.num_chunks, "chunk_sent": s.chunk_sent, "chunk_received": s.chunk_received,
                       "relocated_routes": s.relocated_routes, "migrated_experts": s.migrated_experts,
                       "weight_transfer_bytes": s.weight_transfer_bytes, "received_bound": s.received_bound})
    lay = run.layout
    record = {"layers": layers, "rounds": rounds, "loss_finite": bool(torch.isfinite(out["loss_sum"])),
              "skipped": out["verdict"].skip,
              "groups": {name: dist.get_world_size(getattr(lay, f"{name}_group"))
                         for name in ("seq", "expert", "vocab", "expert_replica", "vocab_replica")}}
    if out_path is not None:
        with open(out_path, "w") as f:
            json.dump(record, f)
    return record


def _real_rank(rank, world_size, argv, out_dir, profile_at):
    _record_step(argv, os.path.join(out_dir, f"real{rank}.json"), profile_at=profile_at)


def _fake_rank(world_size, rank, argv, out_path):
    from mop_train.parallel.fake_world import init_fake_world

    init_fake_world(world_size, rank, torch.device("cpu"))
    _record_step(argv + ["--comm.mode", "fake_backend"], out_path)


FIDELITY = [  # (W, D, E_p, P, dispatch, seq_len, extra, routing profile, the real run's profile position, ranks)
    pytest.param(2, 1, 2, 2, "llep", 60, ["--mop.moe.imbalance_threshold", "1.0", "--mop.moe.min_tokens_per_gemm", "4",
                                          "--mop.ring_dtp.mode", "move_weights"], "balanced", None, (0,), id="W2-llep"),
    pytest.param(4, 2, 4, 2, "pipelined_llep", 120, ["--mop.moe.token_budget", "24", "--mop.moe.imbalance_threshold",
                                                     "1.0", "--mop.moe.min_tokens_per_gemm", "4"],
                 "balanced", None, (0, 3), id="W4-pipelined"),
    pytest.param(4, 2, 4, 2, "pipelined_llep", 120, ["--mop.moe.token_budget", "24", "--mop.moe.min_tokens_per_gemm", "4"],
                 "80/4", 1, (1,), id="W4-skewed-on-rank1"),
]


@pytest.mark.slow
@pytest.mark.parametrize("W, D, Ep, P, dispatch, seq_len, extra, profile, profile_at, ranks", FIDELITY)
def test_fake_rank_dispatch_and_ring_figures_equal_the_real_rank(tmp_path, W, D, Ep, P, dispatch, seq_len, extra,
                                                                  profile, profile_at, ranks):
    real = _argv(str(tmp_path / "real"), W, D, Ep, P, dispatch, seq_len,
                 [*extra, "--mop.moe.routing_profile", profile])
    run_distributed(_real_rank, W, real, str(tmp_path), profile_at, timeout_s=400)
    fake_extra = extra if profile == "balanced" else [*extra, "--mop.moe.routing_profile", profile]
    for r in ranks:                                    # balanced is the fake mode's default: not passed
        fake = _argv(str(tmp_path / f"fake{r}"), W, D, Ep, P, dispatch, seq_len, fake_extra)
        run_alone(_fake_rank, W, r, fake, str(tmp_path / f"fake{r}.json"))
        expected = json.load(open(tmp_path / f"real{r}.json"))
        got = json.load(open(tmp_path / f"fake{r}.json"))
        assert got["layers"] == expected["layers"], f"rank {r}: fake {got['layers']} != real {expected['layers']}"
        assert got["rounds"] == expected["rounds"] and got["rounds"]["shifts"] > 0, (r, got["rounds"])
        assert got["groups"] == expected["groups"]
        assert got["loss_finite"] and not got["skipped"]
        layer = expected["layers"][0]
        assert layer["relocated_routes"] > 0 and layer["migrated_experts"] > 0, layer   # relocation was exercised
        assert dispatch == "llep" or layer["num_chunks"] > 1, layer                     # and chunking


# ---------------------------------------------------------------------------------------------
# The paper's 64-rank layout on CPU
# ---------------------------------------------------------------------------------------------

def _identical_world_receipts(N: int, E: int, k: int, P: int, K: int, rank: int, plan) -> list[int]:
    """Routes `rank` receives per chunk when all P sources route N tokens by the balanced profile:
    source s's j-th route (token order) to expert e sits at position s * c_e + j of e's route list,
    and goes to the rank whose plan range holds that position; a route's chunk is its token's."""
    from mop_train.ops.routing_profiles import routing_profile

    indices, _ = routing_profile("balanced", N, E, k)
    per_expert: dict[int, list[int]] = {}
    for token in range(N):
        for e in indices[token].tolist():
            per_expert.setdefault(e, []).append(token % K)            # strided chunk of the route's token
    got = [0] * K
    for e, chunks in per_expert.items():
        ranges = [(lo, hi, g) for ee, g, lo, hi in plan.ranges if ee == e]
        for s in range(P):
            for j, chunk in enumerate(chunks):
                pos = s * len(chunks) + j
                if next(g for lo, hi, g in ranges if lo <= pos < hi) == rank:
                    got[chunk] += 1
    return got


def _paper_layout_step(W, rank, argv, N, budget):
    from mop_train.ops.moe_dispatch.llep_plan import llep_plan
    from mop_train.ops.routing_profiles import routing_profile
    from mop_train.parallel.fake_world import init_fake_world

    init_fake_world(W, rank, torch.device("cpu"))
    record = _record_step(argv + ["--comm.mode", "fake_backend"], None, model_args=DEBUG_WIDE)
    assert record["groups"] == {"seq": 16, "expert": 64, "vocab": 8, "expert_replica": 1, "vocab_replica": 8}
    assert record["loss_finite"] and not record["skipped"]
    E, k, P = DEBUG_WIDE.num_experts, DEBUG_WIDE.top_k, 64
    K = -(-N // budget)
    counts = torch.bincount(routing_profile("balanced", N, E, k)[0].reshape(-1), minlength=E)
    plan = llep_plan(counts.expand(P, E).contiguous(), min_tokens_per_gemm=4)
    expected = _identical_world_receipts(N, E, k, P, K, rank, plan)
    sent = [k * len(range(i, N, K)) for i in range(K)]
    assert plan.relocated_routes > 0                                     # the hot-ish experts relocate
    for layer in record["layers"]:
        assert layer["num_chunks"] == K and layer["chunk_sent"] == sent, layer
        assert layer["chunk_received"] == expected, (layer["chunk_received"], expected)
        assert layer["relocated_routes"] == plan.relocated_routes and layer["migrated_experts"] == len(plan.transfers)
        assert layer["received_bound"] == P * k * -(-N // K)
    assert record["rounds"]["meetings"] == 2 * 8                         # each token set meets every shard, twice


@pytest.mark.slow
def test_paper_layout_w64_d16_ep64_p8_runs_one_rank_with_an_identical_worlds_sizes(tmp_path):
    N, budget = 48, 16                                                   # tokens per rank, token budget c
    argv = _argv(str(tmp_path / "w64"), 64, 16, 64, 8, "pipelined_llep", 16 * N,
                 ["--mop.moe.token_budget", str(budget), "--mop.moe.min_tokens_per_gemm", "4"])
    run_alone(_paper_layout_step, 64, 37, argv, N, budget)


# ---------------------------------------------------------------------------------------------
# The CLI: the log, and what it refuses
# ---------------------------------------------------------------------------------------------

def _fake_cli(args: list[str], env_extra: dict, timeout: float = 300):
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1", **env_extra}
    for name in ("TORCHELASTIC_RUN_ID", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        if name not in env_extra:
            env.pop(name, None)
    return subprocess.run([sys.executable, "-m", "mop_train.train", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_cli_fake_run_says_on_every_line_that_losses_are_meaningless(tmp_path):
    folder = str(tmp_path / "cli")
    args = _argv(folder, 8, 2, 4, 2, "ep", 64, ["--comm.mode", "fake_backend", "--training.steps", "2",
                                                 "--metrics.log_freq", "1"])
    proc = _fake_cli(args, {"WORLD_SIZE": "8", "RANK": "6"})
    check_ok(proc)
    note = "fake world W=8 rank 6: losses are meaningless in this mode"
    step_lines = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(step_lines) == 2 and all(note in line for line in step_lines), proc.stdout[-2000:]
    assert proc.stdout.count(note) >= 4                                  # the launch banner and the end too
    records = read_metrics(folder)
    assert [r["step"] for r in records] == [1, 2] and all(note in r["fake_world"] for r in records)
    assert all(r["moe_num_chunks"] == 1 and not r["skipped"] for r in records)
    refused = _fake_cli(args + ["--checkpoint.enable"], {"WORLD_SIZE": "8", "RANK": "6"})
    assert refused.returncode == 2 and "checkpoint.enable" in refused.stderr, refused.stderr[-2000:]
    # a lone fake rank has no rank 0 to print for it: the error names the rank, without torchrun's wait
    assert "mop_train.train (rank 6): error:" in refused.stderr, refused.stderr[-2000:]


def test_config_refuses_what_a_fake_world_cannot_stand_in_for():
    from mop_train.config import load_job_config

    base = ["--job.config_file", DEBUG_CONFIG, "--comm.mode", "fake_backend", "--checkpoint.no-enable"]
    load_job_config(base + ["--mop.moe.routing_profile", "80/16"])       # accepted
    for extra, named in ((["--checkpoint.enable"], "checkpoint.enable"),
                         (["--mop.reliability.check_a2a_splits"], "mop.reliability.check_a2a_splits"),
                         (["--metrics.save_for_all_ranks"], "metrics.save_for_all_ranks"),
                         (["--checkpoint.initial_load_path", "/x"], "checkpoint.initial_load_path")):
        with pytest.raises(ValueError, match=named.replace(".", r"\.")):
            load_job_config(base + extra)
    with pytest.raises(ValueError, match="comm.mode = 'local_tensor'"):
        load_job_config(["--job.config_file", DEBUG_CONFIG, "--comm.mode", "local_tensor"])
    for bad in ("hot", "80/0", "120/4", "80/4/2"):
        with pytest.raises(ValueError, match="routing_profile"):
            load_job_config(["--job.config_file", DEBUG_CONFIG, "--mop.moe.routing_profile", bad])


def test_fake_world_from_env_names_what_is_missing():
    from mop_train.parallel.fake_world import fake_world_from_env

    assert fake_world_from_env({"WORLD_SIZE": "64", "RANK": "63"}) == (64, 63)
    for env, named in (({"RANK": "0"}, "WORLD_SIZE"), ({"WORLD_SIZE": "8"}, "RANK"),
                       ({"WORLD_SIZE": "8", "RANK": "8"}, "RANK"), ({"WORLD_SIZE": "8", "RANK": "x"}, "RANK"),
                       ({"WORLD_SIZE": "8", "RANK": "0", "TORCHELASTIC_RUN_ID": "1"}, "without torchrun")):
        with pytest.raises(ValueError, match=named):
            fake_world_from_env(env)
