"""A world test that fails on rank 1 and one that hangs, run by test_faults under mpiexec.

Not collected by the suite itself (its name is not test_*.py).
"""


def fails_on_rank_1(comm, rank):
    assert rank != 1, "deliberate failure on rank 1"
    comm.recv(rank, src=1)  # the other ranks wait for rank 1: only the abort ends this


def waits_forever(comm, rank):
    comm.recv(rank, src=0, tag=77)  # never sent


def test_failure(world):
    world.run(fails_on_rank_1)


def test_hang(world):
    world.run(waits_forever)
