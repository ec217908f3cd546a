"""A failing rank fails the whole run promptly, with its rank and traceback, on both backends."""

import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from spmd import RankFailure, run_threads
from spmd.collectives import ring_allgather
from spmd.transport.group import Group

PROGRAMS = Path(__file__).parent / "programs"


def rank_threads():
    return [t for t in threading.enumerate() if t.name.startswith("spmd-rank-")]


def fail_on_rank_2_mid_ring(comm, rank):
    for step, _ in enumerate(ring_allgather(Group.world(comm, rank), np.zeros(3), lambda owner: (3,))):
        if rank == 2 and step == 1:
            raise KeyError("injected")
    comm.recv(rank, src=2, tag=99)  # never sent: only the abort ends this wait


def test_thread_failure_names_the_rank_and_releases_the_others():
    with pytest.raises(RankFailure, match="rank 2 failed: KeyError") as info:
        run_threads(4, fail_on_rank_2_mid_ring)
    assert info.value.rank == 2
    assert isinstance(info.value.__cause__, KeyError)
    assert rank_threads() == []  # every rank thread has ended


def test_the_first_real_failure_is_reported_not_the_aborts_it_caused():
    def rank_fn(comm, rank):
        if rank == 0:
            comm.recv(0, src=3)  # aborted when rank 3 fails
        if rank == 3:
            raise RuntimeError("rank 3 broke")

    with pytest.raises(RankFailure, match="rank 3 failed: RuntimeError: rank 3 broke"):
        run_threads(4, rank_fn)


def test_many_failing_runs_leave_no_threads_behind():
    for _ in range(200):
        with pytest.raises(RankFailure):
            run_threads(3, fail_on_rank_2_mid_ring)
    assert rank_threads() == []


def test_mpi_failure_aborts_the_job_with_the_rank_traceback(mpiexec):
    done = subprocess.run(
        [mpiexec, "-n", "3", sys.executable, str(PROGRAMS / "raise_on_rank.py")],
        capture_output=True,
        text=True,
        timeout=60,  # a hang fails here instead of blocking CI
    )
    assert done.returncode != 0
    assert "spmd: rank 1 of 3 failed: ValueError: injected failure on rank 1" in done.stderr
    assert "Traceback (most recent call last)" in done.stderr
    assert 'raise ValueError("injected failure on rank 1")' in done.stderr


@pytest.mark.parametrize(
    "test, message",
    [
        ("test_failure", "spmd: rank 1 of 3 failed: AssertionError: deliberate failure on rank 1"),
        ("test_hang", "Timeout"),
    ],
)
def test_a_failing_or_hanging_mpi_test_ends_the_mpi_test_run(mpiexec, test, message):
    """The harness of `make test` itself: no MPI test can hang the suite or fail silently."""
    target = f"{PROGRAMS / 'world_test_that_fails.py'}::{test}"
    done = subprocess.run(
        [
            mpiexec,
            "-n",
            "3",
            sys.executable,
            "-m",
            "mpi4py",
            "-m",
            "pytest",
            "--with-mpi",
            "-x",
            "-q",
            "--timeout",
            "5",
            "-p",
            "no:cacheprovider",
            target,
        ],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert done.returncode != 0
    assert message in done.stdout + done.stderr


def test_a_skipped_test_fails_the_run():
    """`make test` never counts a check that did not run (a missing MPI, say) as passed."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(PROGRAMS / "a_skipping_check.py")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert "skipped: a check that did not run is a failure here" in done.stderr
