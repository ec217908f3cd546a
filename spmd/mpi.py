"""The MPI backend: the same Communicator interface over mpi4py, and its launcher.

mpi4py is imported only inside this module's functions: importing it
initializes MPI, which the threads path must never do.
"""

import os
import sys
import time

import numpy as np

from spmd.comm import ANY, BaseCommunicator, failure_message, numeric_array
from spmd.wire import pack, unpack

# Environment variables that MPI launchers set in every process they start
# (MPICH/Hydra and PMIx-based Open MPI; Slurm's srun with PMI).
_LAUNCHER_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK")
ABORT_GRACE_SECONDS = 0.5


def launched_by_mpirun() -> bool:
    """True if an MPI launcher started this process (without importing MPI)."""
    return any(var in os.environ for var in _LAUNCHER_VARS)


def wait_politely(is_done, on_poll=None) -> None:
    """Poll `is_done()` until true, sleeping between polls with a growing backoff.

    MPI's own blocking waits spin on a core; with more ranks than cores that
    spinning slows the ranks that compute. Sleeping costs at most ~1 ms latency.
    """
    pause = 0.0
    while not is_done():
        if on_poll is not None:
            on_poll()
        if pause:
            time.sleep(pause)
        pause = min(max(pause * 2, 2e-5), 1e-3)


class MPICommunicator(BaseCommunicator):
    """Point-to-point messages over a private copy of an mpi4py communicator.

    The copy (default: of COMM_WORLD) keeps our messages apart from any other
    traffic of the program; `close` frees it.

    `send` posts a non-blocking send of a private copy and returns at once, as
    the in-process queues do, so a ring of sends before receives cannot
    deadlock at any message size. Each array travels as one buffer message.
    """

    def __init__(self, mpi_comm=None):
        from mpi4py import MPI

        self._mpi = MPI
        self._comm = (MPI.COMM_WORLD if mpi_comm is None else mpi_comm).Dup()
        self.num_devices = self._comm.Get_size()
        self.rank = self._comm.Get_rank()
        self._in_flight = []  # (request, packet) of sends not yet complete

    def send(self, src: int, dst: int, data, tag: int = 0) -> None:
        self._check_send(src, dst, tag)
        self._check_own("send as", src)
        packet = pack(numeric_array(data))  # the one copy: the sender may reuse `data` at once
        self._in_flight.append((self._comm.Isend(packet, dest=dst, tag=tag), packet))
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

        wait_politely(probe, on_poll=self._forget_completed_sends)
        packet = np.empty(status.Get_count(self._mpi.BYTE), dtype=np.uint8)
        request = found[0].Irecv(packet)
        wait_politely(request.Test)
        return status.Get_source(), unpack(packet)

    def close(self) -> None:
        """Wait until every message this rank sent has been delivered; free the channel.

        Collective: every rank of the communicator calls it.
        """
        wait_politely(lambda: not self._forget_completed_sends())
        self._comm.Free()

    def _forget_completed_sends(self) -> list:
        """Drop the sends that have completed; return those still in flight."""
        self._in_flight = [(req, packet) for req, packet in self._in_flight if not req.Test()]
        return self._in_flight

    def _check_own(self, action: str, rank: int) -> None:
        if rank != self.rank:
            raise ValueError(f"rank {self.rank} cannot {action} rank {rank}")


def run_mpi(rank_fn):
    """Run `rank_fn(comm, rank)` as this process's rank of MPI_COMM_WORLD.

    If it raises, print the rank's traceback and abort the whole job, so no
    other rank is left waiting for a message that will never come.
    """
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    comm = MPICommunicator(world)
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
