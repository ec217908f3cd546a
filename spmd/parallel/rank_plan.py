"""What one rank of a composed run holds, derived once by Layout.for_rank: the engine, the closed-form cost,
the checkpoint and the planner read it instead of asking the layout again."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from spmd.model.blocks import Rows, Share


@dataclass(frozen=True)
class Piece:
    """A run [start, stop) of a unit's tensor slice sharded as one: in blocks over fsdp, and (FSDP over ep: a run of
    dense weights) each fsdp block in blocks over ep."""

    start: int
    stop: int
    fsdp: tuple[int, ...]  # every fsdp rank's block of the run
    block: tuple[int, int]  # this rank's fsdp block, as a range of the unit's slice (its ep peers share it)
    ep: tuple[int, ...]  # FSDP over ep: every ep rank's part of that block (empty: not split over ep)
    shard: tuple[int, int]  # this rank's range of the unit's slice


@dataclass(frozen=True)
class UnitPlan:
    """One unit a rank holds."""

    unit: int  # its global index
    kind: str
    size: int  # elements of this rank's tensor (and ep) slice of it
    pieces: tuple[Piece, ...]  # its runs sharded alike: one, or a mixture of experts' dense prefix and experts
    ep_summed: int  # elements of its optimizer part (the shard, or all of it) that ep sums: its dense prefix's

    @property
    def shard_size(self) -> int:
        return sum(p.shard[1] - p.shard[0] for p in self.pieces)

    def take(self, flat: np.ndarray) -> np.ndarray:
        """This rank's shard of `flat` (a unit's slice, or its indices): its pieces' shards, one after another."""
        if len(self.pieces) == 1:
            lo, hi = self.pieces[0].shard
            return flat[lo:hi]
        return np.concatenate([flat[p.shard[0] : p.shard[1]] for p in self.pieces])

    @property
    def reduced_at(self) -> tuple[int, int]:
        """Where the shard sits in a whole-width gradient once reduced in place: its own range, or (several
        pieces) gathered at the front."""
        return self.pieces[0].shard if len(self.pieces) == 1 else (0, self.shard_size)


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
