"""The cp axis's step table: what each cp rank holds, computes and passes in one layer's attention."""

from __future__ import annotations

from spmd.layout import block_range
from spmd.observe.schedule import Cell, Schedule
from spmd.parallel.tokens import Chunk, ring_owner, ring_pairs


def positions(chunks) -> str:
    return " + ".join(f"{c.start}-{c.start + c.size - 1}" for c in chunks)


def ring_schedule(seq: int, chunks: list[list[Chunk]], work: list[tuple[int, int, int]]) -> Schedule:
    """Ring attention's table, from its chunks and its work per rank (context.RingCore asks)."""
    cp = len(chunks)
    steps = [("tokens", [Cell(f"positions {positions(chunks[r])}") for r in range(cp)])]
    for step in range(cp):
        cells = []
        for r in range(cp):
            owner = ring_owner(r, step, cp)
            pairs = ring_pairs(chunks[r], chunks[owner])
            whole, diagonal = sum(not d for *_, d in pairs), sum(d for *_, d in pairs)
            passing = f"; pass K/V of {owner} on" if step < cp - 1 else ""
            cells.append(
                Cell(
                    f"Q x K/V of {owner}: {whole} whole + {diagonal} diagonal{passing}",
                    ((r + 1) % cp,) if step < cp - 1 else (),
                )
            )
        steps.append((f"forward {step}", cells))
    steps.append(("backward", [Cell("the same ring; dK/dV of each block follows it, back to its owner")] * cp))
    steps.append(("work", [Cell(f"{w} whole + {d} diagonal pairs, {e} scores a head") for w, d, e in work]))
    intro = (
        f"Ring attention over cp={cp}, one layer (columns: cp ranks). A sequence of {seq} is cut into "
        f"2 x cp = {2 * cp} chunks; rank r holds chunks r and {2 * cp - 1}-r (zigzag), so the causal work "
        "is the same on every rank. Each forward step passes the K/V block held to rank + 1 while attending "
        "to it (online softmax)."
    )
    return Schedule(intro, steps)


def ulysses_schedule(chunks: list[list[Chunk]], heads: int) -> Schedule:
    """Ulysses's table, from its chunks and tp rank 0's heads (context.UlyssesCore asks)."""
    cp = len(chunks)
    mine = [block_range(heads, cp, g) for g in range(cp)]
    head_text = [f"heads {lo}-{hi - 1}" if hi - lo > 1 else f"head {lo}" for lo, hi in mine]
    steps = [
        ("tokens", [Cell(f"positions {positions(chunks[r])}, all {heads} heads") for r in range(cp)]),
        ("forward", [Cell(f"A2A Q, K, V to {head_text[r]}; attend whole sequences; A2A O back") for r in range(cp)]),
        ("backward", [Cell(f"A2A dO to {head_text[r]}; attention backward; A2A dQ, dK, dV back") for r in range(cp)]),
    ]
    intro = (
        f"Ulysses over cp={cp}, one layer (columns: cp ranks; the heads of tp rank 0). Each all-to-all "
        "swaps a sequence split for a head split (or back): 4 in forward, 4 in backward."
    )
    return Schedule(intro, steps)
