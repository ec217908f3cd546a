"""Where a rank's step goes: its seconds split into PARTS, each second counted once, in the innermost part open.

The engine opens "elementwise" around a unit's forward and backward, the blocks open "attention" around their
attention core and "gemm" around every matrix product (`matmul`), the transports open "comm" while a rank waits
for a message, the engine "optimizer" around its update; what no part holds is the rest (the engine's own
Python, copies between buffers). A rank's thread holds its own Stopwatch (threads or one process an MPI rank);
with none started, a part costs one attribute lookup.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import numpy as np

PARTS = ("gemm", "attention", "elementwise", "comm", "optimizer", "rest")
_local = threading.local()


class Stopwatch:
    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PARTS, 0.0)
        self._open: list[str] = []
        self._since = 0.0

    def enter(self, name: str) -> None:
        now = time.perf_counter()
        if self._open:
            self.seconds[self._open[-1]] += now - self._since
        self._open.append(name)
        self._since = now

    def leave(self) -> None:
        now = time.perf_counter()
        self.seconds[self._open.pop()] += now - self._since
        self._since = now

    def lap(self, total: float) -> dict[str, float]:
        """The parts' seconds since the last lap, the rest being `total` less the others; and start again."""
        laps = {name: self.seconds[name] for name in PARTS[:-1]}
        laps["rest"] = max(0.0, total - sum(laps.values()))
        self.seconds = dict.fromkeys(PARTS, 0.0)
        return laps


def start() -> Stopwatch:
    """A new Stopwatch for the calling thread (a rank)."""
    _local.watch = Stopwatch()
    return _local.watch


def stop() -> None:
    _local.watch = None


@contextmanager
def part(name: str):
    watch = getattr(_local, "watch", None)
    if watch is None:
        yield
        return
    watch.enter(name)
    try:
        yield
    finally:
        watch.leave()


def matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """out = a b, counted as "gemm"."""
    watch = getattr(_local, "watch", None)
    if watch is None:
        np.matmul(a, b, out=out)
        return
    watch.enter("gemm")
    try:
        np.matmul(a, b, out=out)
    finally:
        watch.leave()
