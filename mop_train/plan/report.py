"""`mop-train plan`: the per-rank device and host memory plan of a job, before anything launches.

    mop-train plan --world 64 --ranks-per-node 8 --gpu-memory 141GiB --host-memory 2TiB \
        configs/mop_667b.toml --training.seq_len 1048576

Builds the model on the meta device (no process group, no GPU), applies the job's layout on paper
(D, E_p, P against W; mop_train.plan.job), and prints the same plan `mop_train.train` prints at
launch, term by term: this rank's share of the weights (dense / W, routed experts / E_p, the
projection / P), its gradients and optimizer state, checkpoint boundaries less SCO's host budget,
kept attention, one block's activations, the loss's working set; then the pinned host memory of
the node's ranks. The caller exits 1 when either does not fit. An estimate: each operator's line is
its own bound (mop_train.ops.bound), the model's lines what its modules save (mop_train.models.memory).
"""

from __future__ import annotations

from mop_train.plan.job import plan_for_config
from mop_train.plan.terms import GIB, format_plan, host_memory_fix


def plan_job(cfg, *, world: int, ranks_per_node: int, gpu_bytes: int | None, host_bytes: int | None) -> tuple[str, bool]:
    """(the printed plan, whether it fits) for `cfg` on `world` ranks."""
    plan = plan_for_config(cfg, world=world, ranks_per_node=ranks_per_node, host_bytes=host_bytes)
    t = cfg.training
    lines = [plan.layout.describe().splitlines()[0],
             f"model {cfg.model.flavor}: {plan.total_params:,} parameters, "
             f"{plan.local_params:,} on each rank; B={t.local_batch_size} x S={t.seq_len} per sequence group, "
             f"{plan.micro_batches} micro-batch(es) per step, {plan.compute_dtype} compute",
             format_plan(plan.device_terms), format_plan(plan.host_terms, title="per-rank pinned host memory")]
    fits = True
    if gpu_bytes is not None:
        ok = plan.device_bytes <= gpu_bytes
        fits &= ok
        lines.append(f"device: {plan.device_bytes / GIB:.1f} GiB of {gpu_bytes / GIB:.1f} GiB per rank: "
                     + ("fits" if ok else "DOES NOT FIT"))
    if host_bytes is not None:
        need = plan.host_bytes_per_node
        ok = need <= host_bytes
        fits &= ok
        lines.append(f"host: {ranks_per_node} ranks x {need / ranks_per_node / GIB:.1f} GiB = {need / GIB:.1f} GiB of "
                     f"{host_bytes / GIB:.1f} GiB per node: " + ("fits" if ok else "DOES NOT FIT: " + host_memory_fix(
                         plan.host_terms, local_ranks=ranks_per_node, available_bytes=host_bytes)))
    return "\n".join(lines), fits
