"""The cp axis as a mixture of experts' routing sees it (spmd.model.moe's SequenceAxis): which chunks of every
sequence each cp rank holds, and the pairs each chunk routed to each expert, gathered over cp.

The balancing loss counts a sequence's pairs per expert, and a capacity keeps an expert's first C pairs of a
sequence: both need the whole sequence, which cp splits. Each layer's forward all-gathers every cp rank's counts
per (sequence, chunk, expert) (int64: exact), so every rank knows the whole sequence's counts and, for each chunk
it holds, the pairs of the sequence's earlier chunks: its capacity decisions and balancing fractions are one
device's. Both cp variants alike: the chunks are the core's (context.token_chunks), whatever their cut.
"""

from __future__ import annotations

import numpy as np

from spmd.collectives import all_gather
from spmd.collectives.tags import Tag
from spmd.parallel.tokens import Chunk
from spmd.transport.group import Group


class WholeSequences:
    """One rank's view of the cp axis for routing: every cp rank's chunks (`chunks`, token_chunks' order), its
    coordinate and group (None: for shapes only)."""

    def __init__(self, chunks: list[list[Chunk]], coord: int, group: Group | None):
        self.chunks, self.coord, self.group = chunks, coord, group
        self.size = len(chunks)
        self.sizes = [c.size for c in chunks[coord]]  # this rank's chunks of a sequence, in the order it holds them

    def whole(self, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """From this rank's pairs per (sequence, chunk held, expert): per (sequence, chunk held, expert) the pairs
        of the sequence's earlier chunks on every cp rank, and per (sequence, expert) the whole sequence's."""
        assert self.group is not None
        sequences, _, experts = counts.shape
        sizes = [sequences * len(held) * experts for held in self.chunks]
        every = all_gather(self.group, counts.reshape(-1), sizes, tag=Tag.EXPERT_COUNTS)
        cuts = sum(map(len, self.chunks))
        by_cut = np.zeros((sequences, cuts, experts), dtype=np.int64)
        at = 0
        for held, size in zip(self.chunks, sizes, strict=True):
            block = every[at : at + size].reshape(sequences, len(held), experts)
            for j, chunk in enumerate(held):
                by_cut[:, chunk.index] = block[:, j]
            at += size
        earlier = np.cumsum(by_cut, axis=1) - by_cut  # the cuts are in position order
        return earlier[:, [c.index for c in self.chunks[self.coord]]], by_cut.sum(axis=1)
