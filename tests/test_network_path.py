"""The network path: `make test-network` runs the MPI tests and the main jobs with NETWORK_ENV, where MPICH
treats every rank as on a node of its own (no shared memory between ranks) and UCX carries messages over
TCP sockets. Here: that this environment really does that, and that the BLAS share still sees one host."""

import os
import subprocess
import sys

NETWORK_ENV = {"MPIR_CVAR_NOLOCAL": "1", "UCX_TLS": "tcp,self"}  # keep in step with the Makefile

PROGRAM = """
from mpi4py import MPI
from spmd.transport.mpi import ranks_on_this_host
node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
sizes = MPI.COMM_WORLD.gather((node.Get_size(), ranks_on_this_host(MPI.COMM_WORLD)))
if sizes is not None:
    print(sizes)
"""


def node_sizes(mpiexec, env: dict) -> str:
    """Per rank, (ranks MPI says share its memory, ranks on its host), as rank 0 prints them."""
    run = subprocess.run(
        [mpiexec, "-n", "3", sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=60, env=env
    )
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


def test_the_network_environment_gives_every_rank_a_node_of_its_own(mpiexec):
    # MPI nodes of one rank each; one host of three ranks for the BLAS share
    assert node_sizes(mpiexec, {**os.environ, **NETWORK_ENV}) == str([(1, 3)] * 3)


def test_without_it_the_ranks_share_memory(mpiexec):
    env = {name: value for name, value in os.environ.items() if name not in NETWORK_ENV}
    assert node_sizes(mpiexec, env) == str([(3, 3)] * 3)
