"""What a training step costs one rank, as the closed forms and the measurements both state it: payload
bytes per mesh axis (Tally), bytes held by kind (MEMORY_KINDS), matmul flops."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from spmd.model.kernels import MEMORY_KINDS


@dataclass
class Tally:
    """One rank's payload bytes in one step, per mesh axis: what a cost function adds up."""

    sent: Counter = field(default_factory=Counter)
    received: Counter = field(default_factory=Counter)

    def add(self, axis: str, traffic: tuple[int, int], times: int = 1) -> None:
        """`times` collectives over `axis`, each (bytes sent, bytes received) for this rank."""
        self.sent[axis] += traffic[0] * times
        self.received[axis] += traffic[1] * times


@dataclass(frozen=True)
class TrainCost:
    """Per rank, one step: payload bytes per mesh axis, bytes held by kind (kernels.MEMORY_KINDS), matmul flops."""

    traffic: list[Tally]
    memory: list[dict[str, int]]
    flops: list[int]

    @property
    def bytes_sent(self) -> list[int]:
        return [sum(t.sent.values()) for t in self.traffic]

    @property
    def bytes_received(self) -> list[int]:
        return [sum(t.received.values()) for t in self.traffic]

    @property
    def peak_bytes(self) -> list[int]:
        return [sum(m.values()) for m in self.memory]


def memory(**nbytes: int) -> dict[str, int]:
    """Bytes by kind; every kind present, in MEMORY_KINDS order."""
    unknown = set(nbytes) - set(MEMORY_KINDS)
    if unknown:
        raise ValueError(f"unknown memory kinds {sorted(unknown)}")
    return {kind: nbytes.get(kind, 0) for kind in MEMORY_KINDS}
