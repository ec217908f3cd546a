"""Nothing hangs: deadlocks and lost messages end in an error that says who waits for whom."""

import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from spmd import RankFailure, run_threads
from spmd.matmul.fsdp import fsdp_rank
from spmd.transport.comm import CommError, CommTimeout, DeadlockError
from spmd.transport.group import Group

PROGRAMS = Path(__file__).parent / "programs"


def test_a_ring_of_receives_is_diagnosed_as_a_deadlock_at_once():
    def everyone_receives_first(comm, rank):
        comm.recv(rank, src=(rank - 1) % comm.num_devices, tag=1)

    with pytest.raises(RankFailure) as info:
        run_threads(3, everyone_receives_first, timeout=None)  # no timeout: the diagnosis alone ends it
    assert isinstance(info.value.__cause__, DeadlockError)
    text = str(info.value.__cause__)
    for rank, src in ((0, 2), (1, 0), (2, 1)):
        assert f"rank {rank} waits in recv for a message from rank {src} (tag 1)" in text


def test_waiting_for_a_rank_that_finished_is_a_deadlock_naming_it():
    def rank_fn(comm, rank):
        if rank == 0:
            comm.recv(0, src=1, tag=5)

    with pytest.raises(RankFailure, match="DeadlockError") as info:
        run_threads(2, rank_fn, timeout=None)
    assert "rank 0 waits in recv for a message from rank 1 (tag 5); rank 1 finished" in str(info.value.__cause__)


def a_slow_peer_times_out_a_short_wait(comm, rank):
    """Rank 1 computes past rank 0's timeout: CommTimeout on rank 0, on either backend."""
    if comm.num_devices < 2:
        return
    if rank == 0:
        comm.timeout = 0.2
        with pytest.raises(CommTimeout, match="rank 0 waited 0.2 s in recv for a message from rank 1 \\(tag 8\\)"):
            comm.recv(0, src=1, tag=8)
        comm.timeout = 60
        comm.recv(0, src=1, tag=8)  # the message still arrives, and nothing else is lost
    elif rank == 1:
        time.sleep(0.6)
        comm.send(1, 0, np.zeros(2), tag=8)


def test_recv_timeout(world):
    world.run(a_slow_peer_times_out_a_short_wait)


def test_thread_timeout_says_what_every_rank_is_doing():
    def rank_fn(comm, rank):
        if rank == 0:
            comm.recv(0, src=1)
        elif rank == 1:
            time.sleep(1.0)  # still computing when rank 0 gives up

    with pytest.raises(RankFailure) as info:
        run_threads(3, rank_fn, timeout=0.2)
    text = str(info.value.__cause__)
    assert "rank 0 waited 0.2 s in recv for a message from rank 1 (any tag)" in text
    assert "rank 1 is running" in text


def test_a_rank_holding_a_shard_of_the_wrong_shape_says_so_before_sending_it():
    def rank_fn(comm, rank):
        width = 3 if rank == 1 else 2  # rank 1 holds one column too many
        fsdp_rank(Group.world(comm, rank), np.ones((2, 4)), np.ones((4, width)), (6, 6))

    with pytest.raises(RankFailure) as info:
        run_threads(3, rank_fn)
    assert isinstance(info.value.__cause__, ValueError)
    assert (
        "rank 1 holds A rows (2, 4) and B shard (4, 3), but C (6, 6) split over 3 ranks gives it (2, 4) and (4, 2)"
    ) in str(info.value)


def test_a_shard_of_the_wrong_dtype_in_flight_is_an_error_naming_both_ranks():
    def rank_fn(comm, rank):
        # Rank 1's shard is float32 when the others hold float64: rank 2 receives it.
        shard = np.ones((4, 2), dtype=np.float32 if rank == 1 else np.float64)
        fsdp_rank(Group.world(comm, rank), np.ones((2, 4)), shard, (6, 6))

    with pytest.raises(RankFailure) as info:
        run_threads(3, rank_fn)
    assert isinstance(info.value.__cause__, CommError)
    # Whichever of the two ranks that see the mismatch notices first reports it.
    assert re.search(
        r"rank 2 expected float64 \(4, 2\) from rank 1 \(tag 1\), got float32 \(4, 2\)"
        r"|rank 1 expected float32 \(4, 2\) from rank 0 \(tag 1\), got float64 \(4, 2\)",
        str(info.value),
    )


def run_program(mpiexec, ranks, program, limit=30):
    """Run a tests/programs script under mpiexec; `limit` turns a hang into a failure."""
    return subprocess.run(
        [mpiexec, "-n", str(ranks), sys.executable, str(PROGRAMS / program)],
        capture_output=True,
        text=True,
        timeout=limit,
    )


def test_mpi_recv_timeout_ends_the_job_saying_who_waited(mpiexec):
    done = run_program(mpiexec, 2, "never_sent.py")
    assert done.returncode != 0
    assert "rank 0 waited 1 s in recv for a message from rank 1 (tag 4)" in done.stderr


def test_a_rank_killed_by_a_signal_ends_the_mpi_job(mpiexec):
    done = run_program(mpiexec, 3, "kill_rank.py")
    assert done.returncode != 0
    assert "Killed (signal 9)" in done.stdout + done.stderr
