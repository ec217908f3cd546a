"""The expert-parallel axis (ep), as a mixture of experts (spmd.model.moe) calls it.

A rank holds E / ep experts, and every rank's pairs (row, chosen expert) are computed by their expert's rank.
Dispatch: each rank first sends each other the pairs it has for their experts (counts), then the pairs' rows and
gates (all-to-all-v, EXPERT_ROWS and EXPERT_GATES); the experts compute what they received, in expert order
(grouped by source, then expert, as received), and return the outputs by source (the combine). Backward sends the
output gradients the same way, and the rows' input gradients and the gates' gradients back. Each exchange first
ticks the tensor axis, as its points do: the engine moves its background collectives on there.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from spmd.collectives.alltoall import all_to_all_into
from spmd.collectives.tags import Tag
from spmd.layout import block_range
from spmd.transport.group import Group


@dataclass(frozen=True)
class Route:
    """Where one exchange's pairs go: `outgoing[q]` the slice of the home buffer (sorted by expert) for ep rank q,
    `incoming[q]` the slice of the received buffer from q; row j of the expert-order buffer is row perm[j] of the
    received one, and `segments` are (rows, expert here) of each held expert's pairs there."""

    outgoing: list[slice]
    incoming: list[slice]
    perm: np.ndarray
    segments: list[tuple[slice, int]]


class ExpertParallel:
    """One rank's ep axis: its size, coordinate and group (None: for shapes only, or one rank). `exchanged`
    counts the pairs sent to and received from other ep ranks: in forwards, in backwards (the closed form's
    input, engine.exchanged)."""

    def __init__(self, size: int = 1, coord: int = 0, group: Group | None = None):
        self.size, self.coord, self.group = size, coord, group
        self.exchanged = np.zeros(4, dtype=np.int64)

    def held(self, experts: int) -> int:
        """How many experts this rank holds (every ep rank as many)."""
        first, last = block_range(experts, self.size, self.coord)
        return last - first

    def exchange_counts(self, tp, bounds: np.ndarray, rc: np.ndarray) -> None:
        """Each ep rank's pair count for each of its experts (from where each expert's pairs start in what is sent)
        to it; into rc (ep, held) what every rank has for the experts here."""
        counts, n = np.diff(bounds), rc.shape[1]
        self._exchange(tp, [counts[d * n : (d + 1) * n] for d in range(self.size)], list(rc), Tag.EXPERT_COUNTS)

    def route(self, bounds: np.ndarray, rc: np.ndarray, backward: bool) -> Route:
        """The route of a pass's pairs (counted in `exchanged`), from `bounds` (where each expert's pairs start in
        what this rank sends) and rc (what it receives)."""
        n = rc.shape[1]
        outgoing = [slice(int(bounds[d * n]), int(bounds[(d + 1) * n])) for d in range(self.size)]
        ends = np.cumsum(rc.sum(axis=1))
        incoming = [slice(int(end - size), int(end)) for size, end in zip(rc.sum(axis=1), ends, strict=True)]
        self._count(outgoing, incoming, 2 if backward else 0)
        return Route(outgoing, incoming, *self._by_expert(rc))

    def send(self, tp, route: Route, home: np.ndarray, received: np.ndarray, out: np.ndarray, tag: int) -> None:
        """The home pairs to their experts' ranks: received by source in `received`, then in expert order in out."""
        self._exchange(tp, [home[o] for o in route.outgoing], [received[i] for i in route.incoming], tag)
        r = route.perm.size
        np.take(received[:r], route.perm, axis=0, out=out[:r])

    def back(self, tp, route: Route, values: np.ndarray, by_source: np.ndarray, home: np.ndarray, tag: int) -> None:
        """The pairs' values computed here (in expert order) back to their home ranks, by source in by_source on
        the way, into home (the slices the pairs were sent from)."""
        by_source[route.perm] = values[: route.perm.size]
        self._exchange(tp, [by_source[i] for i in route.incoming], [home[o] for o in route.outgoing], tag)

    def _by_expert(self, rc) -> tuple[np.ndarray, list[tuple[slice, int]]]:
        """The received pairs' order by expert (one product a weight: its gradient is written once), and each
        held expert's rows in it."""
        sizes = rc.reshape(-1)
        starts = (np.cumsum(sizes) - sizes).reshape(rc.shape)
        held = rc.shape[1]
        perm = np.concatenate(
            [np.arange(starts[q, e], starts[q, e] + rc[q, e]) for e in range(held) for q in range(self.size)]
        )
        ends = np.cumsum(rc.sum(axis=0))
        return perm, [
            (slice(int(end - n), int(end)), e) for e, (n, end) in enumerate(zip(rc.sum(axis=0), ends, strict=True))
        ]

    def _exchange(self, tp, blocks: list, out: list, tag: int) -> None:
        tp.tick()
        assert self.group is not None
        all_to_all_into(self.group, blocks, out, tag)

    def _count(self, outgoing: list[slice], incoming: list[slice], at: int) -> None:
        me = self.group.rank if self.group is not None else 0
        self.exchanged[at] += sum(o.stop - o.start for q, o in enumerate(outgoing) if q != me)
        self.exchanged[at + 1] += sum(i.stop - i.start for q, i in enumerate(incoming) if q != me)
