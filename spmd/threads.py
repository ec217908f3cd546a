"""The in-process backend: one thread per rank, one inbox per rank.

This is the problem statement's `Communicator`, extended with tag/source
matching, `abort` (wakes every waiting rank when one fails), deadlock
diagnosis, a receive timeout, and optional chaos (random delivery delays).
"""

import random
import threading
import time
from dataclasses import dataclass

import numpy as np

from spmd.comm import (
    ANY,
    DEFAULT_TIMEOUT,
    Aborted,
    BaseCommunicator,
    CommTimeout,
    DeadlockError,
    RankFailure,
    as_payload,
    check_num_devices,
    describe_wait,
)


@dataclass(frozen=True)
class Chaos:
    """Fault injection: delay each message by a random time up to `max_delay` seconds.

    Messages from different senders then arrive in shuffled order; between one
    sender and one receiver the order is kept, as MPI keeps it.
    """

    seed: int = 0
    max_delay: float = 0.002

    def __post_init__(self):
        if not self.max_delay >= 0:
            raise ValueError(f"chaos max_delay must be >= 0 seconds, got {self.max_delay}")


@dataclass
class _Message:
    src: int
    tag: int
    payload: np.ndarray
    due: float  # time.monotonic() from which the receiver may take it


class Communicator(BaseCommunicator):
    """Models communication between devices with one in-process inbox each.

    Args:
        num_devices: number of ranks (>= 1).
        timeout: seconds a `recv` may wait before it fails with CommTimeout
            (None: forever). Deadlocks among ranks started by `run_threads` are
            diagnosed at once, without waiting for it.
        chaos: a Chaos, to deliver messages late and out of order between senders.
    """

    def __init__(self, num_devices: int, timeout: float | None = DEFAULT_TIMEOUT, chaos: Chaos | None = None):
        check_num_devices(num_devices)
        self.num_devices = int(num_devices)
        self.timeout = timeout
        self.inboxes = [[] for _ in range(self.num_devices)]  # per rank: _Message, oldest first
        self._cond = threading.Condition()  # guards everything below and the inboxes
        self._abort_reason = None
        self._rank_of_thread = {}  # thread id -> rank, for threads started by run_threads
        self._waiting = {}  # rank -> (src, tag) it waits for in recv
        self._finished = set()  # ranks whose rank function has returned
        self._chaos = chaos
        self._random = random.Random(chaos.seed) if chaos else None
        self._last_due = {}  # (src, dst) -> due time of its latest message

    def send(self, src: int, dst: int, data, tag: int = 0) -> None:
        self._check_send(src, dst, tag)
        self._check_caller(src, "send as")
        payload = as_payload(data)
        with self._cond:
            due = time.monotonic()
            if self._chaos is not None:
                # Random delay, but never before the pair's previous message.
                due = max(due + self._random.uniform(0, self._chaos.max_delay), self._last_due.get((src, dst), 0.0))
                self._last_due[(src, dst)] = due
            self.inboxes[dst].append(_Message(int(src), int(tag), payload, due))
            self._cond.notify_all()

    def recv(self, dst: int, src: int = ANY, tag: int = ANY) -> tuple[int, np.ndarray]:
        self._check_recv(dst, src, tag)
        self._check_caller(dst, "receive for")
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        with self._cond:
            self._waiting[dst] = (src, tag)
            try:
                while True:
                    if self._abort_reason is not None:
                        raise Aborted(self._abort_reason)
                    now = time.monotonic()
                    message, next_due = self._oldest_match(dst, src, tag, now)
                    if message is not None:
                        self.inboxes[dst].remove(message)
                        return message.src, message.payload
                    if next_due is None and self._deadlocked():
                        reason = "deadlock: every rank still running waits for a message no rank will send; " + self._states()
                        self._abort_locked(reason)
                        raise DeadlockError(reason)
                    if deadline is not None and now >= deadline:
                        raise CommTimeout(
                            f"rank {dst} waited {self.timeout:g} s in recv for a message "
                            f"{describe_wait(src, tag)}; {self._states()}"
                        )
                    wake_at = [t for t in (next_due, deadline) if t is not None]
                    self._cond.wait(min(wake_at) - now if wake_at else None)
            finally:
                del self._waiting[dst]

    def abort(self, reason: str) -> None:
        """Make every current and future `recv` raise Aborted(reason)."""
        with self._cond:
            self._abort_locked(reason)

    def bind_thread(self, rank: int) -> None:
        """Declare that the calling thread runs rank `rank` (run_threads does this)."""
        with self._cond:
            self._rank_of_thread[threading.get_ident()] = rank

    def finished(self, rank: int) -> None:
        """Declare that rank `rank`'s function returned: it will send nothing more."""
        with self._cond:
            self._finished.add(rank)
            self._cond.notify_all()  # waiters re-check for a deadlock

    def _abort_locked(self, reason: str) -> None:
        if self._abort_reason is None:
            self._abort_reason = reason
        self._cond.notify_all()

    def _oldest_match(self, dst, src, tag, now):
        """(oldest due message matching, None) or (None, due time of the first one still delayed)."""
        next_due = None
        for message in self.inboxes[dst]:
            if src in (ANY, message.src) and tag in (ANY, message.tag):
                if message.due <= now:
                    return message, None
                next_due = message.due if next_due is None else min(next_due, message.due)
        return None, next_due

    def _deadlocked(self) -> bool:
        """True if all ranks started, each finished or waits, and no wait can be met."""
        started = set(self._rank_of_thread.values())
        if len(started) < self.num_devices:
            return False  # ranks run outside run_threads: we cannot know
        if any(r not in self._finished and r not in self._waiting for r in range(self.num_devices)):
            return False  # a rank is still computing and may send
        return all(self._oldest_match(r, s, t, float("inf"))[0] is None for r, (s, t) in self._waiting.items())

    def _states(self) -> str:
        def state(rank):
            if rank in self._waiting:
                return f"rank {rank} waits in recv for a message {describe_wait(*self._waiting[rank])}"
            return f"rank {rank} finished" if rank in self._finished else f"rank {rank} is running"

        return "; ".join(state(r) for r in range(self.num_devices))

    def _check_caller(self, rank: int, action: str) -> None:
        own = self._rank_of_thread.get(threading.get_ident())
        if own is not None and own != rank:
            raise ValueError(f"rank {own} cannot {action} rank {rank}")


def run_threads(num_devices: int, rank_fn, timeout: float | None = DEFAULT_TIMEOUT, chaos: Chaos | None = None) -> list:
    """Run `rank_fn(comm, rank)` on one thread per rank and return their results.

    If any rank raises (a deadlock or a timeout included), the others' waits
    are aborted and RankFailure for the first rank that failed is raised, with
    its exception as `__cause__`. `timeout` and `chaos` go to the Communicator.
    """
    comm = Communicator(num_devices, timeout=timeout, chaos=chaos)
    results = [None] * comm.num_devices
    failures = []  # (rank, exception), in the order they happened

    def body(rank: int) -> None:
        comm.bind_thread(rank)
        try:
            results[rank] = rank_fn(comm, rank)
        except BaseException as exc:  # noqa: BLE001 - reported to the caller below
            failures.append((rank, exc))
            comm.abort(f"rank {rank} failed: {type(exc).__name__}: {exc}")
        finally:
            comm.finished(rank)

    threads = [
        threading.Thread(target=body, args=(rank,), name=f"spmd-rank-{rank}", daemon=True)
        for rank in range(comm.num_devices)
    ]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            thread.join()
    except BaseException:  # e.g. Ctrl-C in the caller: release every rank first
        comm.abort("the launching thread was interrupted")
        raise
    if failures:
        # The first failure that is not a consequence of another rank's abort.
        rank, exc = next(((r, e) for r, e in failures if not isinstance(e, Aborted)), failures[0])
        raise RankFailure(rank, exc) from exc
    return results
