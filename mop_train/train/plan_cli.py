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

from dataclasses import dataclass

from mop_train.layout import LayoutPlan
from mop_train.train.plan import GIB, format_plan


def kept_out_of_fsdp(model, layout_plan, *, dispatch: str) -> tuple[list, list]:
    """(routed expert weights, the output projection) that a MoP group shards instead of FSDP2:
    the experts over E_p unless dispatch = "local", the projection over P when P > 1."""
    routed = [p for moe in model.moe_layers() for p in moe.experts.parameters()] if dispatch != "local" else []
    return routed, [model.output.weight] if layout_plan.vocab_degree > 1 else []


def local_param_count(model, layout_plan, *, dispatch: str) -> int:
    """This rank's parameters under the layout: FSDP2 shards the dense weights over W, the routed
    experts are sharded over E_p (unless dispatch = "local"), the output projection over P (P > 1)."""
    routed, projection = (sum(p.numel() for p in ps)
                          for ps in kept_out_of_fsdp(model, layout_plan, dispatch=dispatch))
    dense = sum(p.numel() for p in model.parameters()) - routed - projection
    return (-(-dense // layout_plan.world_size) + -(-routed // layout_plan.expert_degree)
            + -(-projection // layout_plan.vocab_degree))


@dataclass(frozen=True)
class JobPlan:
    """One rank's plan for a job on `world` ranks: device and host terms (name, bytes, formula)."""
    layout: LayoutPlan
    total_params: int
    local_params: int
    micro_batches: int
    compute_dtype: str
    ranks_per_node: int
    device_terms: list[tuple[str, int, str]]
    host_terms: list[tuple[str, int, str]]

    @property
    def device_bytes(self) -> int:
        return sum(b for _, b, _ in self.device_terms)

    @property
    def host_bytes_per_node(self) -> int:
        return sum(b for _, b, _ in self.host_terms) * self.ranks_per_node


def local_root_params(model, layout_plan) -> int:
    """This rank's share of the parameters outside the blocks: FSDP2 shards them over W, except the
    projection, which is sharded over P when P > 1."""
    from mop_train.train.job_plan import root_unit_params

    projection = model.output.weight.numel() if layout_plan.vocab_degree > 1 else 0
    rest = sum(p.numel() for p in root_unit_params(model)) - projection
    return -(-rest // layout_plan.world_size) + -(-projection // layout_plan.vocab_degree)


def plan_for_config(cfg, *, world: int, ranks_per_node: int, host_bytes: int | None = None) -> JobPlan:
    """The job's plan on paper: a meta model under the layout, no process group, no GPU. Raises
    ValueError (with the fix) when the layout or batch do not fit the model. `host_bytes` (per
    node) sizes SCO's "auto" budget."""
    import torch

    from mop_train.layout import plan_layout
    from mop_train.models import zoo
    from mop_train.models.model import MoETransformer
    from mop_train.ops.sco import resolve_host_budget
    from mop_train.parallel.parallelize import check_layout_fits, check_titan_parallelism
    from mop_train.parallel.parallelize import checkpointed_layer_ids as _checkpointed_layer_ids
    from mop_train.parallel.precision import MixedPrecision
    from mop_train.train.job_plan import fsdp_block_params, fsdp_root_params, memory_plans

    lay, t = cfg.mop.layout, cfg.training
    layout = plan_layout(world, lay.seq_degree, lay.expert_degree, lay.vocab_degree)
    args = zoo.get_model_args(cfg.model.flavor)
    check_layout_fits(layout, t, args)
    micro = check_titan_parallelism(cfg.parallelism, t, data_size=world // lay.seq_degree)
    with torch.device("meta"):
        model = MoETransformer(args)
    routed, projection = kept_out_of_fsdp(model, layout, dispatch=cfg.mop.moe.dispatch)
    kept_out = {id(p) for p in routed + projection}                   # sharded by a MoP group, not FSDP2
    precision = MixedPrecision.from_training(t)
    sco_budget = 0 if cfg.mop.sco.host_budget.strip() == "0" else resolve_host_budget(
        cfg.mop.sco.host_budget, ranks_per_node, available_bytes=host_bytes)
    mine = local_param_count(model, layout, dispatch=cfg.mop.moe.dispatch)
    total = sum(p.numel() for p in model.parameters())
    device_terms, host_terms = memory_plans(
        cfg, args, layout_plan=layout, total_params=total,
        largest_block_params=max(fsdp_block_params(b, kept_out) for b in model.layers.values()),
        root_params=fsdp_root_params(model, kept_out),
        first_grad_params=local_root_params(model, layout),
        checkpointed_layers=len(_checkpointed_layer_ids(cfg.activation_checkpoint, args.n_layers)),
        local_params=mine, sco_host_budget=sco_budget, precision=precision)
    return JobPlan(layout, total, mine, micro, str(precision.param_dtype).removeprefix("torch."),
                   ranks_per_node, device_terms, host_terms)


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
                     f"{host_bytes / GIB:.1f} GiB per node: " + ("fits" if ok else "DOES NOT FIT"))
    return "\n".join(lines), fits
