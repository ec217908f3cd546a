"""The in-process backend: one thread per rank, one inbox per rank.

This is the problem statement's `Communicator`, extended with tag/source
matching and with `abort`, which wakes every waiting rank when one fails.
"""

import threading

import numpy as np

from spmd.comm import (
    ANY,
    Aborted,
    BaseCommunicator,
    RankFailure,
    as_payload,
    check_num_devices,
)


class _Inbox:
    """The messages waiting for one rank, in arrival order."""

    def __init__(self):
        self._cond = threading.Condition()
        self._messages = []  # (src, tag, payload), oldest first
        self._abort_reason = None

    def put(self, src: int, tag: int, payload: np.ndarray) -> None:
        with self._cond:
            self._messages.append((src, tag, payload))
            self._cond.notify_all()

    def take(self, src: int, tag: int) -> tuple[int, np.ndarray]:
        with self._cond:
            while True:
                if self._abort_reason is not None:
                    raise Aborted(self._abort_reason)
                for i, (m_src, m_tag, payload) in enumerate(self._messages):
                    if src in (ANY, m_src) and tag in (ANY, m_tag):
                        del self._messages[i]
                        return m_src, payload
                self._cond.wait()

    def abort(self, reason: str) -> None:
        with self._cond:
            self._abort_reason = reason
            self._cond.notify_all()


class Communicator(BaseCommunicator):
    """Models communication between devices with one in-process inbox each.

    Args:
        num_devices: number of ranks (>= 1).
    """

    def __init__(self, num_devices: int):
        check_num_devices(num_devices)
        self.num_devices = int(num_devices)
        self.inboxes = [_Inbox() for _ in range(self.num_devices)]
        # thread id -> rank, filled by run_threads, so that a rank thread that
        # sends as, or receives for, another rank is caught.
        self._rank_of_thread = {}

    def send(self, src: int, dst: int, data, tag: int = 0) -> None:
        self._check_send(src, dst, tag)
        self._check_caller(src, "send as")
        self.inboxes[dst].put(int(src), int(tag), as_payload(data))

    def recv(self, dst: int, src: int = ANY, tag: int = ANY) -> tuple[int, np.ndarray]:
        self._check_recv(dst, src, tag)
        self._check_caller(dst, "receive for")
        return self.inboxes[dst].take(src, tag)

    def abort(self, reason: str) -> None:
        """Make every current and future `recv` raise Aborted(reason)."""
        for inbox in self.inboxes:
            inbox.abort(reason)

    def bind_thread(self, rank: int) -> None:
        """Declare that the calling thread runs rank `rank`."""
        self._rank_of_thread[threading.get_ident()] = rank

    def _check_caller(self, rank: int, action: str) -> None:
        own = self._rank_of_thread.get(threading.get_ident())
        if own is not None and own != rank:
            raise ValueError(f"rank {own} cannot {action} rank {rank}")


def run_threads(num_devices: int, rank_fn) -> list:
    """Run `rank_fn(comm, rank)` on one thread per rank and return their results.

    If any rank raises, the others' waits are aborted and RankFailure for the
    first rank that failed is raised, with its exception as `__cause__`.
    """
    comm = Communicator(num_devices)
    results = [None] * comm.num_devices
    failures = []  # (rank, exception), in the order they happened

    def body(rank: int) -> None:
        comm.bind_thread(rank)
        try:
            results[rank] = rank_fn(comm, rank)
        except BaseException as exc:  # noqa: BLE001 - reported to the caller below
            failures.append((rank, exc))
            comm.abort(f"rank {rank} failed: {type(exc).__name__}: {exc}")

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
