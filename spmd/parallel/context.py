"""The context-parallel axis (cp): its cores, the ways attention crosses the cp slices, in one registry.

Every cp rank holds a slice of every sequence (the weights are replicated over cp; their gradients are
summed over it, as over dp). Two ways to attend across the slices:
- ring: K/V blocks pass around the cp ring while each rank attends its queries to the block it holds
  (online softmax); a causal sequence is cut into 2 cp chunks and rank r holds chunks r and 2cp-1-r
  ("zigzag"), so every rank computes the same number of (query chunk, key chunk) pairs: 2 cp - 1 whole
  ones and 2 on the diagonal (work_table shows it). Needs seq >= 2 cp (a chunk per token at least).
- ulysses: contiguous slices; an all-to-all turns the sequence split into a head split before attention
  and back after, so each rank attends whole sequences for its heads (heads split unevenly when cp does
  not divide them; every rank needs a head: a tp rank's heads >= cp).
Each core owns its token chunks, its checks, its attention, bytes, flops and step text: the layout, the
closed form and the step table ask the core the layout holds (layout.cp), never the variant's name: --cp's
value becomes its core once, where it is parsed (core_named).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from spmd.collectives.cost import all_to_all_bytes, ring_shift_bytes
from spmd.layout import block_range
from spmd.model.attention import AttentionCore
from spmd.model.blocks import Share
from spmd.observe.schedule import Schedule
from spmd.parallel.accounting import Tally
from spmd.parallel.context_table import ring_schedule, ulysses_schedule
from spmd.parallel.ring_attention import RingAttention
from spmd.parallel.tokens import Chunk, held_chunks, pair_work
from spmd.parallel.ulysses import UlyssesAttention
from spmd.transport.group import Group


@dataclass(frozen=True)  # no fields: every RingCore is equal, so layouts holding one compare and hash alike
class RingCore:
    """Ring attention over zigzag chunks (spmd.parallel.ring_attention)."""

    name = "ring"
    rescores = True  # backward recomputes P block by block
    collectives = "cp: pass K/V blocks around the ring (cp - 1 steps; backward again, dK/dV behind)"
    forward_text, backward_text = "; K/V around the cp ring", "; K/V and dK/dV around the cp ring"

    def __str__(self) -> str:  # as --cp spells it
        return self.name

    def cuts(self, seq: int, cp: int) -> tuple[list[tuple[int, int]], list[list[int]]]:
        return [block_range(seq, 2 * cp, c) for c in range(2 * cp)], [[r, 2 * cp - 1 - r] for r in range(cp)]

    def check(self, cp: int, seq: int, heads_per_tp_rank: list[int]) -> None:
        if seq < 2 * cp:
            raise ValueError(f"--cp ring cuts a sequence into 2 x cp = {2 * cp} chunks: --seq {seq} is too short")

    def attention(self, group: Group | None, c: int, share: Share, seq: int, chunks, keep_probs: bool) -> AttentionCore:
        return RingAttention(group, c, share.heads, share.head_size, chunks)  # keeps no probabilities either way

    def traffic(self, tally: Tally, share: Share, tokens: list[int], scale: int, c: int, forwards: int, times: int):
        """One micro-batch's K/V blocks (`scale`: bytes a token and channel) passed cp - 1 times per forward and
        again in backward, their dK/dV accumulators cp times, `times` such."""
        cp, block = len(tokens), [scale * t * share.attention for t in tokens]
        shift = lambda step: ring_shift_bytes([block[(r - step) % cp] for r in range(cp)], c)  # noqa: E731
        for step in range(cp):
            if step < cp - 1:
                tally.add("cp", shift(step), 2 * (forwards + 1) * times)  # K and V, each forward and backward
            tally.add("cp", shift(step), 2 * times)  # dK and dV

    def flops(self, sequences: int, heads: int, head_size: int, seq: int, cp: int, c: int) -> int:
        """Matmul flops of one forward of the attention core on cp rank c: its zigzag pairs' scores, then P V."""
        return 4 * sequences * heads * work_table(seq, cp)[c][2] * head_size

    def schedule(self, seq: int, cp: int, heads: int) -> Schedule:
        return ring_schedule(seq, token_chunks(seq, cp, self), work_table(seq, cp))


@dataclass(frozen=True)
class UlyssesCore:
    """DeepSpeed-Ulysses over contiguous slices (spmd.parallel.ulysses)."""

    name = "ulysses"
    rescores = False
    collectives = "cp: A2A Q, K, V to heads, O back (backward: dO, then dQ, dK, dV)"
    forward_text = backward_text = "; A2A over cp (x4)"

    def __str__(self) -> str:  # as --cp spells it
        return self.name

    def cuts(self, seq: int, cp: int) -> tuple[list[tuple[int, int]], list[list[int]]]:
        return [block_range(seq, cp, c) for c in range(cp)], [[r] for r in range(cp)]

    def check(self, cp: int, seq: int, heads_per_tp_rank: list[int]) -> None:
        if seq < cp:
            raise ValueError(f"--cp ulysses splits a sequence over cp={cp} ranks: --seq {seq} is too short")
        if min(heads_per_tp_rank) < cp:
            raise ValueError(
                f"--cp ulysses splits a tp rank's heads ({min(heads_per_tp_rank)}) over cp={cp}: "
                f"give --heads at least cp x tp"
            )

    def attention(self, group: Group | None, c: int, share: Share, seq: int, chunks, keep_probs: bool) -> AttentionCore:
        return UlyssesAttention(group, c, share.heads, share.head_size, seq, chunks, keep_probs)

    def traffic(self, tally: Tally, share: Share, tokens: list[int], scale: int, c: int, forwards: int, times: int):
        """Per forward all-to-alls of Q, K, V to heads and O back, in backward dO to heads and dQ, dK, dV back."""
        cp = len(tokens)
        heads = [share.head_size * (hi - lo) for lo, hi in (block_range(share.heads, cp, g) for g in range(cp))]
        to_heads = [[scale * tokens[q] * heads[r] for r in range(cp)] for q in range(cp)]
        to_tokens = [[scale * tokens[r] * heads[q] for r in range(cp)] for q in range(cp)]
        tally.add("cp", all_to_all_bytes(to_heads, c), (3 * forwards + 1) * times)
        tally.add("cp", all_to_all_bytes(to_tokens, c), (forwards + 3) * times)

    def flops(self, sequences: int, heads: int, head_size: int, seq: int, cp: int, c: int) -> int:
        """Matmul flops of one forward of the attention core on cp rank c: whole sequences, its share of heads."""
        lo, hi = block_range(heads, cp, c)
        return 4 * sequences * (hi - lo) * seq**2 * head_size

    def schedule(self, seq: int, cp: int, heads: int) -> Schedule:
        return ulysses_schedule(token_chunks(seq, cp, self), heads)


CpCore = RingCore | UlyssesCore
CP_CORES: dict[str, CpCore] = {core.name: core for core in (RingCore(), UlyssesCore())}
CP_VARIANTS = tuple(CP_CORES)
DEFAULT_CP = RingCore.name  # --cp's default, as the flag spells it
RING = CP_CORES[DEFAULT_CP]  # the default core of a layout


def core_named(name: str) -> CpCore:
    """The core of a --cp value, or a ValueError naming the flag and its variants."""
    if name not in CP_CORES:
        raise ValueError(f"--cp must be one of {', '.join(CP_VARIANTS)}, got {name!r}")
    return CP_CORES[name]


@functools.lru_cache(maxsize=256)
def token_chunks(seq: int, cp: int, core: CpCore) -> list[list[Chunk]]:
    """Per cp rank, its chunks of every sequence, in the order it holds them."""
    return held_chunks(*core.cuts(seq, cp))


def tokens_held(seq: int, cp: int, core: CpCore) -> list[int]:
    """How many tokens of each sequence every cp rank holds."""
    return [sum(c.size for c in held) for held in token_chunks(seq, cp, core)]


def check_context(core: CpCore, cp: int, seq: int, heads_per_tp_rank: list[int]) -> None:
    """Every reason a cp layout cannot run, as a ValueError naming the flag."""
    if cp > 1:
        core.check(cp, seq, heads_per_tp_rank)


def work_table(seq: int, cp: int) -> list[tuple[int, int, int]]:
    """Per cp rank under the zigzag: (whole pairs, diagonal pairs, score elements computed per head)."""
    return pair_work(token_chunks(seq, cp, RING))
