"""spmd: data-parallel and FSDP matrix multiplication as real SPMD programs.

One rank function per strategy runs unchanged on threads (the problem
statement's queue Communicator) or on MPI processes (mpi4py). This module
never imports mpi4py: importing that initializes MPI.
"""

import importlib

# Public name -> the module that defines it. Loaded on first use, so that
# `python -m spmd.fsdp` does not import spmd.fsdp twice.
_EXPORTS = {
    "ANY": "spmd.comm",
    "Aborted": "spmd.comm",
    "CommError": "spmd.comm",
    "RankFailure": "spmd.comm",
    "CommTimeout": "spmd.comm",
    "DeadlockError": "spmd.comm",
    "Communicator": "spmd.threads",
    "Chaos": "spmd.threads",
    "run_threads": "spmd.threads",
    "MPICommunicator": "spmd.mpi",
    "run_mpi": "spmd.mpi",
    "Workspace": "spmd.collectives",
    "Tracer": "spmd.trace",
    "compute_fn": "spmd.dp",
    "dp_mat_mul": "spmd.dp",
    "dp_rank": "spmd.dp",
    "fsdp_mat_mul": "spmd.fsdp",
    "fsdp_rank": "spmd.fsdp",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'spmd' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__():
    return __all__
