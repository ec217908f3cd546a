"""The MPI backend: the same Communicator interface over mpi4py, and its launcher.

mpi4py is imported only inside this module's functions: importing it
initializes MPI, which the threads path must never do.
"""

import os
import sys
import time
from contextlib import contextmanager

import numpy as np

from spmd.interrupts import SIGINT_EXIT, SIGTERM_EXIT, Terminated
from spmd.stopwatch import part
from spmd.transport.clock import now_us
from spmd.transport.comm import (
    ANY,
    DEFAULT_TIMEOUT,
    BaseCommunicator,
    CommError,
    CommTimeout,
    Request,
    as_payload,
    check_message,
    describe_wait,
    failure_message,
    numeric_array,
)
from spmd.transport.cores import available_cores, blas_threads, blas_threads_per_rank
from spmd.transport.wire import HEADER_BYTES, as_bytes, pack_header, unpack_header

# Environment variables that MPI launchers set in every process they start
# (MPICH/Hydra and PMIx-based Open MPI; Slurm's srun with PMI).
_LAUNCHER_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK")
ABORT_GRACE_SECONDS = 0.5
YIELDING_POLLS = 50  # polls before the first sleep: short waits stay fast
MIN_PAUSE, MAX_PAUSE = 2e-5, 2.5e-4  # seconds of sleep between later polls
WAIT_MODES = ("spin", "yield", "sleep")  # see MPICommunicator.wait_mode


def launched_by_mpirun() -> bool:
    """True if an MPI launcher started this process (without importing MPI)."""
    return any(var in os.environ for var in _LAUNCHER_VARS)


def world_size() -> int | None:
    """The number of processes the MPI launcher started, read from its environment; None if unknown."""
    for var in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return None


def wait_politely(is_done, deadline: float | None, on_poll=None, max_pause: float | None = None) -> bool:
    """Poll `is_done()` until true (return True) or time.monotonic() passes `deadline` (False).

    MPI's own blocking waits spin on a core; with more ranks than cores that
    spinning slows the ranks that compute. So: a few polls that yield the
    core, then sleeps that grow to MAX_PAUSE, which bounds the added latency.
    """
    polls, pause, max_pause = 0, MIN_PAUSE, max_pause or MAX_PAUSE
    while not is_done():
        if deadline is not None and time.monotonic() > deadline:
            return False
        if on_poll is not None:
            on_poll()
        polls += 1
        if polls <= YIELDING_POLLS:
            time.sleep(0)  # yields the core to a rank that computes
        else:
            time.sleep(pause)
            pause = min(pause * 2, max_pause)
    return True


def wait_spinning(is_done, deadline: float | None, on_poll=None, between=None) -> bool:
    """Poll `is_done()` with no pause, as MPI's own waits do (True when done, False past `deadline`);
    `between()`, if given, runs between polls (os.sched_yield: let another process have the core).

    Each poll drives the transfer. Measured on the network path (UCX over TCP), pauses
    between polls made a 64 MB all-gather 10x slower than MPI_Allgather; spinning matches it.
    """
    polls = 0
    while not is_done():
        polls += 1
        if on_poll is not None:
            on_poll()
        if between is not None:
            between()
        if deadline is not None and polls % 1024 == 0 and time.monotonic() > deadline:
            return False
    return True


class MPICommunicator(BaseCommunicator):
    """Point-to-point messages over private copies of an mpi4py communicator.

    Two copies (default: of COMM_WORLD): one carries each message's header
    (dtype and shape), the other its bytes, sent straight from the array's
    buffer (see wire.py). Nothing of the program's other MPI traffic can match
    ours; `close` frees them.

    `send` posts non-blocking sends of a private copy and returns at once, as
    the in-process queues do, so a ring of sends before receives cannot
    deadlock at any message size. Every wait polls politely and times out.
    """

    def __init__(self, mpi_comm=None, timeout: float | None = DEFAULT_TIMEOUT):
        from mpi4py import MPI

        self._mpi = MPI
        base = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        super().__init__(base.Get_size())
        self._headers, self._data = base.Dup(), base.Dup()
        self.rank = base.Get_rank()
        self.timeout = timeout  # seconds one wait may last; None: forever
        self.max_pause = MAX_PAUSE  # longest sleep between polls: latency against wake-ups
        # How waits poll (run_mpi decides): "spin" when each rank has a core of its own; "yield" when ranks
        # share cores (sched_yield between polls lets a computing rank run, and each poll still drives
        # the transfer: over TCP, sleeping between polls made a 4-rank 64 MB all-gather 5x slower);
        # "sleep" (wait_politely) when something else must have the cores, as numpy in the benchmark.
        self.wait_mode = "sleep"
        self._sends: list[_Send] = []  # requests of `send` calls, completing in the background

    @contextmanager
    def quiet_waits(self, pause: float):
        saved = self.wait_mode, self.max_pause
        self.wait_mode, self.max_pause = "sleep", pause
        try:
            yield
        finally:
            self.wait_mode, self.max_pause = saved

    def _wait(self, is_done, deadline: float | None, on_poll=None) -> bool:
        """Wait as `wait_mode` says: "spin", "yield" (spin, giving the core away between polls) or "sleep"."""
        if self.wait_mode not in WAIT_MODES:
            raise ValueError(f"wait_mode must be one of {', '.join(WAIT_MODES)}, got {self.wait_mode!r}")
        with part("comm"):
            if self.wait_mode == "sleep":
                return wait_politely(is_done, deadline, on_poll, self.max_pause)
            return wait_spinning(is_done, deadline, on_poll, os.sched_yield if self.wait_mode == "yield" else None)

    def send(self, src: int, dst: int, data, tag: int = 0) -> None:
        self._check_send(src, dst, tag)
        self._check_own("send as", src)
        self._sends.append(self._start_send(dst, as_payload(data), tag))  # a copy: `data` is free at once
        self._forget_completed_sends()

    def isend(self, src: int, dst: int, data: np.ndarray, tag: int = 0) -> Request:
        self._check_send(src, dst, tag)
        self._check_own("send as", src)
        return self._start_send(dst, np.asarray(numeric_array(data), order="C"), tag)

    def recv(self, dst: int, src: int = ANY, tag: int = ANY) -> tuple[int, np.ndarray]:
        self._check_recv(dst, src, tag)
        self._check_own("receive for", dst)
        status, start = self._mpi.Status(), now_us()
        found = []  # the matched header message, once it has arrived

        def probe() -> bool:
            message = self._headers.Improbe(
                self._mpi.ANY_SOURCE if src == ANY else src, self._mpi.ANY_TAG if tag == ANY else tag, status
            )
            if message is not None:
                found.append(message)
            return message is not None

        deadline = self._deadline()
        if self._wait(probe, deadline, on_poll=self._forget_completed_sends):
            header = np.empty(HEADER_BYTES, dtype=np.uint8)
            found[0].Recv(header)  # matched and small: already here
            dtype, shape = unpack_header(header)
            sender, sent_tag = status.Get_source(), status.Get_tag()
            out = np.empty(shape, dtype=dtype)
            request = self._data.Irecv(as_bytes(out), sender, sent_tag)
            if self._wait(request.Test, deadline):
                self.traffic(dst).record_receive(sender, sent_tag, out.nbytes)
                self._trace(dst, f"recv from {sender}", "wait", start, tag=sent_tag, bytes=out.nbytes)
                return sender, out
        raise self._timeout_error(f"in recv for a message {describe_wait(src, tag)}")

    def irecv(self, dst: int, src: int, tag: int, out: np.ndarray) -> Request:
        self._check_irecv(dst, src, tag, out)
        self._check_own("receive for", dst)
        header = np.empty(HEADER_BYTES, dtype=np.uint8)
        header_request = self._headers.Irecv(header, src, tag)
        data_request = self._data.Irecv(as_bytes(out), src, tag)
        return _Recv(self, dst, src, tag, out, header, header_request, data_request)

    def close(self) -> None:
        """Wait until every message this rank sent has been received; free the channels.

        Collective: every rank of the communicator calls it.
        """
        if not wait_politely(lambda: not self._forget_completed_sends(), self._deadline()):
            unreceived = ", ".join(f"to rank {s.dst} (tag {s.tag})" for s in self._sends)
            raise self._timeout_error(f"for its sent messages to be received, but these never were: {unreceived}")
        self._headers.Free()
        self._data.Free()

    def _start_send(self, dst: int, array: np.ndarray, tag: int) -> "_Send":
        start, header = now_us(), pack_header(array.dtype, array.shape)
        requests = [self._headers.Isend(header, dst, tag), self._data.Isend(as_bytes(array), dst, tag)]
        self.traffic(self.rank).record_send(dst, tag, array.nbytes)
        self._trace(self.rank, f"send to {dst}", "send", start, tag=tag, bytes=array.nbytes)
        return _Send(self, dst, tag, requests, keep_alive=(header, array))

    def _forget_completed_sends(self) -> list:
        """Drop the `send`s that have completed; return those still in flight."""
        self._sends = [send for send in self._sends if not send.test()]
        return self._sends

    def _deadline(self) -> float | None:
        return None if self.timeout is None else time.monotonic() + self.timeout

    def _timeout_error(self, what: str) -> CommTimeout:
        return CommTimeout(
            f"rank {self.rank} waited {self.timeout:g} s {what} (under MPI a rank cannot see the others' states)"
        )

    def traffic(self, rank: int):
        self._check_own("see the traffic of", rank)  # the others' counters are in their processes
        return super().traffic(rank)

    def _check_own(self, action: str, rank: int) -> None:
        if rank != self.rank:
            raise ValueError(f"rank {self.rank} cannot {action} rank {rank}")


class _Send(Request):
    """A header and a data send in flight; the buffers stay alive until both complete."""

    def __init__(self, comm: MPICommunicator, dst: int, tag: int, requests: list, keep_alive: tuple):
        self._comm, self.dst, self.tag = comm, dst, tag
        self._requests, self._keep_alive = requests, keep_alive

    def test(self) -> bool:
        return all(request.Test() for request in self._requests)

    def wait(self) -> None:
        start = now_us()
        if not self._comm._wait(self.test, self._comm._deadline()):
            raise self._comm._timeout_error(f"for rank {self.dst} to receive its message (tag {self.tag})")
        self._comm._trace(self._comm.rank, f"wait: rank {self.dst} receives", "wait", start, tag=self.tag)


class _Recv(Request):
    """A header and a data receive posted into `out`; the header is checked before the data is used."""

    def __init__(self, comm, dst, src, tag, out, header, header_request, data_request):
        self._comm, self._dst, self._src, self._tag, self._out = comm, dst, src, tag, out
        self._header, self._header_request, self._data_request = header, header_request, data_request
        self._header_checked = self._done = False
        self._posted = now_us()

    def test(self) -> bool:
        if not self._header_checked:
            if not self._header_request.Test():
                return False
            try:
                check_message(self._dst, self._src, self._tag, unpack_header(self._header), self._out)
            except CommError:
                self._data_request.Cancel()  # what arrives does not fit: never read into `out`
                raise
            self._header_checked = True
        if self._done:
            return True
        if self._data_request.Test():
            self._comm.traffic(self._dst).record_receive(self._src, self._tag, self._out.nbytes)
            self._comm._trace(
                self._dst, f"transfer from {self._src}", "transfer", self._posted, tag=self._tag, bytes=self._out.nbytes
            )
            self._done = True
        return self._done

    def wait(self) -> tuple[int, np.ndarray]:
        start = now_us()
        if not self._comm._wait(self.test, self._comm._deadline()):
            raise self._comm._timeout_error(f"in irecv for a message {describe_wait(self._src, self._tag)}")
        self._comm._trace(self._dst, f"wait: recv from {self._src}", "wait", start, tag=self._tag)
        return self._src, self._out


def ranks_on_this_host(world) -> int:
    """How many ranks of `world` share this rank's host (and so its cores), by host name.

    Not MPI's shared-memory split: with MPIR_CVAR_NOLOCAL=1 (the network-path tests) MPICH
    puts every rank on a node of its own, yet they still share this machine's cores.
    """
    from mpi4py import MPI

    names = world.allgather(MPI.Get_processor_name())
    return names.count(MPI.Get_processor_name())


def stop_status(exc: BaseException) -> int:
    """The exit status of a rank the user stopped (Ctrl-C: 130, SIGTERM: 143), 0 for any other failure."""
    if isinstance(exc, KeyboardInterrupt):
        return SIGINT_EXIT
    return SIGTERM_EXIT if isinstance(exc, Terminated) else 0


def run_mpi(rank_fn, timeout: float | None = DEFAULT_TIMEOUT, blas: int | None = None, traceback: bool = True):
    """Run `rank_fn(comm, rank)` as this process's rank of MPI_COMM_WORLD.

    If it raises (a recv timeout included), print the rank's error (with its
    traceback unless traceback=False) and abort the whole job, so no other rank
    is left waiting for a message that will never come. A rank other than 0
    waits a moment before it prints: when every rank fails alike, rank 0's abort
    ends them first and the job prints one message, not one per rank.
    `timeout` goes to the MPICommunicator. `blas`: BLAS threads of this rank
    (default: the node's cores / its ranks, at least 1).
    """
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    comm = MPICommunicator(world, timeout=timeout)
    try:
        ranks_here = ranks_on_this_host(world)
        comm.wait_mode = "spin" if ranks_here <= available_cores() else "yield"
        with blas_threads(blas or blas_threads_per_rank(ranks_here)):
            result = rank_fn(comm, comm.rank)
        comm.close()
        return result
    except BaseException as exc:  # noqa: BLE001 - any failure must end the job
        sys.stdout.flush()
        stopped = stop_status(exc)
        if stopped:  # the launcher passed Ctrl-C or SIGTERM to every rank: one line, from rank 0, and out
            if comm.rank == 0:
                sys.stderr.write(f"\nspmd: stopped by {'SIGTERM' if stopped == SIGTERM_EXIT else 'Ctrl-C'}\n")
                sys.stderr.flush()
            os._exit(stopped)  # no MPI_Finalize: the other ranks are stopping too, mid-message
        if comm.rank != 0:
            time.sleep(2 * ABORT_GRACE_SECONDS)  # longer than rank 0's pause before its abort
        sys.stderr.write(failure_message(comm.rank, comm.num_devices, exc, traceback))
        sys.stderr.flush()
        # MPI_Abort kills every process at once; without a pause the launcher
        # can lose this traceback, which is still in the pipe (seen with Hydra).
        time.sleep(ABORT_GRACE_SECONDS)
        world.Abort(1)
