"""All-to-all helpers shared by the expert-parallel dispatch schedules.

Routes travel between the ranks of the expert group with `all_to_all_single` and uneven splits. The
autograd functions here are split in two halves so a schedule can launch an exchange, run other
work, and wait for it later (that is how PipelinedLLEP overlaps the dispatch of chunk i+1 with the
expert matmul of chunk i):

    ticket = Ticket()
    bufs = AllToAllStart.apply(ticket, send_splits, recv_splits, group, *tensors)  # launched
    ...                                                                           # other work
    outs = AllToAllWait.apply(ticket, *bufs)                                      # ready

Backward is the inverse exchange (splits swapped), pipelined the same way: AllToAllWait's backward
launches it and AllToAllStart's backward collects it, so the backward of whatever ran between the
two halves in forward overlaps it. `all_to_all` does both halves at once. In a single-rank group
(None or size 1) every exchange is the identity. Every tensor in one exchange shares the same row
splits (rows, routing weights, ...).

Legend: P expert-group size, R routes (rows) sent, R' routes received.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist


def group_size(group) -> int:
    """Ranks in `group`; None means a single-rank group (no communication)."""
    return 1 if group is None else dist.get_world_size(group)


def stands_for_identical_ranks(group) -> bool:
    """True when `group` is a fake world's (`--comm.mode fake_backend`, mop_train.parallel.fake_world):
    one process stands for every rank, each peer taken to hold this rank's data. A schedule whose
    receive sizes depend on the sender's rank computes them itself then (the exchange can only
    return this rank's own counts)."""
    return bool(getattr(group, "stands_for_identical_ranks", False))


def group_rank(group) -> int:
    """This rank's index in `group`; 0 for None."""
    return 0 if group is None else dist.get_rank(group)


def host_to_device(t: torch.Tensor, device) -> torch.Tensor:
    """Copy a small host tensor (counts, offsets, ids) to `device` without a host sync: a blocking
    host-to-device copy waits for the whole stream; a pinned non-blocking one is only queued."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class Ticket:
    """Links the two halves of one exchange: the pending forward work, and the exchange's reverse
    (launched by AllToAllWait's backward, collected by AllToAllStart's backward)."""

    def __init__(self):
        self.works = []
        self.sent = []      # send buffers stay referenced until the exchange has completed
        self.route = None   # (send_splits, recv_splits, group, received meta) of the forward exchange
        self.reverse = None  # (Ticket, buffers) of the launched backward exchange

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works, self.sent = [], []


def _launch(tensors, send_splits, recv_splits, group, ticket: Ticket):
    """Start one all-to-all per tensor; returns the (not yet filled) receive buffers."""
    if group_size(group) == 1:          # nothing to exchange: the rows stay here
        return [t.contiguous() for t in tensors]
    outs = []
    for t in tensors:
        t = t.contiguous()
        ticket.sent.append(t)
        out = t.new_empty((sum(recv_splits),) + tuple(t.shape[1:]))
        ticket.works.append(dist.all_to_all_single(out, t, list(recv_splits), list(send_splits),
                                                   group=group, async_op=True))
        outs.append(out)
    return outs


def _launch_reverse(ticket: Ticket, grads) -> None:
    """Send the grads of the received rows back to their sources (splits swapped)."""
    send_splits, recv_splits, group, meta = ticket.route
    # A received tensor whose gradient is unused is still answered (zeros): every rank issues the
    # same exchanges.
    grads = [g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
             for g, (shape, dtype, device) in zip(grads, meta)]
    back = Ticket()
    ticket.reverse = (back, _launch(grads, recv_splits, send_splits, group, back))


class AllToAllStart(torch.autograd.Function):
    """Launch the exchange of `tensors` (rows split by `send_splits`); backward returns the grads
    that AllToAllWait's backward sent back (or sends them itself)."""

    @staticmethod
    def forward(ctx, ticket, send_splits, recv_splits, group, *tensors):
        outs = _launch(tensors, send_splits, recv_splits, group, ticket)
        ticket.route = (list(send_splits), list(recv_splits), group,
                        [(o.shape, o.dtype, o.device) for o in outs])
        ctx.ticket = ticket
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        ticket = ctx.ticket
        if ticket.reverse is None:
            _launch_reverse(ticket, grads)
        back, outs = ticket.reverse
        ticket.reverse = None
        back.wait()
        return (None, None, None, None, *outs)


class AllToAllWait(torch.autograd.Function):
    """Block until the exchange held by `ticket` has landed; identity for autograd, except that its
    backward already launches the reverse exchange, so it overlaps whatever backward runs before
    AllToAllStart's backward collects it (the backward mirror of the forward pipeline)."""

    @staticmethod
    def forward(ctx, ticket, *bufs):
        ticket.wait()
        ctx.ticket = ticket
        return bufs

    @staticmethod
    def backward(ctx, *grads):
        if ctx.ticket.route is not None:
            _launch_reverse(ctx.ticket, grads)
        return (None, *grads)


def all_to_all(tensors: Sequence[torch.Tensor], send_splits: Sequence[int],
               recv_splits: Sequence[int], group) -> tuple:
    """Differentiable all-to-all of several row-aligned tensors [R, ...] -> [R', ...]."""
    ticket = Ticket()
    bufs = AllToAllStart.apply(ticket, send_splits, recv_splits, group, *tensors)
    return AllToAllWait.apply(ticket, *bufs)


def exchange_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """counts [P, ...] int64, row g meant for rank g -> [P, ...], row s sent by rank s (no grad)."""
    if group_size(group) == 1:
        return counts.clone()
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out


def all_gather_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """counts [...] int64 on each rank -> [P, ...] stacked in group-rank order (no grad)."""
    if group_size(group) == 1:
        return counts.unsqueeze(0).clone()
    parts = [torch.empty_like(counts) for _ in range(group_size(group))]
    dist.all_gather(parts, counts.contiguous(), group=group)
    return torch.stack(parts)
