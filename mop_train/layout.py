"""The MoP rank layout: overlapping sequence, expert and vocab sub-groups over one world of W ranks.

Three degrees are chosen independently, each dividing W:
  D   (seq_degree)    ranks that share one sequence and trade it for heads (Ulysses all-to-all);
  E_p (expert_degree) ranks holding disjoint expert shards (rank j of a group owns expert shard j);
  P   (vocab_degree)  ranks holding disjoint vocabulary intervals of the output projection.
The groups are views of the same W ranks, not factors of W = D * E_p * P: every rank belongs to
exactly one group of each kind. Dense weights are sharded FSDP2-style over all W ranks.

Placement: every kind is a contiguous block of ranks (group g of degree X is ranks
[g*X, (g+1)*X)). Sequence and vocab groups want the fast intra-node links, so with at most
ranks-per-node ranks they stay on one node. Expert groups are contiguous too; when E_p < W the
W / E_p ranks that hold the same expert shard (same position in their expert groups) form an
`expert_replica_group`, over which expert gradients are averaged.

Data: the W / D sequence groups each consume distinct sequences; a rank's tokens are
local_batch * seq_len / D positions of its group's sequences, distinct from every other rank's.

`plan_layout` is pure Python (no process groups); `RankLayout.build` creates the groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

KINDS = ("seq", "expert", "vocab")


def divisors(n: int) -> list[int]:
    """Positive divisors of n, ascending (the valid degrees for a world, head or expert count of n)."""
    return [d for d in range(1, n + 1) if n % d == 0]


def _blocks(world_size: int, degree: int) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(range(g * degree, (g + 1) * degree)) for g in range(world_size // degree))


@dataclass(frozen=True)
class LayoutPlan:
    """Which ranks form which group; a pure description, identical on every rank."""

    world_size: int
    seq_degree: int
    expert_degree: int
    vocab_degree: int

    def __post_init__(self):
        W = self.world_size
        if not isinstance(W, int) or W < 1:
            raise ValueError(f"world_size ({W!r}) must be an integer >= 1")
        for kind, degree in zip(KINDS, (self.seq_degree, self.expert_degree, self.vocab_degree)):
            if not isinstance(degree, int) or degree < 1 or W % degree:
                raise ValueError(
                    f"{kind}_degree ({degree!r}) must be a positive divisor of the world size ({W}); "
                    f"valid values: {divisors(W)}")

    def degree(self, kind: str) -> int:
        return {"seq": self.seq_degree, "expert": self.expert_degree, "vocab": self.vocab_degree}[kind]

    def groups(self, kind: str) -> tuple[tuple[int, ...], ...]:
        """All groups of `kind` ("seq", "expert", "vocab"), each a tuple of global ranks."""
        if kind not in KINDS:
            raise ValueError(f"unknown group kind {kind!r}; expected one of {KINDS}")
        return _blocks(self.world_size, self.degree(kind))

    @property
    def seq_groups(self):
        return self.groups("seq")

    @property
    def expert_groups(self):
        return self.groups("expert")

    @property
    def vocab_groups(self):
        return self.groups("vocab")

    @property
    def expert_replica_groups(self) -> tuple[tuple[int, ...], ...]:
        """Ranks holding the same expert shard: position j in every expert group."""
        Ep, W = self.expert_degree, self.world_size
        return tuple(tuple(range(j, W, Ep)) for j in range(Ep))

    @property
    def vocab_replica_groups(self) -> tuple[tuple[int, ...], ...]:
        """Ranks holding the same vocab interval: position j in every vocab group."""
        P, W = self.vocab_degree, self.world_size
        return tuple(tuple(range(j, W, P)) for j in range(P))

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank ({rank}) must be in [0, {self.world_size})")

    def group_index(self, kind: str, rank: int) -> int:
        """Which group of `kind` holds `rank`."""
        self._check_rank(rank)
        return rank // self.degree(kind)

    def group_rank(self, kind: str, rank: int) -> int:
        """Position of `rank` inside its group of `kind`."""
        self._check_rank(rank)
        return rank % self.degree(kind)

    def group_of(self, kind: str, rank: int) -> tuple[int, ...]:
        return self.groups(kind)[self.group_index(kind, rank)]

    @property
    def num_sequence_groups(self) -> int:
        """W / D: how many distinct sequences (per local-batch row) one step consumes."""
        return self.world_size // self.seq_degree

    def describe(self) -> str:
        """A readable table: degrees, placement policy, and each rank's groups."""
        W, D, Ep, P = self.world_size, self.seq_degree, self.expert_degree, self.vocab_degree
        lines = [
            f"MoP layout: W={W} ranks | seq D={D} ({W // D} groups) | expert E_p={Ep} ({W // Ep} groups) "
            f"| vocab P={P} ({W // P} groups)",
            "placement: every group is a contiguous rank block; seq and vocab groups stay inside a node "
            "when their degree <= ranks per node; dense weights FSDP2-sharded over all W ranks",
            f"data: {W // D} sequence groups consume distinct sequences; expert shards replicated "
            f"{W // Ep}x (replica groups: position j of every expert group)",
            "",
            f"{'rank':>5} | {'seq grp':>7} {'pos':>4} | {'expert grp':>10} {'shard':>5} | {'vocab grp':>9} {'pos':>4}",
            "-" * 60,
        ]
        for r in range(W):
            lines.append(
                f"{r:>5} | {self.group_index('seq', r):>7} {self.group_rank('seq', r):>4} | "
                f"{self.group_index('expert', r):>10} {self.group_rank('expert', r):>5} | "
                f"{self.group_index('vocab', r):>9} {self.group_rank('vocab', r):>4}")
        return "\n".join(lines)


def plan_layout(world_size: int, seq_degree: int = 1, expert_degree: int = 1,
                vocab_degree: int = 1) -> LayoutPlan:
    """Validate the degrees against W and return the (pure) plan. Raises ValueError with the valid divisors."""
    return LayoutPlan(world_size, seq_degree, expert_degree, vocab_degree)


@dataclass(frozen=True)
class RankLayout:
    """This rank's process groups, created identically on every rank from one LayoutPlan."""

    plan: LayoutPlan
    rank: int
    seq_group: dist.ProcessGroup
    expert_group: dist.ProcessGroup
    vocab_group: dist.ProcessGroup
    expert_replica_group: dist.ProcessGroup
    vocab_replica_group: dist.ProcessGroup
    mesh: object  # DeviceMesh (W,) "fsdp": FSDP2 for dense weights
    expert_mesh: object  # DeviceMesh (W/E_p, E_p) ("expert_replica", "ep"): expert weights are DTensors [Replicate, Shard(0)]
    vocab_mesh: object  # DeviceMesh (W/P, P) ("vocab_replica", "vocab"): the output projection [Replicate, Shard(0)]

    @property
    def seq_rank(self) -> int:
        return self.plan.group_rank("seq", self.rank)

    @property
    def expert_rank(self) -> int:
        return self.plan.group_rank("expert", self.rank)

    @property
    def vocab_rank(self) -> int:
        return self.plan.group_rank("vocab", self.rank)

    @property
    def seq_size(self) -> int:
        return self.plan.seq_degree

    @property
    def expert_size(self) -> int:
        return self.plan.expert_degree

    @property
    def vocab_size(self) -> int:
        return self.plan.vocab_degree

    @property
    def data_rank(self) -> int:
        """Index of this rank's sequence group: which distinct slice of the data it reads."""
        return self.plan.group_index("seq", self.rank)

    @property
    def data_size(self) -> int:
        return self.plan.num_sequence_groups

    @classmethod
    def build(cls, plan: LayoutPlan, device_type: str | None = None) -> "RankLayout":
        """Create every sub-group (all ranks, same order) and the 1-D FSDP mesh. Needs an initialised
        default process group whose size equals plan.world_size."""
        if not dist.is_initialized():
            raise RuntimeError("RankLayout.build needs torch.distributed initialised (init_process_group)")
        W = dist.get_world_size()
        if W != plan.world_size:
            raise ValueError(f"the plan is for {plan.world_size} ranks but the process group has {W}; "
                             f"re-plan with plan_layout({W}, ...)")
        rank = dist.get_rank()
        mine = {}
        # Every rank calls new_group for every group, in the same order: new_group is collective.
        for kind, groups in (("seq", plan.seq_groups), ("expert", plan.expert_groups),
                             ("vocab", plan.vocab_groups), ("expert_replica", plan.expert_replica_groups),
                             ("vocab_replica", plan.vocab_replica_groups)):
            for ranks in groups:
                pg = dist.new_group(list(ranks))
                if rank in ranks:
                    mine[kind] = pg
        if device_type is None:
            device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, (W,), mesh_dim_names=("fsdp",))
        # Row g of these meshes is expert (vocab) group g, column j its replica group j.
        Ep, P = plan.expert_degree, plan.vocab_degree
        expert_mesh = init_device_mesh(device_type, (W // Ep, Ep), mesh_dim_names=("expert_replica", "ep"))
        vocab_mesh = init_device_mesh(device_type, (W // P, P), mesh_dim_names=("vocab_replica", "vocab"))
        return cls(plan=plan, rank=rank, seq_group=mine["seq"], expert_group=mine["expert"],
                   vocab_group=mine["vocab"], expert_replica_group=mine["expert_replica"],
                   vocab_replica_group=mine["vocab_replica"], mesh=mesh, expert_mesh=expert_mesh,
                   vocab_mesh=vocab_mesh)
