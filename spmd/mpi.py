"""The MPI backend: the same Communicator interface over mpi4py, and its launcher.

mpi4py is imported only inside this module's functions: importing it
initializes MPI, which the threads path must never do.
"""

import os
import sys
import time

import numpy as np

from spmd.comm import (
    ANY,
    DEFAULT_TIMEOUT,
    BaseCommunicator,
    CommTimeout,
    describe_wait,
    failure_message,
    numeric_array,
)
from spmd.wire import pack, unpack

# Environment variables that MPI launchers set in every process they start
# (MPICH/Hydra and PMIx-based Open MPI; Slurm's srun with PMI).
_LAUNCHER_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK")
ABORT_GRACE_SECONDS = 0.5


def launched_by_mpirun() -> bool:
    """True if an MPI launcher started this process (without importing MPI)."""
    return any(var in os.environ for var in _LAUNCHER_VARS)


def wait_politely(is_done, deadline: float | None, on_poll=None) -> bool:
    """Poll `is_done()` until true (return True) or time.monotonic() passes `deadline` (False).

    MPI's own blocking waits spin on a core; with more ranks than cores that
    spinning slows the ranks that compute. Sleeping between polls, with a
    growing backoff, costs at most ~1 ms of latency.
    """
    pause = 0.0
    while not is_done():
        if deadline is not None and time.monotonic() > deadline:
            return False
        if on_poll is not None:
            on_poll()
        if pause:
            time.sleep(pause)
        pause = min(max(pause * 2, 2e-5), 1e-3)
    return True


class MPICommunicator(BaseCommunicator):
    """Point-to-point messages over a private copy of an mpi4py communicator.

    The copy (default: of COMM_WORLD) keeps our messages apart from any other
    traffic of the program; `close` frees it.

    `send` posts a non-blocking send of a private copy and returns at once, as
    the in-process queues do, so a ring of sends before receives cannot
    deadlock at any message size. Each array travels as one buffer message.
    """

    def __init__(self, mpi_comm=None, timeout: float | None = DEFAULT_TIMEOUT):
        from mpi4py import MPI

        self._mpi = MPI
        self._comm = (MPI.COMM_WORLD if mpi_comm is None else mpi_comm).Dup()
        self.num_devices = self._comm.Get_size()
        self.rank = self._comm.Get_rank()
        self.timeout = timeout  # seconds one recv (or close) may wait; None: forever
        self._in_flight = []  # (request, packet, dst, tag) of sends not yet complete

    def send(self, src: int, dst: int, data, tag: int = 0) -> None:
        self._check_send(src, dst, tag)
        self._check_own("send as", src)
        packet = pack(numeric_array(data))  # the one copy: the sender may reuse `data` at once
        self._in_flight.append((self._comm.Isend(packet, dest=dst, tag=tag), packet, dst, tag))
        self._forget_completed_sends()

    def recv(self, dst: int, src: int = ANY, tag: int = ANY) -> tuple[int, np.ndarray]:
        self._check_recv(dst, src, tag)
        self._check_own("receive for", dst)
        mpi_src = self._mpi.ANY_SOURCE if src == ANY else src
        mpi_tag = self._mpi.ANY_TAG if tag == ANY else tag
        status = self._mpi.Status()
        found = []  # the matched message, once it has arrived

        def probe() -> bool:
            message = self._comm.Improbe(mpi_src, mpi_tag, status)
            if message is not None:
                found.append(message)
            return message is not None

        deadline = self._deadline()
        if wait_politely(probe, deadline, on_poll=self._forget_completed_sends):
            packet = np.empty(status.Get_count(self._mpi.BYTE), dtype=np.uint8)
            request = found[0].Irecv(packet)
            if wait_politely(request.Test, deadline):
                return status.Get_source(), unpack(packet)
        raise CommTimeout(
            f"rank {dst} waited {self.timeout:g} s in recv for a message {describe_wait(src, tag)}; "
            f"none came (under MPI a rank cannot see the others' states)"
        )

    def close(self) -> None:
        """Wait until every message this rank sent has been delivered; free the channel.

        Collective: every rank of the communicator calls it.
        """
        if not wait_politely(lambda: not self._forget_completed_sends(), self._deadline()):
            unreceived = ", ".join(f"to rank {dst} (tag {tag})" for _, _, dst, tag in self._in_flight)
            raise CommTimeout(
                f"rank {self.rank} waited {self.timeout:g} s for its sent messages to be "
                f"received, but these never were: {unreceived}"
            )
        self._comm.Free()

    def _forget_completed_sends(self) -> list:
        """Drop the sends that have completed; return those still in flight."""
        self._in_flight = [send for send in self._in_flight if not send[0].Test()]
        return self._in_flight

    def _deadline(self) -> float | None:
        return None if self.timeout is None else time.monotonic() + self.timeout

    def _check_own(self, action: str, rank: int) -> None:
        if rank != self.rank:
            raise ValueError(f"rank {self.rank} cannot {action} rank {rank}")


def run_mpi(rank_fn, timeout: float | None = DEFAULT_TIMEOUT):
    """Run `rank_fn(comm, rank)` as this process's rank of MPI_COMM_WORLD.

    If it raises (a recv timeout included), print the rank's traceback and
    abort the whole job, so no other rank is left waiting for a message that
    will never come. `timeout` goes to the MPICommunicator.
    """
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    comm = MPICommunicator(world, timeout=timeout)
    try:
        result = rank_fn(comm, comm.rank)
        comm.close()
        return result
    except BaseException as exc:  # noqa: BLE001 - any failure must end the job
        sys.stdout.flush()
        sys.stderr.write(failure_message(comm.rank, comm.num_devices, exc))
        sys.stderr.flush()
        # MPI_Abort kills every process at once; without a pause the launcher
        # can lose this traceback, which is still in the pipe (seen with Hydra).
        time.sleep(ABORT_GRACE_SECONDS)
        world.Abort(1)
