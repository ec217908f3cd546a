"""spmd: the parallel patterns of large-model training as real SPMD programs.

One rank function per strategy runs unchanged on threads (the problem
statement's queue Communicator) or on MPI processes (mpi4py). Nothing here
imports mpi4py: importing that initializes MPI, and spmd.transport.mpi does it
only when an MPI run starts.
"""

import os

# OpenBLAS's idle threads spin for about 0.1 s after every call unless told otherwise, holding a core that a rank's
# own threads (spmd.split) and the other ranks need; 4 (2^4 cycles) puts them to sleep at once. Read when numpy
# loads OpenBLAS: a setting of the user's own, or numpy imported before spmd, wins.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

from spmd.collectives import Workspace
from spmd.harness.train_api import ComposedRun, train, train_mlp
from spmd.matmul import STRATEGIES
from spmd.matmul.dp import dp_rank
from spmd.matmul.fsdp import fsdp_rank
from spmd.matmul.statement import compute_fn, dp_mat_mul, fsdp_mat_mul
from spmd.transport.clock import Tracer
from spmd.transport.comm import ANY, Aborted, CommError, CommTimeout, DeadlockError, RankFailure
from spmd.transport.group import Group
from spmd.transport.mesh import Mesh
from spmd.transport.mpi import MPICommunicator, run_mpi
from spmd.transport.threads import Chaos, Communicator, run_threads

__all__ = [
    "ANY",
    "STRATEGIES",
    "Aborted",
    "Chaos",
    "CommError",
    "CommTimeout",
    "Communicator",
    "DeadlockError",
    "Group",
    "MPICommunicator",
    "Mesh",
    "RankFailure",
    "Tracer",
    "Workspace",
    "compute_fn",
    "dp_mat_mul",
    "dp_rank",
    "ComposedRun",
    "fsdp_mat_mul",
    "fsdp_rank",
    "run_mpi",
    "run_threads",
    "train",
    "train_mlp",
]
