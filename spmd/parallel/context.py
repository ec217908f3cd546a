"""The context-parallel axis (cp): which tokens of every sequence a cp rank holds, and ring attention's plan.

Every cp rank holds a slice of every sequence (the weights are replicated over cp; their gradients are
summed over it, as over dp). Two ways to attend across the slices:
- ring: K/V blocks pass around the cp ring while each rank attends its queries to the block it holds
  (online softmax); a causal sequence is cut into 2 cp chunks and rank r holds chunks r and 2cp-1-r
  ("zigzag"), so every rank computes the same number of (query chunk, key chunk) pairs: 2 cp - 1 whole
  ones and 2 on the diagonal (work_table shows it). Needs seq >= 2 cp (a chunk per token at least).
- ulysses: contiguous slices; an all-to-all turns the sequence split into a head split before attention
  and back after, so each rank attends whole sequences for its heads (heads split unevenly when cp does
  not divide them; every rank needs a head: a tp rank's heads >= cp).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from spmd.layout import block_range

CP_VARIANTS = ("ring", "ulysses")


@dataclass(frozen=True)
class Chunk:
    """A run of a sequence's positions held by one cp rank: `index` of the cut, `start` position, `size`,
    and `offset`: where it begins among the rank's tokens of that sequence."""

    index: int
    start: int
    size: int
    offset: int


@functools.lru_cache(maxsize=256)
def token_chunks(seq: int, cp: int, variant: str) -> list[list[Chunk]]:
    """Per cp rank, its chunks of every sequence, in the order it holds them."""
    if variant == "ring":
        cuts = [block_range(seq, 2 * cp, c) for c in range(2 * cp)]
        mine = [[r, 2 * cp - 1 - r] for r in range(cp)]
    else:
        cuts = [block_range(seq, cp, c) for c in range(cp)]
        mine = [[r] for r in range(cp)]
    chunks = []
    for indices in mine:
        offset, held = 0, []
        for c in indices:
            lo, hi = cuts[c]
            held.append(Chunk(c, lo, hi - lo, offset))
            offset += hi - lo
        chunks.append(held)
    return chunks


def tokens_held(seq: int, cp: int, variant: str) -> list[int]:
    """How many tokens of each sequence every cp rank holds."""
    return [sum(c.size for c in held) for held in token_chunks(seq, cp, variant)]


def check_context(variant: str, cp: int, seq: int, heads_per_tp_rank: list[int]) -> None:
    """Every reason a cp layout cannot run, as a ValueError naming the flag."""
    if variant not in CP_VARIANTS:
        raise ValueError(f"--cp must be one of {', '.join(CP_VARIANTS)}, got {variant!r}")
    if cp == 1:
        return
    if variant == "ring" and seq < 2 * cp:
        raise ValueError(f"--cp ring cuts a sequence into 2 x cp = {2 * cp} chunks: --seq {seq} is too short")
    if variant == "ulysses":
        if seq < cp:
            raise ValueError(f"--cp ulysses splits a sequence over cp={cp} ranks: --seq {seq} is too short")
        if min(heads_per_tp_rank) < cp:
            raise ValueError(
                f"--cp ulysses splits a tp rank's heads ({min(heads_per_tp_rank)}) over cp={cp}: "
                f"give --heads at least cp x tp"
            )


def ring_pairs(mine: list[Chunk], theirs: list[Chunk]) -> list[tuple[Chunk, Chunk, bool]]:
    """(query chunk, key chunk, diagonal) of every pair a causal rank computes: a key chunk before the
    query chunk is seen whole, the same chunk under the causal mask, a later one not at all."""
    return [(q, k, q.index == k.index) for q in mine for k in theirs if k.index <= q.index and q.size and k.size]


def ring_owner(rank: int, step: int, cp: int) -> int:
    """Whose K/V block cp rank `rank` holds at ring step `step`."""
    return (rank - step) % cp


def work_table(seq: int, cp: int) -> list[tuple[int, int, int]]:
    """Per cp rank under the zigzag: (whole pairs, diagonal pairs, score elements computed per head)."""
    chunks = token_chunks(seq, cp, "ring")
    rows = []
    for r in range(cp):
        pairs = [p for o in range(cp) for p in ring_pairs(chunks[r], chunks[o])]
        rows.append(
            (sum(not d for *_, d in pairs), sum(d for *_, d in pairs), sum(q.size * k.size for q, k, _ in pairs))
        )
    return rows
