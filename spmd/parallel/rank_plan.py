"""What one rank of a composed run holds, derived once by Layout.for_rank: the engine, the closed-form cost,
the checkpoint and the planner read it instead of asking the layout again."""

from __future__ import annotations

from dataclasses import dataclass

from spmd.model.blocks import Rows, Share


@dataclass(frozen=True)
class UnitPlan:
    """One unit a rank holds."""

    unit: int  # its global index
    kind: str
    size: int  # elements of this rank's tensor (and ep) slice of it
    shard: tuple[int, int]  # this rank's range of that slice over the fsdp axis
    counts: tuple[int, ...]  # every fsdp rank's count of it
    ep_summed: int  # elements of its optimizer part (the shard, or all of it) that ep sums: its dense prefix's

    @property
    def shard_size(self) -> int:
        lo, hi = self.shard
        return hi - lo


@dataclass(frozen=True)
class RankPlan:
    rank: int
    share: Share  # its share of a layer
    chunks: tuple[tuple[int, ...], ...]  # the global units of each of its pipeline chunks
    units: tuple[UnitPlan, ...]  # every unit it holds, chunk after chunk
    sequences: tuple[int, int]  # its sequences of the batch
    rows: tuple[Rows, ...]  # per micro-batch
    group_pairs: tuple[int, ...]  # per micro-batch: every (row, expert) pair of its ep group (each row's top_k)
    alike: tuple[tuple[int, int], ...]  # (k, how many micro-batches have k's rows), covering every micro-batch
    largest_rows: Rows  # per field, the largest over its micro-batches: what its buffers are allocated for

    @property
    def kinds(self) -> list[str]:
        return [u.kind for u in self.units]
