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

from spmd.stopwatch import part
from spmd.transport.clock import now_us
from spmd.transport.comm import (
    ANY,
    DEFAULT_TIMEOUT,
    Aborted,
    BaseCommunicator,
    CommTimeout,
    DeadlockError,
    RankFailure,
    Request,
    as_payload,
    check_message,
    describe_wait,
    numeric_array,
)
from spmd.transport.cores import blas_threads, blas_threads_per_rank


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


@dataclass(eq=False)
class _Message:
    src: int
    dst: int
    tag: int
    payload: np.ndarray
    due: float = 0.0  # time.monotonic() from which the receiver may take it (set when posted)
    borrowed: bool = False  # payload is the sender's own array (isend): copy it out
    taken: bool = False  # the receiver has its copy: an isend of it is complete


class Communicator(BaseCommunicator):
    """Models communication between devices with one in-process inbox each.

    Args:
        num_devices: number of ranks (>= 1).
        timeout: seconds a wait (recv, or a request's wait) may last before it
            fails with CommTimeout (None: forever). Deadlocks among ranks started
            by `run_threads` are diagnosed at once, without waiting for it.
        chaos: a Chaos, to deliver messages late and out of order between senders.
    """

    def __init__(self, num_devices: int, timeout: float | None = DEFAULT_TIMEOUT, chaos: Chaos | None = None):
        super().__init__(num_devices)
        self.timeout = timeout
        self.inboxes: list[list[_Message]] = [[] for _ in range(self.num_devices)]  # per rank, oldest first
        self._cond = threading.Condition()  # guards everything below and the inboxes
        self._abort_reason: str | None = None
        self._rank_of_thread: dict[int, int] = {}  # thread id -> rank, for threads started by run_threads
        self._waiting: dict[int, tuple] = {}  # rank -> (what it waits for, can it be met without anyone acting?)
        self._finished: set[int] = set()  # ranks whose rank function has returned
        self._chaos = chaos
        self._random = random.Random(chaos.seed) if chaos else None
        self._last_due: dict[tuple[int, int], float] = {}  # (src, dst) -> due time of its latest message

    def send(self, src: int, dst: int, data, tag: int = 0) -> None:
        self._check_send(src, dst, tag)
        self._check_caller(src, "send as")
        self._post(_Message(int(src), int(dst), int(tag), as_payload(data)))

    def isend(self, src: int, dst: int, data: np.ndarray, tag: int = 0) -> Request:
        self._check_send(src, dst, tag)
        self._check_caller(src, "send as")
        message = _Message(int(src), int(dst), int(tag), numeric_array(data), borrowed=True)
        self._post(message)
        return _SendRequest(self, message)

    def recv(self, dst: int, src: int = ANY, tag: int = ANY) -> tuple[int, np.ndarray]:
        self._check_recv(dst, src, tag)
        self._check_caller(dst, "receive for")
        start = now_us()
        with self._cond:
            message = self._wait_for_message(dst, src, tag)
        payload = message.payload.copy() if message.borrowed else message.payload
        self._mark_taken(message)
        self.traffic(dst).record_receive(message.src, message.tag, payload.nbytes)
        self._trace(dst, f"recv from {message.src}", "wait", start, tag=message.tag, bytes=payload.nbytes)
        return message.src, payload

    def irecv(self, dst: int, src: int, tag: int, out: np.ndarray) -> Request:
        self._check_irecv(dst, src, tag, out)
        self._check_caller(dst, "receive for")
        return _RecvRequest(self, dst, src, tag, out)

    def abort(self, reason: str) -> None:
        """Make every current and future wait raise Aborted(reason)."""
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

    def _post(self, message: _Message) -> None:
        start = now_us()
        with self._cond:
            message.due = time.monotonic()
            if self._chaos is not None and self._random is not None:
                # Random delay, but never before the pair's previous message.
                pair = (message.src, message.dst)
                delay = self._random.uniform(0, self._chaos.max_delay)
                message.due = max(message.due + delay, self._last_due.get(pair, 0.0))
                self._last_due[pair] = message.due
            self.inboxes[message.dst].append(message)
            self._cond.notify_all()
        self.traffic(message.src).record_send(message.dst, message.tag, message.payload.nbytes)
        self._trace(message.src, f"send to {message.dst}", "send", start, tag=message.tag, bytes=message.payload.nbytes)

    def _mark_taken(self, message: _Message) -> None:
        with self._cond:
            message.taken = True
            self._cond.notify_all()  # wakes the sender's isend wait

    def _take(self, dst, src, tag, now):
        """Remove and return (the oldest due matching message, None), or (None, next due time)."""
        next_due = None
        for message in self.inboxes[dst]:
            if src in (ANY, message.src) and tag in (ANY, message.tag):
                if message.due <= now:
                    self.inboxes[dst].remove(message)
                    return message, None
                next_due = message.due if next_due is None else min(next_due, message.due)
        return None, next_due

    def _has_match(self, dst, src, tag) -> bool:
        return any(src in (ANY, m.src) and tag in (ANY, m.tag) for m in self.inboxes[dst])

    def _wait_for_message(self, dst, src, tag) -> _Message:
        return self._wait(
            dst,
            f"in recv for a message {describe_wait(src, tag)}",
            attempt=lambda now: self._take(dst, src, tag, now),
            can_be_met=lambda: self._has_match(dst, src, tag),
        )

    def _wait(self, rank: int, what: str, attempt, can_be_met):
        """_block, counted as the rank's "comm" (spmd.stopwatch)."""
        with part("comm"):
            return self._block(rank, what, attempt, can_be_met)

    def _block(self, rank: int, what: str, attempt, can_be_met):
        """Block `rank` (lock held) until attempt(now) returns (result, _) with a result.

        attempt(now) -> (result or None, time it may succeed or None);
        can_be_met() says whether the wait could end without any rank acting,
        for the deadlock check. Raises Aborted, DeadlockError or CommTimeout.
        """
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        self._waiting[rank] = (what, can_be_met)
        try:
            while True:
                if self._abort_reason is not None:
                    raise Aborted(self._abort_reason)
                now = time.monotonic()
                result, retry_at = attempt(now)
                if result is not None:
                    return result
                if retry_at is None and self._deadlocked():
                    reason = f"deadlock: every rank still running waits for something no rank will do; {self._states()}"
                    self._abort_locked(reason)
                    raise DeadlockError(reason)
                if deadline is not None and now >= deadline:
                    raise CommTimeout(f"rank {rank} waited {self.timeout:g} s {what}; {self._states()}")
                wake_at = [t for t in (retry_at, deadline) if t is not None]
                self._cond.wait(min(wake_at) - now if wake_at else None)
        finally:
            del self._waiting[rank]

    def _abort_locked(self, reason: str) -> None:
        if self._abort_reason is None:
            self._abort_reason = reason
        self._cond.notify_all()

    def _deadlocked(self) -> bool:
        """True if all ranks started, each finished or waits, and no wait can be met."""
        started = set(self._rank_of_thread.values())
        if len(started) < self.num_devices:
            return False  # ranks run outside run_threads: we cannot know
        if any(r not in self._finished and r not in self._waiting for r in range(self.num_devices)):
            return False  # a rank is still computing and may send
        return not any(can_be_met() for _, can_be_met in self._waiting.values())

    def _states(self) -> str:
        def state(rank):
            if rank in self._waiting:
                return f"rank {rank} waits {self._waiting[rank][0]}"
            return f"rank {rank} finished" if rank in self._finished else f"rank {rank} is running"

        return "; ".join(state(r) for r in range(self.num_devices))

    def _check_caller(self, rank: int, action: str) -> None:
        own = self._rank_of_thread.get(threading.get_ident())
        if own is not None and own != rank:
            raise ValueError(f"rank {own} cannot {action} rank {rank}")


class _SendRequest(Request):
    """An isend: complete once the receiver has copied the message out."""

    def __init__(self, comm: Communicator, message: _Message):
        self._comm, self._message = comm, message

    def test(self) -> bool:
        with self._comm._cond:
            return self._message.taken

    def needs_progress(self) -> bool:
        return False  # the receiver copies the message out; nothing the sender does speeds that up

    def wait(self) -> None:
        m, start = self._message, now_us()
        with self._comm._cond:
            self._comm._wait(
                m.src,
                f"for rank {m.dst} to receive its message (tag {m.tag})",
                attempt=lambda now: (True if m.taken else None, None),
                can_be_met=lambda: m.taken,
            )
        self._comm._trace(m.src, f"wait: rank {m.dst} receives", "wait", start, tag=m.tag)


class _RecvRequest(Request):
    """An irecv: takes the matching message and copies it into `out`."""

    def __init__(self, comm: Communicator, dst: int, src: int, tag: int, out: np.ndarray):
        self._comm, self._dst, self._src, self._tag, self._out = comm, dst, src, tag, out
        self._done, self._posted = False, now_us()

    def test(self) -> bool:
        if not self._done:
            with self._comm._cond:
                message, _ = self._comm._take(self._dst, self._src, self._tag, time.monotonic())
            if message is not None:
                self._deliver(message)
        return self._done

    def wait(self) -> tuple[int, np.ndarray]:
        start = now_us()
        if not self._done:
            with self._comm._cond:
                message = self._comm._wait_for_message(self._dst, self._src, self._tag)
            self._deliver(message)
        self._comm._trace(self._dst, f"wait: recv from {self._src}", "wait", start, tag=self._tag)
        return self._src, self._out

    def _deliver(self, message: _Message) -> None:
        try:
            got = (message.payload.dtype, message.payload.shape)
            check_message(self._dst, message.src, message.tag, got, self._out)
            np.copyto(self._out, message.payload)  # outside the lock: other ranks go on
        finally:
            self._comm._mark_taken(message)
        self._comm.traffic(self._dst).record_receive(message.src, message.tag, self._out.nbytes)
        self._comm._trace(
            self._dst, f"transfer from {message.src}", "transfer", self._posted, tag=message.tag, bytes=self._out.nbytes
        )
        self._done = True


def run_threads(
    num_devices: int,
    rank_fn,
    timeout: float | None = DEFAULT_TIMEOUT,
    chaos: Chaos | None = None,
    blas: int | None = None,
) -> list:
    """Run `rank_fn(comm, rank)` on one thread per rank and return their results.

    If any rank raises (a deadlock or a timeout included), the others' waits
    are aborted and RankFailure for the first rank that failed is raised, with
    its exception as `__cause__`. `timeout` and `chaos` go to the Communicator.
    `blas`: BLAS threads per rank (default: this process's cores / ranks, at least 1).
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
    with blas_threads(blas or blas_threads_per_rank(comm.num_devices)):
        for thread in threads:
            thread.start()
        try:
            for thread in threads:
                thread.join()
        except BaseException:  # e.g. Ctrl-C in the caller: release every rank first
            comm.abort("the launching thread was interrupted")
            # and let them leave their BLAS calls before blas_threads resets the pool: OpenBLAS can hang when
            # its thread count changes under a running call (a rank sees the abort at its next message)
            deadline = time.monotonic() + 10
            for thread in threads:
                thread.join(max(0.0, deadline - time.monotonic()))
            raise
    if failures:
        # The first failure that is not a consequence of another rank's abort.
        rank, exc = next(((r, e) for r, e in failures if not isinstance(e, Aborted)), failures[0])
        raise RankFailure(rank, exc) from exc
    return results
