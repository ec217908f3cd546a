"""An SPMD program in which rank 0 waits for a message rank 1 never sends.

    mpiexec -n 2 python tests/programs/never_sent.py
must end after the 1-second receive timeout with a message saying who waited for whom.
"""

from spmd.transport.mpi import run_mpi


def rank_fn(comm, rank):
    if rank == 0:
        comm.recv(0, src=1, tag=4)


if __name__ == "__main__":
    run_mpi(rank_fn, timeout=1.0)
