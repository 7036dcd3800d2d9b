"""`mop-train plan`: the per-rank device and host memory plan of a job, before anything launches.

    mop-train plan --world 64 --ranks-per-node 8 --gpu-memory 141GiB --host-memory 2TiB \
        configs/mop_667b.toml --training.seq_len 1048576

Builds the model on the meta device (no process group, no GPU), applies the job's layout on paper
(D, E_p, P against W), and prints the same plan `mop_train.train` prints at launch, term by term:
this rank's share of the weights (dense / W, routed experts / E_p, the projection / P), its gradients
and optimizer state, checkpoint boundaries less SCO's host budget, kept attention, one block's
activations, the loss chunk; then the pinned host memory of the node's ranks. Exits 1 with the
numbers when either does not fit. An estimate: operator working sets are rough terms (see
mop_train.train.plan), not the operators' own bounds yet.
"""

from __future__ import annotations

from mop_train.train.plan import GIB, format_plan


def local_param_count(model, layout_plan, *, dispatch: str) -> int:
    """This rank's parameters under the layout: FSDP2 shards the dense weights over W, the routed
    experts are sharded over E_p (unless dispatch = "local"), the output projection over P (P > 1)."""
    W, Ep, P = layout_plan.world_size, layout_plan.expert_degree, layout_plan.vocab_degree
    routed = sum(p.numel() for moe in model.moe_layers() for p in moe.experts.parameters())
    projection = model.output.weight.numel()
    total = sum(p.numel() for p in model.parameters())
    dense = total - (routed if dispatch != "local" else 0) - (projection if P > 1 else 0)
    return (-(-dense // W) + (-(-routed // Ep) if dispatch != "local" else 0)
            + (-(-projection // P) if P > 1 else 0))


def plan_job(cfg, *, world: int, ranks_per_node: int, gpu_bytes: int | None, host_bytes: int | None) -> tuple[str, bool]:
    """(the printed plan, whether it fits) for `cfg` on `world` ranks."""
    import torch

    from mop_train.layout import plan_layout
    from mop_train.models import zoo
    from mop_train.models.model import MoETransformer
    from mop_train.ops.sco import resolve_host_budget
    from mop_train.parallel.precision import MixedPrecision
    from mop_train.train.job_plan import fsdp_block_params, memory_plans
    from mop_train.train.parallelize import _checkpointed_layer_ids, check_layout_fits, check_titan_parallelism

    lay, t = cfg.mop.layout, cfg.training
    layout = plan_layout(world, lay.seq_degree, lay.expert_degree, lay.vocab_degree)
    args = zoo.get_model_args(cfg.model.flavor)
    check_layout_fits(layout, t, args)
    micro = check_titan_parallelism(cfg.parallelism, t, data_size=world // lay.seq_degree)
    with torch.device("meta"):
        model = MoETransformer(args)
    routed = {id(p) for moe in model.moe_layers() for p in moe.experts.parameters()}
    kept_out = routed if cfg.mop.moe.dispatch != "local" else set()   # expert shards stay out of FSDP2
    precision = MixedPrecision.from_training(t)
    sco_budget = 0 if cfg.mop.sco.host_budget.strip() == "0" else resolve_host_budget(
        cfg.mop.sco.host_budget, ranks_per_node, available_bytes=host_bytes)
    mine = local_param_count(model, layout, dispatch=cfg.mop.moe.dispatch)
    device_terms, host_terms = memory_plans(
        cfg, world=world, total_params=sum(p.numel() for p in model.parameters()),
        largest_block_params=max(fsdp_block_params(b, kept_out) for b in model.layers.values()),
        checkpointed_layers=len(_checkpointed_layer_ids(cfg.activation_checkpoint, args.n_layers)),
        local_params=mine, sco_host_budget=sco_budget, precision=precision)
    device_total, host_total = sum(b for _, b, _ in device_terms), sum(b for _, b, _ in host_terms)
    lines = [layout.describe().splitlines()[0],
             f"model {cfg.model.flavor}: {sum(p.numel() for p in model.parameters()):,} parameters, "
             f"{mine:,} on each rank; B={t.local_batch_size} x S={t.seq_len} per sequence group, "
             f"{micro} micro-batch(es) per step, {precision.param_dtype} compute",
             format_plan(device_terms), format_plan(host_terms, title="per-rank pinned host memory")]
    fits = True
    if gpu_bytes is not None:
        ok = device_total <= gpu_bytes
        fits &= ok
        lines.append(f"device: {device_total / GIB:.1f} GiB of {gpu_bytes / GIB:.1f} GiB per rank: "
                     + ("fits" if ok else "DOES NOT FIT"))
    if host_bytes is not None:
        need = host_total * ranks_per_node
        ok = need <= host_bytes
        fits &= ok
        lines.append(f"host: {ranks_per_node} ranks x {host_total / GIB:.1f} GiB = {need / GIB:.1f} GiB of "
                     f"{host_bytes / GIB:.1f} GiB per node: " + ("fits" if ok else "DOES NOT FIT"))
    return "\n".join(lines), fits
