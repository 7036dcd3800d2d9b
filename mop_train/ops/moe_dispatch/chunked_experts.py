"""One chunk's expert compute for PipelinedLLEP, with the weight gradients summed once per layer.

`ChunkExperts` runs a chunk's weighted SwiGLU over its slots (native experts, then migrated copies)
and saves only its inputs: rows, routing weights and the expert weights; the [R', I] activations
are recomputed in backward, as a reentrant checkpoint would. Its backward returns the grads of the
rows and routing weights but no weight grads: each expert's dW over the rows this chunk gave it is
added into one per-layer `ExpertGradSum`: on CUDA (bf16, sm90+) one torch._grouped_mm per weight
computes every expert's dW of the chunk and one add_ accumulates it (one weight-sized temporary at a
time); elsewhere mm into an expert's slice the first time, addmm_ afterwards, in place. Nothing of
the weights' size is kept per chunk or summed by autograd K times.
Inside an activation-checkpointed block the block's recompute re-runs the layer's forward to refill
its saved tensors; `ChunkExperts` then saves its inputs and skips its GEMMs (its output is not
needed), so per chunk the expert GEMMs run once in the forward and once in the backward (h1, h3
recomputed there), never a third time.
The layer's `MigrateExperts` node (llep.py) is upstream of every chunk (each takes its zero anchor
as input), so autograd runs it after the last chunk; it hands the sums back once, with the migrated copies' grads already added to their owners. The token rows each chunk
gathers from x are handled the same way (`GatherTokens` adds each token's summed row gradients into
one [N, H] sum that `TokenSource` returns), instead of one [N, H] gradient per chunk. Per chunk, with
h1 = x W1^T, h3 = x W3^T, a = silu(h1) * h3, out = (a W2^T) * r and g the grad of out:
    g2 = g W2;  dr = sum_I g2 * a;  da = g2 * r;  dh3 = da * silu(h1);  dh1 = silu'(h1) * da * h3
    dx = dh1 W1 + dh3 W3;   dW1[e] += dh1_e^T x_e;  dW3[e] += dh3_e^T x_e;  dW2[e] += (g r)_e^T a_e
Paper: section 3.1, Appendix B.1.

Legend: N tokens, R' rows received by this rank in one chunk, H hidden, I expert hidden width, M native
experts, F migrated (foreign) copies on this rank, E = M or F experts of one stack, r routing weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mop_train.ops.moe_dispatch.combine import sum_slots
from mop_train.ops.moe_dispatch.comm import host_to_device
from mop_train.ops.moe_dispatch.ep import weighted_experts
from mop_train.ops.moe_dispatch.local import group_offsets, grouped_mm


def in_backward() -> bool:
    """True while autograd runs a backward pass, which is where an activation checkpoint around the
    layer recomputes it (the same test as mop_train.models.moe's, and FSDP2's)."""
    return torch._C._current_graph_task_id() != -1


class ExpertGradSum:
    """The per-layer sum of one expert stack's w1/w2/w3 gradients, accumulated in place.

    Nothing is allocated until a chunk contributes; experts no chunk reached read as zeros.
    `grouped`: None picks torch._grouped_mm for the chunk's dW on CUDA where `grouped_mm` uses it
    (bf16, sm90+, aligned), the per-expert in-place addmm_ otherwise; True/False forces one."""

    def __init__(self, num_experts: int, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
                 grouped: bool | None = None):
        self.meta = [((num_experts,) + tuple(w.shape[1:]), w.dtype, w.device) for w in (w1, w2, w3)]
        self.grouped = grouped
        self.bufs = None
        self.touched = None

    def add(self, x, groups, counts, dh1, go, a, dh3) -> None:
        """dW1[e] += dh1_e^T x_e, dW2[e] += go_e^T a_e, dW3[e] += dh3_e^T x_e over row blocks.

        x, go [R, H]; dh1, dh3, a [R, I]; groups: `group_offsets` of counts; counts [E] (CPU, or the
        device's when the grouped GEMM runs)."""
        grouped = self.grouped
        if grouped is None:
            grouped = groups.dtype == torch.int32 and x.device.type == "cuda"
        pairs = ((dh1, x), (go, a), (dh3, x))
        if grouped:
            self._add_grouped(pairs, groups, counts)
        else:
            self._add_per_expert(pairs, counts)

    def _add_grouped(self, pairs, groups, counts) -> None:
        """One grouped GEMM per weight for all experts of the chunk (left^T @ right, grouped along
        the rows), then one in-place add: 3 GEMM launches + 3 adds per chunk, not 3 per expert."""
        if groups.dtype != torch.int32:
            groups = torch.cumsum(counts, 0).to(torch.int32).to(pairs[0][0].device)
        # a mask, not a list of ids: the counts may be on the device (group size one), never read back
        idle = (host_to_device(counts, groups.device) if counts.device != groups.device else counts) == 0
        first = self.bufs is None
        if first:
            self.bufs = [None] * 3
        elif self.touched is not None:                                    # after per-expert adds
            self.bufs = self.take()
        for j, (left, right) in enumerate(pairs):
            dw = torch._grouped_mm(left.t(), right, offs=groups)          # [E, I, H] or [E, H, I]
            dw.masked_fill_(idle.view(-1, 1, 1), 0)                       # empty groups: exact zeros
            if first:
                self.bufs[j] = dw.to(self.meta[j][1])
            else:
                self.bufs[j].add_(dw)
            del dw
        self.touched = None                                               # every expert written

    def _add_per_expert(self, pairs, counts) -> None:
        if self.bufs is None:
            self.bufs = [torch.empty(s, dtype=d, device=dev) for s, d, dev in self.meta]
            self.touched = [False] * self.meta[0][0][0]
        sizes = counts.tolist()
        splits = [(left.split(sizes), right.split(sizes)) for left, right in pairs]
        views = [b.unbind(0) for b in self.bufs]                          # per-expert views
        for e, n in enumerate(sizes):
            if not n:
                continue
            fresh = self.touched is not None and not self.touched[e]
            for buf, (lefts, rights) in zip(views, splits):
                if fresh:
                    torch.mm(lefts[e].t(), rights[e], out=buf[e])
                else:
                    buf[e].addmm_(lefts[e].t(), rights[e])
            if self.touched is not None:
                self.touched[e] = True

    def take(self) -> list[torch.Tensor]:
        """The three sums [E, ...]; resets, so a second backward (retain_graph) starts from zero."""
        if self.bufs is None:
            return [torch.zeros(s, dtype=d, device=dev) for s, d, dev in self.meta]
        idle = [e for e, t in enumerate(self.touched) if not t] if self.touched is not None else []
        bufs, self.bufs, self.touched = self.bufs, None, None
        if idle:
            idle = host_to_device(torch.tensor(idle, dtype=torch.int64), bufs[0].device)
            for b in bufs:
                b.index_fill_(0, idle, 0)
        return bufs


def slot_swiglu(rows, route_w, slot_counts, w1, w2, w3, f1, f2, f3, num_native: int):
    """Weighted SwiGLU over slots: native experts (w*) first, then the foreign copies (f*).

    rows [R', H] sorted by slot, route_w [R'], slot_counts [M + F] (CPU) -> [R', H]."""
    if f1.shape[0] == 0:
        return weighted_experts(rows, route_w, slot_counts, w1, w2, w3)
    n = int(slot_counts[:num_native].sum())
    native = weighted_experts(rows[:n], route_w[:n], slot_counts[:num_native], w1, w2, w3)
    foreign = weighted_experts(rows[n:], route_w[n:], slot_counts[num_native:], f1, f2, f3)
    return torch.cat([native, foreign])


def _stack_backward(x, r, counts, w1, w2, w3, grad, grad_sum: ExpertGradSum | None):
    """Backward of weighted_experts on one stack by recomputation (module doc).

    x, grad [R, H]; r [R]; counts [E] (CPU). Returns (dx [R, H], dr [R]); adds dW into grad_sum."""
    groups = group_offsets(x, counts, w1)
    h1 = grouped_mm(x, groups, w1, transpose=True)                 # [R, I]
    h3 = grouped_mm(x, groups, w3, transpose=True)                 # [R, I]
    g2 = grouped_mm(grad, groups, w2, transpose=False)             # [R, I]
    s = F.silu(h1)
    a = s * h3
    rr = r.unsqueeze(1).to(grad.dtype)                             # [R, 1]
    dr = (g2 * a).sum(1).to(r.dtype)
    da = g2 * rr
    del g2
    dh3 = da * s
    dh1 = torch.ops.aten.silu_backward(da * h3, h1)
    del da, h3, h1, s
    dx = grouped_mm(dh1, groups, w1, transpose=False) + grouped_mm(dh3, groups, w3, transpose=False)
    if grad_sum is not None:
        grad_sum.add(x, groups, counts, dh1, grad * rr, a, dh3)
    return dx, dr


class ChunkExperts(torch.autograd.Function):
    """slot_swiglu for one chunk; backward recomputes it and adds the weight grads into `sums`.

    Inputs after the non-tensor ones: anchor (the layer's zero scalar from MigrateExperts; its grad
    here is zero, it only orders the layer node after every chunk), rows [R', H], route_w [R'],
    w1, w3 [M, I, H], w2 [M, H, I], f1, f3 [F, I, H], f2 [F, H, I]. Returns [R', H]."""

    @staticmethod
    def forward(ctx, sums, slot_counts, num_native, anchor, rows, route_w, w1, w2, w3, f1, f2, f3):
        ctx.sums, ctx.slot_counts, ctx.num_native = sums, slot_counts, num_native
        ctx.anchor_dtype = anchor.dtype
        ctx.save_for_backward(rows, route_w, w1, w2, w3, f1, f2, f3)
        if in_backward():
            # The block's activation checkpoint is recomputing to refill its saved tensors: of this
            # chunk it needs only the inputs saved above (backward recomputes the rest), so the
            # expert GEMMs are skipped. The output is NaN: nothing downstream in the checkpointed
            # region may save it (true of the MoE block: combine, sums and the residual save no
            # activation), and if something did, its gradient would turn NaN, not silently wrong.
            return rows.new_full((rows.shape[0], w2.shape[1]), float("nan"))
        return slot_swiglu(rows, route_w, slot_counts, w1, w2, w3, f1, f2, f3, num_native)

    @staticmethod
    def backward(ctx, grad):
        rows, route_w, w1, w2, w3, f1, f2, f3 = ctx.saved_tensors
        M, counts = ctx.num_native, ctx.slot_counts
        sums = ctx.sums if any(ctx.needs_input_grad[6:]) else (None, None)
        grad = grad.contiguous()
        n = rows.shape[0] if f1.shape[0] == 0 else int(counts[:M].sum())   # (no read without foreign slots)
        stacks = ((slice(0, n), counts[:M], (w1, w2, w3), sums[0]),
                  (slice(n, rows.shape[0]), counts[M:], (f1, f2, f3), sums[1]))
        parts = [_stack_backward(rows[s], route_w[s], stack_counts, *ws, grad[s], grad_sum)
                 for s, stack_counts, ws, grad_sum in stacks if s.stop > s.start]
        if len(parts) == 1:
            dx, dr = parts[0]
        else:                                   # both stacks, or no rows at all
            dx = torch.cat([p[0] for p in parts]) if parts else torch.zeros_like(rows)
            dr = torch.cat([p[1] for p in parts]) if parts else torch.zeros_like(route_w)
        anchor_grad = torch.zeros((), dtype=ctx.anchor_dtype, device=grad.device)
        return (None, None, None, anchor_grad, dx, dr) + (None,) * 6


class TokenGradSum:
    """The per-layer sum of the gradients of the token rows the chunks gathered from x [N, H]."""

    def __init__(self, x: torch.Tensor):
        self.meta, self.buf = (x.shape, x.dtype, x.device), None

    def add(self, tokens: slice, grad: torch.Tensor) -> None:
        """Rows `tokens` of the sum += grad [n, H] (one chunk's tokens, each once: no index, no atomics)."""
        if self.buf is None:
            shape, dtype, device = self.meta
            self.buf = torch.zeros(shape, dtype=dtype, device=device)
        self.buf[tokens].add_(grad)

    def take(self) -> torch.Tensor:
        buf, self.buf = self.buf, None
        if buf is None:
            shape, dtype, device = self.meta
            buf = torch.zeros(shape, dtype=dtype, device=device)
        return buf


class TokenSource(torch.autograd.Function):
    """x -> a zero scalar anchor that every GatherTokens takes; its backward, run after the last
    chunk's, returns the summed gradient of x once."""

    @staticmethod
    def forward(ctx, sums: TokenGradSum, x):
        ctx.sums = sums
        return x.new_zeros(())

    @staticmethod
    def backward(ctx, grad):
        return None, ctx.sums.take()


class GatherTokens(torch.autograd.Function):
    """x[ids] -> [R_i, H] for one chunk, whose tokens (the slice `tokens` of x's rows) hold all k of their
    routes; backward sums each token's k row gradients (`slots` [n, k]: the rows of token t, combine.py's
    segment sum) and adds them into `sums` instead of returning a gradient of x's size."""

    @staticmethod
    def forward(ctx, sums: TokenGradSum, anchor, x, ids, tokens: slice, slots):
        ctx.sums, ctx.anchor_dtype, ctx.tokens = sums, anchor.dtype, tokens
        ctx.save_for_backward(slots)
        return x.index_select(0, ids)

    @staticmethod
    def backward(ctx, grad):
        (slots,) = ctx.saved_tensors
        ctx.sums.add(ctx.tokens, sum_slots(grad, slots))
        return None, torch.zeros((), dtype=ctx.anchor_dtype, device=grad.device), None, None, None, None
