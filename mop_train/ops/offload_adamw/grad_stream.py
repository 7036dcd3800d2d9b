"""Gradients leave the device as they become final ([mop.offload_adamw] gradients = "stream").

Every parameter of an OffloadStreamAdamW gets a post-accumulate-grad hook. FSDP2 calls it itself
after each unit's reduce-scatter (on its post-reduce stream, `_fsdp_collectives.foreach_reduce`);
autograd calls it for the shards kept out of FSDP2 (experts over E_p, the projection over P) after
their AccumulateGrad. The hook copies the fp32 gradient into the optimizer's pinned host buffer
(`OffloadStreamAdamW.host_grad`) on a d2h side stream, ordered by an event after the gradient's
producer, and drops the device gradient (its memory returns to the allocator once the copy is done:
`record_stream`). Per step of M micro-batches:
  micro-batch 1:        host <- g_1;
  micro-batch k > 1:    g_k += host (copied back on an h2d side stream), host <- g_k: the running sum
                        S_k = S_{k-1} + g_k in fp32 in micro-batch order, the sum the device path
                        forms (FSDP2 and AccumulateGrad add the new gradient into the old one; IEEE
                        addition is commutative, so the bits are the same);
  micro-batch M (final): before it leaves, a block kept out of FSDP2 (one MoE layer's w1, w2, w3,
                        or the projection) is summed over its replica group, once all its
                        parameters have arrived, each parameter by its own collective in block order
                        (the device path's `reduce_replica_grads` is per parameter too), and each
                        gradient's norm term `grad_norm_term(g)` is written into a device vector: the
                        global norm (`total_grad_norm(..., terms=stream.terms())`) then needs no second
                        pass over gradients that are no longer on the device.
The clipping coefficient is handed to the optimizer (`set_scale`), which multiplies each gradient by
it after copying it back to the device, the same fp32 multiply the device path applies in place.
Nothing here waits on the host: the optimizer's update stream waits for `grads_landed`, and the
next step's first copy waits for the optimizer's `grads_read`. On a CPU-only build the same copies
run in program order into the separate host buffer. Every copy's bytes go to the optimizer's
host-link account (`opt.link`, source "gradients"; link.py).
FSDP2's own CPUOffloadPolicy moves gradients to the CPU after the reduce-scatter too, but it copies
synchronously when accumulating (and adds on the CPU), blocks the host on every copy at the end of
backward, and hands hooks a gradient already on the CPU, where the norm cannot be formed as the
device path forms it; so this is our own, at FSDP2's post-accumulate-grad seam.
FSDP2's units make the order: the head [norm, output] is reduced right after the loss's backward,
each block after its own, the token embedding in FSDP2's final callback (parallel.parallelize.apply_fsdp);
`log` keeps the order of one step's arrivals.
Legend: M micro-batches, g_k a parameter's gradient of micro-batch k, S_k their running sum.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from mop_train.ops.offload_adamw.link import host_bytes
from mop_train.ops.offload_adamw.state import local_shard


@dataclass(frozen=True)
class GradBlock:
    """Parameters whose gradients are summed over one replica group together (`replica_sum(grad)`
    sums one local gradient in place), in the order the sums run; None: final as they arrive."""

    params: tuple
    replica_sum: Callable[[torch.Tensor], None] | None = None


class GradientStream:
    """The hooks, the running sums and the norm terms of one OffloadStreamAdamW's gradients.

    Args:
        opt: an OffloadStreamAdamW built with gradients = "stream".
        blocks: GradBlocks of the parameters kept out of FSDP2 that need a replica sum; every other
            parameter is final as it arrives.
        norm_term: grad -> 0-dim fp32 term of the global norm (`sharding.grad_norm_term`).
    """

    def __init__(self, opt, blocks: list[GradBlock], norm_term: Callable[[torch.Tensor], torch.Tensor]):
        if opt.gradients != "stream":
            raise ValueError("GradientStream needs an OffloadStreamAdamW built with gradients = 'stream'")
        self.opt, self._norm_term = opt, norm_term
        self._params = opt._params
        self._index = {id(p): i for i, p in enumerate(self._params)}
        self._block_of: dict[int, int] = {}
        self._blocks = [b for b in blocks if b.replica_sum is not None]
        for b, block in enumerate(self._blocks):
            for p in block.params:
                self._block_of[self._index[id(p)]] = b
        self.cuda = opt.device.type == "cuda"
        self.h2d, self.d2h = (torch.cuda.Stream(opt.device), torch.cuda.Stream(opt.device)) if self.cuda else (None, None)
        self._sq = torch.zeros(len(self._params), dtype=torch.float32, device=opt.device)  # [n] norm terms
        self._down = [None] * len(self._params)  # event: parameter i's last copy to the host is done
        self._micro, self._count = 0, 1
        self._reset_step()
        self._handles = [p.register_post_accumulate_grad_hook(self._arrived) for p in self._params
                         if p.requires_grad]
        self.stats = {"left": 0, "partials": 0, "late": 0, "held_max": 0}

    def _reset_step(self) -> None:
        self._partial = [False] * len(self._params)  # the host buffer holds this step's running sum
        self._final = [False] * len(self._params)    # ... and it is final (norm term written)
        self._pending: dict[int, dict[int, torch.Tensor]] = {}
        self._held = 0
        self.log: list[int] = []  # optimizer index of each gradient as it arrived this step, in order

    # ---- the loop's calls ----------------------------------------------------------------------
    def begin_micro_batch(self, index: int, count: int) -> None:
        """Before micro-batch `index` (0-based) of `count` runs its backward."""
        if index == 0:
            self._reset_step()
            if self.cuda and self.opt.grads_read is not None:  # the last step has read the host buffer
                self.d2h.wait_event(self.opt.grads_read)
        self._micro, self._count = index, count

    def end_backward(self) -> None:
        """After the last micro-batch's backward: blocks that did not complete (a parameter without a
        gradient) are summed with what arrived; gradients that arrived in an earlier micro-batch only
        are made final from the host; the optimizer's step then waits for every copy."""
        for b in range(len(self._blocks)):
            if self._pending.get(b):
                self._complete(b)
        for i in range(len(self._params)):
            if self._partial[i] and not self._final[i]:
                self._late(i)
        if self.cuda:
            self.opt.grads_landed = self.d2h.record_event()

    def terms(self) -> dict[int, torch.Tensor]:
        """{id(param): its gradient's norm term} for this step's final gradients."""
        return {id(p): self._sq[i] for i, p in enumerate(self._params) if self._final[i]}

    def set_scale(self, coef: torch.Tensor | None) -> None:
        """The clipping coefficient (0-dim, device; None: no clipping) the optimizer applies."""
        self.opt.grad_scale = coef

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # ---- the hook ------------------------------------------------------------------------------
    def _arrived(self, param) -> None:
        i = self._index[id(param)]
        self.log.append(i)
        final = self._micro == self._count - 1
        grad = self._accumulated(i, local_shard(param.grad).reshape(-1))
        param.grad = None
        b = self._block_of.get(i)
        if not final or b is None:
            self._leave(i, grad, final)
            return
        self._pending.setdefault(b, {})[i] = grad  # held until the block's replica sum
        self._held += grad.numel()
        self.stats["held_max"] = max(self.stats["held_max"], self._held)
        if len(self._pending[b]) == len(self._blocks[b].params):
            self._complete(b)

    def _complete(self, b: int) -> None:
        block, grads = self._blocks[b], self._pending.pop(b)
        order = [self._index[id(p)] for p in block.params if self._index[id(p)] in grads]
        for i in order:
            block.replica_sum(grads[i])
        for i in order:
            self._held -= grads[i].numel()
            self._leave(i, grads[i], True)

    def _accumulated(self, i: int, grad: torch.Tensor) -> torch.Tensor:
        """g_k, plus the running sum of the earlier micro-batches when the host holds one."""
        if not self._partial[i]:
            return grad
        self.stats["partials"] += 1
        grad.add_(self._from_host(i, grad))  # S_{k-1} + g_k, in place in the device gradient
        return grad

    def _from_host(self, i: int, like: torch.Tensor) -> torch.Tensor:
        host = self.opt.host_grad(i)
        self.opt.link.add("gradients", h2d=host_bytes(host))
        if not self.cuda:
            return host
        current = torch.cuda.current_stream(like.device)
        staged = torch.empty_like(like)  # allocated on the current stream, written on h2d
        self.h2d.wait_stream(current)
        if self._down[i] is not None:
            self.h2d.wait_event(self._down[i])
        with torch.cuda.stream(self.h2d):
            staged.copy_(host, non_blocking=True)
        current.wait_stream(self.h2d)
        staged.record_stream(self.h2d)
        return staged

    def _leave(self, i: int, grad: torch.Tensor, final: bool) -> None:
        """The running sum goes to the host; on the final micro-batch with its norm term first."""
        if final:
            self._sq[i].copy_(self._norm_term(grad))
            self._final[i] = True
        host = self.opt.host_grad(i)
        self.opt.link.add("gradients", d2h=host_bytes(host))
        if self.cuda:
            current = torch.cuda.current_stream(grad.device)
            self.d2h.wait_stream(current)
            with torch.cuda.stream(self.d2h):
                host.copy_(grad, non_blocking=True)
            self._down[i] = self.d2h.record_event()
            grad.record_stream(self.d2h)
        else:
            host.copy_(grad)
        self._partial[i] = True
        self.opt.mark_grad(i)
        self.stats["left"] += 1

    def _late(self, i: int) -> None:
        """A gradient that arrived in an earlier micro-batch only: its sum is final now."""
        self.stats["late"] += 1
        staged = torch.empty(self.opt._numels[i], dtype=torch.float32, device=self.opt.device)
        staged.copy_(self._from_host(i, staged))
        b = self._block_of.get(i)
        if b is not None:
            self._blocks[b].replica_sum(staged)
        self._leave(i, staged, True)
