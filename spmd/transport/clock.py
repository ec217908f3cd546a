"""The clock and the recorder of timelines: spans of compute, send, transfer and waiting per rank.

A communicator with a `tracer` records its own sends, waits and transfers; rank functions mark their compute
with `traced(group, name)`, which costs nothing when no tracer is set. spmd.observe.trace writes them out.
"""

import time
from contextlib import contextmanager


def now_us() -> float:
    """Microseconds on the monotonic clock all processes of one machine share."""
    return time.perf_counter() * 1e6


class Tracer:
    """Collected spans: (rank, name, category, start us, end us, args)."""

    def __init__(self):
        self.spans = []

    def span(self, rank: int, name: str, category: str, start_us: float, end_us: float, **args) -> None:
        self.spans.append((rank, name, category, start_us, end_us, args))

    def of_rank(self, rank: int) -> list:
        return [s for s in self.spans if s[0] == rank]


@contextmanager
def traced(group, name: str, category: str = "compute"):
    """Record the enclosed block as a span of the calling rank, if its communicator has a tracer."""
    tracer, rank = group.comm.tracer, group.global_rank
    if tracer is None:
        yield
        return
    start = now_us()
    try:
        yield
    finally:
        tracer.span(rank, name, category, start, now_us())
