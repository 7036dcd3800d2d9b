"""OffloadStreamAdamW overlapped with the next forward: the same bits as overlap = false, every unit
waits for its own pieces before it runs and nothing is waited for twice; forward order; exposed time;
on CUDA, the same against the non-overlapped step and a forward that starts before the last bucket."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn as nn

from mop_train.ops.offload_adamw import OffloadStreamAdamW, forward_order, forward_units, host_update
from mop_train.ops.offload_adamw.forward_waits import ForwardWaits, Ready, _fsdp_streams
from mop_train.ops.offload_adamw.streams import Streams
from tests.ops.test_offload_adamw import HP, _assert_same_run
from tests.utils import assert_bitwise_equal, fresh_seed


class _Net(nn.Module):
    """Root-owned parameters (used first and last, like embeddings and the output projection)
    around three blocks; registration order differs from the forward's."""

    def __init__(self, seed: int, dtype=torch.float32, device="cpu", width: int = 6):
        super().__init__()
        torch.manual_seed(fresh_seed(seed))
        self.out = nn.Linear(width, 2, bias=False)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(3))
        self.emb = nn.Parameter(torch.randn(width))
        self.to(device=device, dtype=dtype)

    def forward(self, x):
        h = x * self.emb
        for block in self.blocks:
            h = block(h)
        return self.out(h)

    def units(self):
        return [self, *self.blocks]


def _train(model, opt, steps, seed, device="cpu"):
    for step in range(steps):
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(fresh_seed(seed * 100 + step)))
        opt.zero_grad()
        model(x.to(device=device, dtype=model.emb.dtype)).float().square().sum().backward()
        opt.step()
    if opt.overlap:
        opt.wait_for_weights()


def _build(model, overlap, **kwargs):
    opt = OffloadStreamAdamW(forward_order(model, model.units()), **HP, overlap=overlap, **kwargs, piece_align=1)
    opt.wait_in_forward(forward_units(model, model.units()))
    return opt


def test_forward_order_and_units():
    model = _Net(1)
    units = forward_units(model, model.units())
    assert [u for u, _ in units] == model.units()
    ids = lambda params: [id(p) for p in params]  # noqa: E731
    assert ids(units[0][1]) == ids([model.emb, model.out.weight])  # the root's own, first
    assert ids(units[2][1]) == ids(model.blocks[1].parameters())
    order = forward_order(model, model.units())
    assert ids(order[:2]) == ids([model.emb, model.out.weight]) and len(order) == len(list(model.parameters()))
    assert ids(forward_order(model)) == ids(model.parameters())  # no FSDP units: the root holds everything


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device_fraction,host_fraction", [(0.0, 0.0), (0.2, 0.3), (0.5, 0.0)])
def test_overlap_gives_the_same_bits(dtype, device_fraction, host_fraction, monkeypatch):
    monkeypatch.setattr(host_update, "CHUNK", 7)
    seed = fresh_seed(21 + int(10 * device_fraction) + int(100 * host_fraction))
    kwargs = dict(bucket_params=9, slots=2, device_fraction=device_fraction, host_fraction=host_fraction)
    runs = []
    for overlap in (False, True):
        model = _Net(seed, dtype)
        opt = _build(model, overlap, **kwargs)
        _train(model, opt, 4, seed)
        runs.append((list(model.parameters()), opt))
    (a_params, a_opt), (b_params, b_opt) = runs
    for i, (a, b) in enumerate(zip(a_params, b_params)):
        assert_bitwise_equal(a.detach(), b.detach(), name=f"param {i}")
    for opt in (a_opt, b_opt):  # the state dict keys follow the optimizer's (forward) order in both
        assert [p.shape for p in opt._params] == [p.shape for p in a_opt._params]
    _assert_same_run(a_opt._params, a_opt, b_opt._params, b_opt)


def test_each_unit_waits_for_its_own_pieces_once(monkeypatch):
    monkeypatch.setattr(host_update, "CHUNK", 5)
    model = _Net(3, width=8)
    opt = _build(model, True, bucket_params=7, slots=2, device_fraction=0.15, host_fraction=0.3)
    index = {id(p): i for i, p in enumerate(opt._params)}
    waits = opt.forward_waits
    seen = []

    def check(unit, params):
        def hook(mod, args):  # registered after the optimizer's: runs once its waits are made
            done = list(waits._done)
            for p in params:
                i = index[id(p)]
                lo, hi = opt._offsets[i], opt._offsets[i] + opt._numels[i]
                for lane, pieces in enumerate(waits._lanes):
                    for j, piece in enumerate(pieces):
                        if piece.lo < hi and piece.hi > lo:
                            assert j <= done[lane], f"unit {len(seen)} runs before piece {j} of lane {lane}"
            seen.append(unit)
        return hook

    units = forward_units(model, model.units())
    for unit, params in units:
        unit.register_forward_pre_hook(check(unit, params))
    x = torch.randn(3, 8)
    for step in range(3):
        opt.zero_grad()
        model(x).square().sum().backward()  # the first forward has nothing to wait for
        opt.step()
        lanes = [len(lane) for lane in waits._lanes]
        assert lanes[0] == len(opt._device_buckets) + len(opt._buckets) > 2 and lanes[1] >= 2
        assert waits.pending() and waits.log == []
    seen.clear()
    model(x)
    assert seen == [u for u, _ in units]
    log = waits.log
    assert len(set(log)) == len(log)  # nothing waited for twice
    for lane in range(2):
        js = [j for ln, j in log if ln == lane]
        assert js == sorted(js) and js[-1] == len(waits._lanes[lane]) - 1
    assert not waits.pending()
    model(x)  # a second forward (or a recompute) waits for nothing
    assert waits.log == log
    assert opt.exposed_seconds() >= 0.0


def test_overlap_without_hooks_waits_in_step():
    """overlap without hooks, or hooks without overlap (the default): step() itself waits for the last
    piece of each lane."""
    for overlap, hooks in ((True, False), (None, True)):
        model = _Net(4)
        kwargs = {} if overlap is None else dict(overlap=overlap)
        opt = OffloadStreamAdamW(forward_order(model, model.units()), **HP, bucket_params=5, host_fraction=0.3,
                                 **kwargs, piece_align=1)
        if hooks:
            opt.wait_in_forward(forward_units(model, model.units()))
        _train(model, opt, 2, 4)
        waits = opt.forward_waits
        assert not waits.pending() and not waits.hooked
        assert waits.log == [(lane, len(pieces) - 1) for lane, pieces in enumerate(waits._lanes) if pieces]


@pytest.mark.parametrize("device_fraction,host_fraction", [(1.0, 0.0), (0.0, 1.0)])
def test_a_piece_wider_than_every_unit_is_waited_for(device_fraction, host_fraction):
    """One piece holds every parameter (all on the device, or all updated on the CPU): the first unit
    waits for it; before any step there is nothing to wait for; without hooks step() waits again."""
    model = _Net(5)
    opt = _build(model, True, bucket_params=10_000, device_fraction=device_fraction, host_fraction=host_fraction)
    waits = opt.forward_waits
    x = torch.randn(3, 6)
    model(x).square().sum().backward()
    assert waits.log == []
    opt.step()
    lane = 0 if device_fraction else 1
    assert [len(pieces) for pieces in waits._lanes][lane] == 1 and waits.pending()
    model(x)
    assert waits.log == [(lane, 0)] and not waits.pending()
    waits.remove_hooks()
    opt.step()
    assert not waits.hooked and not waits.pending() and waits.log == [(lane, 0)]


@pytest.mark.gpu
@pytest.mark.parametrize("device_fraction", [0.0, 0.3])
def test_cuda_overlap_same_bits_and_forward_runs_early(device_fraction):
    seed = fresh_seed(31)
    kwargs = dict(bucket_params=5, slots=2, device_fraction=device_fraction)
    runs = []
    for overlap in (False, True):
        model = _Net(seed, torch.bfloat16, "cuda")
        opt = _build(model, overlap, **kwargs)
        _train(model, opt, 4, seed, "cuda")
        runs.append((model, opt))
    for (name, a), b in zip(runs[0][0].named_parameters(), runs[1][0].parameters()):
        assert_bitwise_equal(a.detach(), b.detach(), name=name)
    _assert_same_run(runs[0][1]._params, runs[0][1], runs[1][1]._params, runs[1][1])
    # a big model: the step returns before its buckets are done, the forward waits per unit
    big = nn.ModuleList(nn.Linear(2048, 2048, device="cuda") for _ in range(8))
    opt = OffloadStreamAdamW(list(big.parameters()), **HP, bucket_params=1 << 20, slots=3, overlap=True,
                             device_fraction=device_fraction, piece_align=1)
    opt.wait_in_forward([(m, list(m.parameters())) for m in big])
    x = torch.randn(64, 2048, device="cuda")
    for _ in range(3):
        opt.zero_grad()
        h = x
        for m in big:
            h = m(h)
        h.square().mean().backward()
        opt.step()
    assert opt.forward_waits.pending()  # nothing waited for yet: the forward will
    h = x
    for m in big:
        h = m(h)
    torch.cuda.synchronize()
    assert not opt.forward_waits.pending() and opt.exposed_seconds() > 0.0


def _fsdp_overlap_worker(rank, world_size, device_fraction):
    """FSDP2 units with bf16 compute: overlap (hooks before FSDP2's pre-forward) against no overlap."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from tests.dist_utils import worker_device
    device = worker_device()
    mesh = init_device_mesh(device.type, (world_size,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    runs = []
    for overlap in (False, True):
        model = _Net(51, device=device, width=64)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        opt = OffloadStreamAdamW(forward_order(model), **HP, bucket_params=300, slots=2,
                                 device_fraction=device_fraction, overlap=overlap, piece_align=1)
        opt.wait_in_forward(forward_units(model))
        assert opt.forward_waits.hooked == overlap
        for step in range(4):
            x = torch.randn(8, 64, generator=torch.Generator().manual_seed(fresh_seed(step + 10 * rank)))
            opt.zero_grad()
            model(x.to(device)).float().square().sum().backward()
            opt.step()
        opt.wait_for_weights()
        runs.append([p.to_local().detach().clone() for p in model.parameters()])
    for i, (a, b) in enumerate(zip(*runs)):
        assert_bitwise_equal(a, b, name=f"rank {rank} param {i}")


@pytest.mark.gpu
@pytest.mark.parametrize("device_fraction", [0.0, 0.4])
def test_cuda_fsdp2_overlap_same_bits(device_fraction):
    from tests.dist_utils import run_distributed
    run_distributed(_fsdp_overlap_worker, 1, device_fraction, backend="nccl")


@pytest.fixture
def nccl_group(monkeypatch):
    """A 1-rank NCCL process group in this process, joined as run_distributed's ranks join theirs
    (FSDP2 on one GPU, with the waits traced in the test's own process)."""
    import torch.distributed as dist
    from tests.dist_utils import _free_port, _init
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    _init("nccl", 0, 1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
def test_cuda_fsdp2_waits_hold_back_the_all_gather_streams(nccl_group, monkeypatch):
    """FSDP2 units: every piece the forward waits for is also waited for by FSDP2's all-gather streams
    (copy-in and all-gather: they read a unit's sharded weights before its forward, and before the
    unit's own wait has held back the compute stream); overlap gives the bits of overlap = false."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh("cuda", (1,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    waited, wait_event = [], torch.cuda.Stream.wait_event

    def spy(stream, event):
        waited.append((stream, event))
        wait_event(stream, event)
    monkeypatch.setattr(torch.cuda.Stream, "wait_event", spy)
    seed = fresh_seed(71)
    runs = []
    for overlap in (False, True):
        model = _Net(seed, device="cuda", width=64)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        assert _fsdp_streams(model) == [] and _fsdp_streams(nn.Linear(2, 2)) == []  # before lazy init
        opt = OffloadStreamAdamW(forward_order(model), **HP, bucket_params=300, slots=2, device_fraction=0.2,
                                 host_fraction=0.3, overlap=overlap, piece_align=1)
        opt.wait_in_forward(forward_units(model))
        waits = opt.forward_waits
        for step in range(4):
            x = torch.randn(8, 64, generator=torch.Generator().manual_seed(fresh_seed(72 + step)))
            opt.zero_grad()
            waited.clear()
            model(x.cuda()).float().square().sum().backward()
            if overlap and step:  # the forward waited for the last step's pieces
                ctx = model._get_fsdp_state()._comm_ctx
                gather = [ctx.all_gather_copy_in_stream, ctx.all_gather_stream]
                assert all(_fsdp_streams(unit) == gather for unit in (model, *model.blocks))
                events = [waits._lanes[lane][j].event for lane, j in waits.log]
                assert {lane for lane, _ in waits.log} == {0, 1} and not waits.pending()
                current = torch.cuda.current_stream()
                for (lane, j), event in zip(waits.log, events):
                    by = [stream for stream, e in waited if e is event]
                    for stream in (current, *gather):
                        assert any(b == stream for b in by), f"piece {j} of lane {lane}: {stream} did not wait"
            opt.step()
        opt.wait_for_weights()
        runs.append([p.to_local().detach().clone() for p in model.parameters()])
    for i, (a, b) in enumerate(zip(*runs)):
        assert_bitwise_equal(a, b, name=f"param {i}")


_SPIN = 500_000_000  # GPU clock cycles: >= 0.25 s at the H200's top clock, far past the host's queueing
_HOLD = 0.2          # seconds the host holds the compute stream back in a step


def _written_late(stream, dst, src, spin=_SPIN):
    """On `stream`: spin `spin` clock cycles, then dst <- src; returns the event after the write."""
    with torch.cuda.stream(stream):
        if spin:
            torch.cuda._sleep(spin)
        dst.copy_(src)
    return stream.record_event()


@pytest.mark.gpu
def test_cuda_waits_hold_back_the_streams_and_time_the_stalls():
    """The waits are stream waits: after wait_ranges the current stream and the streams passed (FSDP2's
    all-gather streams, in the hooks) read the piece's final weights, after wait_all the current stream
    reads every piece's; exposed_seconds() is the time the current stream stalled in them (positive,
    within the wall time around them), counted from `since` when given (the host's time included)."""
    gen = torch.Generator().manual_seed(fresh_seed(61))
    old, new = (torch.randn(3, 4096, generator=gen).cuda() for _ in range(2))
    weights = old.clone()
    streams = Streams(torch.device("cuda", torch.cuda.current_device()))
    waits = ForwardWaits(streams)
    side, others = torch.cuda.Stream(), [torch.cuda.Stream(), torch.cuda.Stream()]
    torch.cuda._sleep(1)
    weights.clone()  # the kernels are loaded before the host's queueing is raced against a spin
    torch.cuda.synchronize()
    wall = time.perf_counter()
    lanes = ([Ready(0, 4, _written_late(side, weights[0], new[0])),
              Ready(4, 8, _written_late(side, weights[1], new[1]))],
             [Ready(8, 12, _written_late(side, weights[2], new[2], spin=0))])
    waits.arm(lanes, count_wall=False)
    waits.wait_ranges([(1, 3)], others)  # lane 0's piece 0 alone
    first = [weights[0].clone()]
    for stream in others:
        with torch.cuda.stream(stream):
            first.append(weights[0].clone())
    assert waits.log == [(0, 0)] and waits.pending()
    waits.wait_all()
    final = weights.clone()
    torch.cuda.synchronize()
    wall = time.perf_counter() - wall
    for i, got in enumerate(first):
        assert_bitwise_equal(got, new[0], name=f"piece 0 read on stream {i}")
    assert_bitwise_equal(final, new, name="weights after wait_all")
    assert waits.log == [(0, 0), (0, 1), (1, 0)] and not waits.pending()
    stalls = waits.exposed_seconds()
    assert 0.0 < stalls <= wall + 1e-3, (stalls, wall)
    # counted from `since` (the step's start): the host's time before the wait is a stall too
    done = _written_late(side, weights[0], old[0], spin=0)
    side.synchronize()
    wall = time.perf_counter()
    since = streams.record(timing=True)
    since.synchronize()
    time.sleep(_HOLD)
    waits.arm(([Ready(0, 12, done)], []), count_wall=False)
    waits.wait_all(since=since)
    torch.cuda.synchronize()
    wall = time.perf_counter() - wall
    exposed = waits.exposed_seconds()
    assert 0.9 * _HOLD <= exposed <= wall + 1e-3, (exposed, wall)


def _tiling(gen, lo, hi):
    """Random contiguous pieces tiling [lo, hi) (none when empty)."""
    cuts = sorted({lo, hi, *torch.randint(lo, hi + 1, (4,), generator=gen).tolist()})
    return [Ready(a, b) for a, b in zip(cuts[:-1], cuts[1:]) if b > a]


def test_wait_ranges_waits_for_the_last_intersecting_piece_only():
    """Each call waits, per lane, for exactly the last piece that intersects one of its ranges (a piece
    that only touches a range's edge is not waited for), and never for a piece already waited for."""
    gen = torch.Generator().manual_seed(fresh_seed(31))
    for _ in range(50):
        n = int(torch.randint(2, 40, (1,), generator=gen))
        split = int(torch.randint(0, n + 1, (1,), generator=gen))
        lanes = (_tiling(gen, 0, split), _tiling(gen, split, n))
        waits = ForwardWaits(Streams(torch.device("cpu")))
        waits.arm(lanes, count_wall=True)
        done, log = [-1, -1], []
        for _ in range(6):
            edges = sorted(torch.randint(0, n + 1, (2,), generator=gen).tolist())
            ranges = [(edges[0], max(edges[1], edges[0] + 1))]
            waits.wait_ranges(ranges)
            for lane, pieces in enumerate(lanes):
                hit = [j for j, p in enumerate(pieces) if any(p.lo < hi and p.hi > lo for lo, hi in ranges)]
                if hit and max(hit) > done[lane]:
                    done[lane] = max(hit)
                    log.append((lane, max(hit)))
            assert waits.log == log, (lanes, ranges)
        assert waits.pending() == any(d < len(p) - 1 for d, p in zip(done, lanes))


def test_exposed_seconds_on_cpu():
    """On CPU a step's exposed time is its host time when it held the forward back (count_wall), else 0,
    reported once every piece has been waited for; 0 before any step."""
    waits = ForwardWaits(Streams(torch.device("cpu")))
    assert waits.exposed_seconds() == 0.0
    lanes = ([Ready(0, 4), Ready(4, 9)], [])
    waits.arm(lanes, count_wall=True)  # a step that has not reported its host time counts none
    waits.wait_all()
    assert waits.exposed_seconds() == 0.0
    for count_wall, expected in ((True, 0.25), (False, 0.0)):
        waits.arm(lanes, count_wall=count_wall)
        waits.set_wall(0.25)
        waits.wait_ranges([(0, 2)])
        assert waits.pending()
        waits.wait_all()
        assert not waits.pending() and waits.exposed_seconds() == expected


def test_optimizer_wait_runs_before_the_units_other_hooks():
    """The optimizer's pre-hook goes first (prepend), ahead of hooks registered earlier (FSDP2's
    all-gather among them); parameters the optimizer does not hold are skipped."""
    model = _Net(2)
    seen = []
    for block in model.blocks:
        block.register_forward_pre_hook(lambda mod, args: seen.append(list(opt.forward_waits._done)))
    held = [p for p in forward_order(model, model.units()) if p is not model.blocks[1][0].bias]
    opt = OffloadStreamAdamW(held, **HP, overlap=True, bucket_params=5, piece_align=1)
    opt.wait_in_forward(forward_units(model, model.units()))
    model(torch.randn(2, 6)).square().sum().backward()
    opt.step()                                                    # no wait_for_weights: the hooks wait
    seen.clear()
    model(torch.randn(2, 6))
    lane0 = [r.hi for r in opt.forward_waits._lanes[0]]
    index = {id(p): i for i, p in enumerate(opt._params)}
    for block, done in zip(model.blocks, seen):
        last = max(opt._offsets[index[id(p)]] + opt._numels[index[id(p)]] for p in block.parameters() if id(p) in index)
        assert done[0] >= 0 and lane0[done[0]] >= last, (done, lane0, last)
    assert len(seen) == len(model.blocks) and seen[0] != seen[-1]       # each block waited for more


def test_default_units_and_explicit_order():
    model = _Net(3)
    ids = lambda params: [id(p) for p in params]  # noqa: E731
    (unit, params), = forward_units(model)                       # nothing sharded: the root alone
    assert unit is model and ids(params) == ids(model.parameters())
    order = forward_order(model, [model.blocks[2], model.blocks[0]])
    rest = [p for p in model.parameters() if id(p) not in set(ids([*model.blocks[2].parameters(), *model.blocks[0].parameters()]))]
    assert ids(order) == ids([*model.blocks[2].parameters(), *model.blocks[0].parameters(), *rest])
