"""A fake world: one process runs rank r of a W-rank job, its collectives standing in for a world
of identical ranks (`--comm.mode fake_backend`, WORLD_SIZE=W RANK=r, no torchrun).

    init_fake_world(world_size=64, rank=3, device=torch.device("cuda", 0))   # then build the run as usual

Every rank of the emulated world is taken to hold what this rank holds and to run what it runs, so
each collective returns what such a world would deliver to rank r, computed from r's own data:
  - all-gather: every peer's slot is the local tensor;     all-reduce / reduce: the local value;
  - reduce-scatter: the local tensor's own slice;           broadcast: the local buffer as it is;
  - all-to-all: peer s sends r what r sends itself (chunk r of the input), so the receive sizes
    are the transpose of identical send rows; an exchange of split counts therefore yields the
    sizes that real peers would send, and the data exchange fills each received chunk from chunk r
    (cycled where a caller's split differs: LLEP's plan, below; zeros when there is nothing);
  - send / recv (Ring-DTP's ring, LLEP's weight copies): a recv gets what this rank sent in the same
    batch (first unmatched send of its shape and dtype), else zeros; barrier: nothing.
Values are meaningless (losses too); shapes, sizes, allocations and compute are a real rank's.
Operators that can do better ask their group `stands_for_identical_ranks(group)`: LLEP's chunk
plan then computes from the (all-gathered, identical) count matrix what every peer's plan sends
this rank, so relocation under a skewed routing profile receives what a real rank would.
Routing is forced to a profile of mop_train.ops.routing_profiles (`apply_routing_profile`; the
router still computes its scores and weights, so its compute and gradient are a real run's).

What we took as a model, and why not as it is: torch's "fake" backend
(torch.testing._internal.distributed.fake_pg: FakeStore + a C++ FakeProcessGroup) hallucinates
results at any rank and world size, but (torch 2.13, measured) copies an uneven all-to-all's input
prefix into every output chunk, returns an even all-to-all unchanged (the counts' transpose is not
formed), and leaves a recv's buffer uninitialised (NaN steps would be skipped); its behaviour is
not documented across the 2.11 we run on GPU and 2.13. torchtitan 0.2.2's `comm.mode =
"fake_backend"` (distributed/utils.py init_fake_mode) joins torch's fake backend at rank 0 of NGPU
for a dry run. Megatron-LM's --fake-process-group makes every collective a no-op, with routing
forced to balance (--moe-router-force-load-balancing) so shapes stay plausible. Ours is a small
Python ProcessGroup (torch's own multi_threaded_pg.py shows the pattern), registered as the
backend "mop_fake", with the data semantics above, defined the same on every torch version.

Legend: W world size, r this rank, G group size, p this rank's position in a group, M = E / E_p.
"""

from __future__ import annotations

import os
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch.futures import Future

from mop_train.ops.moe_dispatch.comm import stands_for_identical_ranks
from mop_train.ops.routing_profiles import routing_profile

BACKEND = "mop_fake"
COMM_MODE = "fake_backend"
MEANINGLESS = "losses are meaningless in this mode; memory and compute time are what it measures"


def _done(result=None):
    future = Future()
    future.set_result(result)
    return _create_work_from_future(future)


def _cycled(src: torch.Tensor, rows: int) -> torch.Tensor:
    """`rows` rows taken from src [n, ...] in order, wrapping around (zeros when src is empty)."""
    if src.shape[0] == 0:
        return src.new_zeros((rows,) + tuple(src.shape[1:]))
    if src.shape[0] == rows:
        return src
    return src[torch.arange(rows, device=src.device) % src.shape[0]]


class IdenticalRanksGroup(dist.ProcessGroup):
    """A process group of G ranks in which every peer holds this rank's data (module docstring).

    Each method has the name torch's Python process-group API calls on the torch versions we run
    (2.11 on GPU, 2.13 on CPU); where a name changed between them both are defined."""

    stands_for_identical_ranks = True

    def __init__(self, rank: int, size: int, global_ranks: list[int]):
        super().__init__(rank, size)
        self._pos, self._size, self.global_ranks = rank, size, list(global_ranks)
        self._name = ""
        self._sent: list = []      # weak references to sends not yet received
        self._waiting: list = []   # weak references to recvs no send has filled yet

    def getBackendName(self) -> str:
        return BACKEND

    def _set_group_name(self, name: str) -> None:
        self._name = name

    @property
    def group_name(self) -> str:
        """The name torch registered this group under (DeviceMesh and functional collectives use it)."""
        return self._name

    # all-gather: every slot is the local tensor
    def allgather(self, output_tensors, input_tensors, opts=None):
        for outs, inp in zip(output_tensors, input_tensors):
            for out in outs:
                out.copy_(inp)
        return _done(output_tensors)

    def all_gather_single(self, output, input, opts=None):
        if input.numel():
            output.view(self._size, -1).copy_(input.reshape(1, -1).expand(self._size, -1))
        return _done([output])

    _allgather_base = all_gather_single

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        return self.allgather(output_lists, input_list, opts)

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        for out, inp in zip(outputs, inputs):
            self.all_gather_single(out, inp)
        return _done(outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    # reductions: the local value
    def allreduce(self, tensors, opts=None):
        return _done(tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        return _done(tensors)

    def reduce(self, tensors, opts=None):
        return _done(tensors)

    def reduce_scatter(self, outputs, input_lists, opts=None):
        for out, inputs in zip(outputs, input_lists):
            out.copy_(inputs[self._pos])
        return _done(outputs)

    def reduce_scatter_single(self, output, input, opts=None):
        if output.numel():
            output.copy_(input.reshape(self._size, -1)[self._pos].view_as(output))
        return _done([output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        for out, inp in zip(outputs, inputs):
            self.reduce_scatter_single(out, inp)
        return _done(outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # all-to-all: peer s sends this rank what this rank sends itself
    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        G, p = self._size, self._pos
        out_splits = list(output_split_sizes) or [output.shape[0] // G] * G
        in_splits = list(input_split_sizes) or [input.shape[0] // G] * G
        start = sum(in_splits[:p])
        own = input[start:start + in_splits[p]]                                   # chunk p: to myself
        if all(n == own.shape[0] for n in out_splits):                            # the transpose case
            output.view((G,) + tuple(own.shape)).copy_(own.unsqueeze(0).expand((G,) + tuple(own.shape)))
        else:                                                                     # a caller's own sizes
            src = own if own.shape[0] else input
            offset = 0
            for n in out_splits:
                output[offset:offset + n].copy_(_cycled(src, n))
                offset += n
        return _done([output])

    alltoall_base = all_to_all_single

    def alltoall(self, output_tensors, input_tensors, opts=None):
        own = input_tensors[self._pos]
        for out in output_tensors:
            out.copy_(_cycled(own.reshape(own.shape[0] if own.dim() else 1, -1),
                              out.reshape(out.shape[0] if out.dim() else 1, -1).shape[0]).view_as(out))
        return _done(output_tensors)

    # the rest: the local buffers as they are
    def broadcast(self, tensors, opts=None):
        return _done(tensors)

    def barrier(self, opts=None):
        return _done()

    def monitored_barrier(self, opts=None):
        return _done()

    def gather(self, output_lists, inputs, opts=None):
        for outs, inp in zip(output_lists, inputs):
            for out in outs:
                out.copy_(inp)
        return _done(output_lists)

    def scatter(self, outputs, input_lists, opts=None):
        for out, inputs in zip(outputs, input_lists):
            if inputs:
                out.copy_(inputs[self._pos])
        return _done(outputs)

    # point to point: a recv gets what this rank sent (identical ranks: the peer sent the same)
    def send(self, tensors, dst, tag=0):
        for t in tensors:
            match = self._take(self._waiting, t)
            if match is not None:
                match.copy_(t)
            else:
                self._sent.append(weakref.ref(t))
        return _done()

    def recv(self, tensors, src, tag=0):
        for t in tensors:
            match = self._take(self._sent, t)
            if match is not None:
                t.copy_(match)
            else:
                t.zero_()
                self._waiting.append(weakref.ref(t))
        return _done(tensors)

    @staticmethod
    def _take(pending: list, like: torch.Tensor):
        """Remove and return the first live tensor in `pending` with like's shape, dtype and device
        (dropping dead references on the way), or None."""
        pending[:] = [ref for ref in pending if ref() is not None]
        for i, ref in enumerate(pending):
            t = ref()
            if t.shape == like.shape and t.dtype == like.dtype and t.device == like.device:
                del pending[i]
                return t
        return None


def _create_group(backend_opts, pg_options):
    group = IdenticalRanksGroup(backend_opts.group_rank, backend_opts.group_size,
                                list(backend_opts.global_ranks_in_group))
    group._set_group_name(backend_opts.group_id)
    return group


def register_backend() -> None:
    """Register "mop_fake" with torch.distributed (once per process)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create_group, extended_api=True, devices=["cpu", "cuda"])


def fake_world_from_env(environ=None) -> tuple[int, int]:
    """(W, r) from WORLD_SIZE and RANK; ValueError naming the variable when one is missing or
    wrong, or when a launcher (torchrun) started this process."""
    env = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" in env:
        raise ValueError(f"comm.mode = {COMM_MODE!r} runs one rank in one process without torchrun; "
                         f"start it with plain python: WORLD_SIZE=W RANK=r python -m mop_train.train ...")
    values = {}
    for name in ("WORLD_SIZE", "RANK"):
        raw = env.get(name)
        if raw is None or not raw.strip().isdigit():
            raise ValueError(f"comm.mode = {COMM_MODE!r} needs {name} set to an integer (got {raw!r}): "
                             f"WORLD_SIZE is the emulated world, RANK the rank this process runs; "
                             f"e.g. WORLD_SIZE=64 RANK=0")
        values[name] = int(raw)
    W, r = values["WORLD_SIZE"], values["RANK"]
    if W < 1 or not 0 <= r < W:
        raise ValueError(f"comm.mode = {COMM_MODE!r}: RANK ({r}) must be in [0, WORLD_SIZE = {W})")
    return W, r


def init_fake_world(world_size: int, rank: int, device: torch.device, timeout_s: float = 300) -> None:
    """Join a fake world of `world_size` ranks as `rank` (the default group is an IdenticalRanksGroup).
    On CUDA the device is made current first, so DeviceMesh keeps it."""
    register_backend()
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.cuda.init()
    dist.init_process_group(BACKEND, store=dist.HashStore(), rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))


def in_fake_world() -> bool:
    """True when the default process group is a fake world's."""
    return dist.is_initialized() and stands_for_identical_ranks(dist.group.WORLD)


def fake_world_note() -> str:
    """What every log line of a fake-world run carries."""
    return f"fake world W={dist.get_world_size()} rank {dist.get_rank()}: {MEANINGLESS}"


def profile_routing(router, profile: str, hot_offset: int):
    """A `MoE.forced_routing` callable: indices from `routing_profile(profile, N, E, k)` (hot experts
    0..h-1 moved to hot_offset.. for a skewed profile), weights from the router's own scores at
    those indices (normalised and scaled as `TopKRouter.select` does), so the gate computes and
    gets its gradient as in a real run: x [N, H] -> (indices [N, k], weights [N, k])."""
    E, k = router.num_experts, router.top_k

    def route(x: torch.Tensor):
        indices, _ = routing_profile(profile, x.shape[0], E, k, device=x.device)   # [N, k]
        if profile != "balanced":
            indices = (indices + hot_offset) % E
        weights = router.scores(x).gather(1, indices)                               # [N, k] fp32
        if router.route_norm:
            weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(1e-20)
        return indices, weights * router.route_scale
    return route


def apply_routing_profile(model, profile: str, *, expert_position: int, expert_degree: int) -> None:
    """Force every MoE layer of `model` to route by `profile`; a skewed profile's hot experts are
    the experts of expert-group position `expert_position` onward (this rank's, in a fake world)."""
    for moe in model.moe_layers():
        try:
            routing_profile(profile, 1, moe.router.num_experts, moe.router.top_k)
        except ValueError as err:
            raise ValueError(f"mop.moe.routing_profile = {profile!r}: {err}") from None
        offset = expert_position * (moe.router.num_experts // expert_degree)
        moe.forced_routing = profile_routing(moe.router, profile, offset)
