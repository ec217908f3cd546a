"""An SPMD program whose rank 1 raises while every other rank waits for it.

    mpiexec -n 3 python tests/programs/raise_on_rank.py
must end at once with rank 1's traceback and a non-zero status, not hang.
"""

from spmd.transport.mpi import run_mpi


def rank_fn(comm, rank):
    if rank == 1:
        raise ValueError("injected failure on rank 1")
    comm.recv(rank, src=1)  # never satisfied: only the abort can end this wait


if __name__ == "__main__":
    run_mpi(rank_fn)
