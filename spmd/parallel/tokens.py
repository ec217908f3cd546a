"""Which positions of a sequence a cp rank holds (its chunks), and the causal pairs of chunks ring attention
computes: the token arithmetic the cp cores (context.py) and their attention (ring_attention.py, ulysses.py)
share."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Chunk:
    """A run of a sequence's positions held by one cp rank: `index` of the cut, `start` position, `size`,
    and `offset`: where it begins among the rank's tokens of that sequence."""

    index: int
    start: int
    size: int
    offset: int


def held_chunks(cuts: list[tuple[int, int]], mine: list[list[int]]) -> list[list[Chunk]]:
    """Per cp rank, the chunks of the cuts (start, end) it holds (`mine`: their indices), in that order."""
    chunks = []
    for indices in mine:
        offset, held = 0, []
        for c in indices:
            lo, hi = cuts[c]
            held.append(Chunk(c, lo, hi - lo, offset))
            offset += hi - lo
        chunks.append(held)
    return chunks


def ring_pairs(mine: list[Chunk], theirs: list[Chunk]) -> list[tuple[Chunk, Chunk, bool]]:
    """(query chunk, key chunk, diagonal) of every pair a causal rank computes: a key chunk before the
    query chunk is seen whole, the same chunk under the causal mask, a later one not at all."""
    return [(q, k, q.index == k.index) for q in mine for k in theirs if k.index <= q.index and q.size and k.size]


def ring_owner(rank: int, step: int, cp: int) -> int:
    """Whose K/V block cp rank `rank` holds at ring step `step`."""
    return (rank - step) % cp


def pair_work(chunks: list[list[Chunk]]) -> list[tuple[int, int, int]]:
    """Per cp rank: (whole pairs, diagonal pairs, score elements computed per head) over the ring."""
    cp, rows = len(chunks), []
    for r in range(cp):
        pairs = [p for o in range(cp) for p in ring_pairs(chunks[r], chunks[o])]
        rows.append(
            (sum(not d for *_, d in pairs), sum(d for *_, d in pairs), sum(q.size * k.size for q, k, _ in pairs))
        )
    return rows
