"""Each collective against its reference, on threads and on MPI, at several sizes."""

import time

import numpy as np
import pytest

from spmd.transport.group import Group
from spmd.collectives.reference import gather_ref, ring_allgather_ref
from spmd.collectives import (
    barrier,
    gather,
    gather_rows,
    ring_allgather,
)
from spmd.transport.comm import CommError
from spmd.transport.threads import Chaos, run_threads


def rank_blocks(size, rows, cols_of):
    """Every rank's block, the same on every rank: rank r's is (rows, cols_of(r)), filled with r."""
    rng = np.random.default_rng(size)
    return [rng.standard_normal((rows, cols_of(r))) + r for r in range(size)]


WIDTHS = {
    "even": lambda r: 3,
    "uneven": lambda r: 1 + r % 3,
    "some-empty": lambda r: r % 2,
    "large": lambda r: 1100,  # 8.8 KB and up per row-block: past the eager limit
}


def ring_matches_ref(comm, rank, widths, overlap):
    blocks = rank_blocks(comm.num_devices, 4, WIDTHS[widths])
    shape_of = lambda owner: (4, WIDTHS[widths](owner))  # noqa: E731
    got = []
    for owner, block, progress in ring_allgather(Group.world(comm, rank), blocks[rank], shape_of, overlap=overlap):
        progress()
        got.append((owner, block.copy()))
    want = ring_allgather_ref(blocks)[rank]
    assert [owner for owner, _ in got] == [owner for owner, _ in want]
    for (_, g), (_, w) in zip(got, want):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("widths", sorted(WIDTHS))
def test_ring_allgather(world, widths, overlap):
    world.run(ring_matches_ref, widths, overlap)


def gather_matches_ref(comm, rank, root):
    root %= comm.num_devices
    blocks = rank_blocks(comm.num_devices, 2, WIDTHS["uneven"])
    got = gather(Group.world(comm, rank), blocks[rank], root=root)
    want = gather_ref(blocks, root=root)[rank]
    if want is None:
        assert got is None
    else:
        assert len(got) == len(want)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("root", [0, 1, 2])
def test_gather(world, root):
    world.run(gather_matches_ref, root)


def back_to_back_gathers_stay_apart(comm, rank):
    """A rank may send its block of the next gather before the root has finished this one."""
    for round_ in range(5):
        got = gather(Group.world(comm, rank), np.array([rank, round_]))
        if got is not None:
            assert [g.tolist() for g in got] == [[r, round_] for r in range(comm.num_devices)]


def test_consecutive_gathers(world):
    world.run(back_to_back_gathers_stay_apart)


def test_consecutive_gathers_under_chaos():
    for seed in range(10):
        run_threads(4, back_to_back_gathers_stay_apart, chaos=Chaos(seed=seed, max_delay=0.003))


def gather_rows_stacks_in_rank_order(comm, rank):
    rows = np.full((rank % 3, 4), rank, dtype=np.int32)  # some ranks have no rows
    got = gather_rows(Group.world(comm, rank), rows)
    if rank == 0:
        want = np.concatenate([np.full((r % 3, 4), r, dtype=np.int32) for r in range(comm.num_devices)])
        np.testing.assert_array_equal(got, want)
        assert got.dtype == np.int32


def test_gather_rows(world):
    world.run(gather_rows_stacks_in_rank_order)


def gather_rows_refuses_wrong_columns(comm, rank):
    rows = np.zeros((1, 4 if rank == 0 else 5))
    if rank == 0 and comm.num_devices > 1:
        with pytest.raises(CommError, match="expected a row block of 4 columns of float64 from rank 1"):
            gather_rows(Group.world(comm, rank), rows)
    else:
        gather_rows(Group.world(comm, rank), rows)


def test_gather_rows_names_a_rank_that_sent_the_wrong_shape(world):
    world.run(gather_rows_refuses_wrong_columns)


def nobody_leaves_the_barrier_before_everyone_entered(comm, rank):
    """Ranks enter at staggered times; every exit must come after the last entry.

    Uses the wall clock, which all ranks on one machine share.
    """
    time.sleep(0.02 * rank)
    entered = time.time()
    barrier(Group.world(comm, rank))
    left = time.time()
    times = gather(Group.world(comm, rank), np.array([entered, left]))
    if times is not None:
        assert max(t[0] for t in times) <= min(t[1] for t in times)


def test_barrier(world):
    world.run(nobody_leaves_the_barrier_before_everyone_entered)
