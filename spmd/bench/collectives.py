"""Our collectives against MPI's own on the same bytes: all-gather, reduce-scatter, all-reduce, all-to-all.

Each repetition times MPI's call, then ours, on one n x n float matrix's worth
of data; the ratio of the two is the row's figure (bandwidth of ours / MPI's).
"""

import time
from dataclasses import asdict

import numpy as np

from spmd.collectives import Workspace, all_gather, all_reduce, all_to_all, barrier, ring_allgather
from spmd.collectives.ring import reduce_scatter
from spmd.transport.group import Group


def _ring(world, data):
    for _ in ring_allgather(world, data["block"], lambda owner: data["block"].shape, workspace=data["workspace"]):
        pass


def _with_workspace(data: dict) -> dict:
    """Ours keep their scratch buffers across calls, as FSDP and the training steps do (MPI's are internal)."""
    return {**data, "workspace": Workspace()}


# name -> (make this rank's data from (n, dtype, rank, size), ours, MPI's on mpi4py's COMM_WORLD)
COLLECTIVES = {
    "ring": (  # the FSDP matmul's streaming ring, against MPI_Allgather
        lambda n, dt, r, d: _with_workspace(
            {"block": np.full((n * n // d,), float(r), dt), "out": np.empty(n * n, dt)}
        ),
        _ring,
        lambda w, data: w.Allgather(data["block"], data["out"]),
    ),
    "all_gather": (
        lambda n, dt, r, d: {"block": np.full((n * n // d,), float(r), dt), "out": np.empty(n * n, dt)},
        lambda world, data: all_gather(world, data["block"], out=data["out"]),
        lambda w, data: w.Allgather(data["block"], data["out"]),
    ),
    "reduce_scatter": (
        lambda n, dt, r, d: _with_workspace({"full": np.full((n * n,), float(r), dt), "out": np.empty(n * n // d, dt)}),
        lambda world, data: reduce_scatter(world, data["full"], workspace=data["workspace"], out=data["out"]),
        lambda w, data: w.Reduce_scatter_block(data["full"], data["out"]),
    ),
    "all_reduce": (
        lambda n, dt, r, d: _with_workspace({"full": np.full((n * n,), float(r), dt), "out": np.empty(n * n, dt)}),
        lambda world, data: all_reduce(world, data["full"], data["workspace"], out=data["out"]),
        lambda w, data: w.Allreduce(data["full"], data["out"]),
    ),
    "all_to_all": (
        lambda n, dt, r, d: {"full": np.full((n * n,), float(r), dt), "out": np.empty(n * n, dt)},
        lambda world, data: all_to_all(world, list(data["full"].reshape(world.size, -1))),
        lambda w, data: w.Alltoall(data["full"], data["out"]),
    ),
}


def timed_collective(world: Group, m) -> dict | None:
    """MPI only: `m.reps` pairs (MPI's call, ours), n x n elements of `m.dtype` in all; the dict at rank 0."""
    from mpi4py import MPI

    make, ours, theirs = COLLECTIVES[m.strategy]
    if (m.n * m.n) % world.size:
        raise ValueError(f"the {m.strategy} check needs n*n divisible by the ranks, got n={m.n} over {world.size}")
    data = make(m.n, np.dtype(m.dtype), world.rank, world.size)

    def seconds(call) -> float:
        barrier(world)
        start = time.perf_counter()
        call()
        return time.perf_counter() - start

    def ours_once():
        return seconds(lambda: ours(world, data))

    def mpi_once():
        return seconds(lambda: theirs(MPI.COMM_WORLD, data))

    ours_once(), mpi_once()  # warm-up
    pairs = [(mpi_once(), ours_once()) for _ in range(m.reps)]
    if world.rank != 0:
        return None
    return {
        **asdict(m),
        "bytes": m.n * m.n * np.dtype(m.dtype).itemsize,
        "mpi_seconds": [p[0] for p in pairs],
        "seconds": [p[1] for p in pairs],
    }
