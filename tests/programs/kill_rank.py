"""An SPMD program whose rank 1 is killed by SIGKILL while the others wait for it.

    mpiexec -n 3 python tests/programs/kill_rank.py
must end with a non-zero status, not hang.
"""

import os
import signal

from spmd.transport.mpi import run_mpi


def rank_fn(comm, rank):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    comm.recv(rank, src=1)  # never satisfied: only the launcher can end this wait


if __name__ == "__main__":
    run_mpi(rank_fn)
