"""The ring of a vocab group: who holds which vocabulary rows, and one-hop shifts to the next rank.

Rank r of the group (size P) owns rows [r*S, min(V, (r+1)*S)) with S = ceil(V/P); trailing shards
may be shorter or empty when P does not divide V. A shift sends tensors to rank r+1 and receives
their counterparts from rank r-1 (point-to-point, asynchronous; zero-size tensors are skipped on both
sides because both sides know the sizes). At P = 1 nothing is ever sent.

Paper section 3.2. Legend: V vocab, P vocab-group size, S = ceil(V/P) rows per shard, N tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


def shard_bounds(vocab_size: int, num_shards: int, index: int) -> tuple[int, int]:
    """Rows [lo, hi) of shard `index` when `vocab_size` rows are cut into `num_shards` contiguous
    ceil-sized shards (torch.chunk's rule; trailing shards may be short or empty)."""
    rows = -(-vocab_size // num_shards)
    return min(vocab_size, index * rows), min(vocab_size, (index + 1) * rows)


@dataclass(frozen=True)
class Ring:
    group: object  # a torch ProcessGroup, or None for a single rank
    rank: int
    size: int
    vocab_size: int

    @staticmethod
    def of(group, vocab_size: int) -> "Ring":
        if group is None:
            return Ring(None, 0, 1, vocab_size)
        return Ring(group, dist.get_rank(group), dist.get_world_size(group), vocab_size)

    @property
    def shard_rows(self) -> int:
        """S = ceil(V / P): rows of every shard but the trailing ones."""
        return -(-self.vocab_size // self.size)

    def shard_bounds(self, owner: int) -> tuple[int, int]:
        """Global vocabulary rows [lo, hi) held by group rank `owner`."""
        return shard_bounds(self.vocab_size, self.size, owner)

    def previous(self, owner: int) -> int:
        """The group rank whose payload arrives after one more hop of a payload now from `owner`."""
        return (owner - 1) % self.size

    def gather_ints(self, values: list[int], device: torch.device) -> list[list[int]]:
        """Every rank's `values` (the same length on each rank), indexed by group rank: one
        all-gather of a few integers, so that every rank takes the same decisions; none at P = 1."""
        if self.size == 1:
            return [list(values)]
        mine = torch.tensor(values, dtype=torch.int64, device=device)
        rows = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(rows, mine, group=self.group)
        return [[int(v) for v in row.tolist()] for row in rows]

    def shift(self, sends: list[torch.Tensor], recvs: list[torch.Tensor]) -> list:
        """Start sending `sends` to rank+1 and receiving `recvs` from rank-1; returns the works to wait."""
        if self.size == 1:
            raise ValueError("a ring of one rank has no neighbour to shift to")
        nxt = dist.get_global_rank(self.group, (self.rank + 1) % self.size)
        prv = dist.get_global_rank(self.group, (self.rank - 1) % self.size)
        ops = [dist.P2POp(dist.isend, t, nxt, group=self.group) for t in sends if t.numel() > 0]
        ops += [dist.P2POp(dist.irecv, t, prv, group=self.group) for t in recvs if t.numel() > 0]
        return dist.batch_isend_irecv(ops) if ops else []


def wait_all(works: list) -> None:
    for work in works:
        work.wait()
