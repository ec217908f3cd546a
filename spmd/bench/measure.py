"""One benchmark measurement: our multiply against numpy's, repetition by repetition.

Each repetition first times numpy's `a @ b` on all the node's cores, then
our multiply, so every ratio compares two runs a second apart. On MPI
(`mpiexec -n R python -m spmd.bench.measure '<json config>'`, one JSON line from
rank 0) rank 0 runs numpy while the other ranks wait without spinning. On
threads (`python -m spmd.bench.measure`, no mpiexec) numpy runs in the main
thread between `run_threads` calls (OpenBLAS takes its thread count only
from the main thread).
"""

import json
import sys
import time
import tracemalloc
from dataclasses import asdict, dataclass

import numpy as np

from spmd.bench.collectives import COLLECTIVES, timed_collective
from spmd.collectives import Workspace, alone_at_root, barrier, gather
from spmd.harness.job import OPERANDS
from spmd.matmul import get
from spmd.matmul.inputs import GeneratedInputs
from spmd.matmul.problem import Problem
from spmd.transport.cores import available_cores, blas_threads
from spmd.transport.group import Group
from spmd.transport.threads import run_threads

NUMPY_TURN_PAUSE = 0.02  # seconds between polls of ranks waiting out numpy's run


@dataclass(frozen=True)
class Measure:
    """What to time: a registered strategy or a collective (bench/collectives.py), n x n matrices of `dtype`."""

    strategy: str
    n: int
    dtype: str = "float64"
    reps: int = 5
    overlap: bool = True  # FSDP only: post the next shard's receive before multiplying
    backend: str = "mpi"  # or "threads"
    ranks: int = 1


@dataclass
class Blocks:
    """One rank's inputs, made once; rank 0 also holds all of A and B for numpy's run."""

    blocks: dict  # operand name -> this rank's block
    a_full: np.ndarray | None
    b_full: np.ndarray | None
    workspace: Workspace  # kept across repetitions, as a training loop keeps its buffers


def _problem(m: Measure) -> Problem:
    return Problem(m.n, m.n, m.n, np.dtype(m.dtype).itemsize)


def prepare(rank: int, size: int, m: Measure) -> Blocks:
    n, strategy = m.n, get(m.strategy)
    inputs = GeneratedInputs(n, n, n, np.dtype(m.dtype), seed=0)
    mesh = strategy.mesh(size)
    blocks = strategy.blocks(_problem(m), mesh, rank, lambda name, rows, cols: inputs.block(OPERANDS[name], rows, cols))
    if rank != 0:
        return Blocks(blocks, None, None, Workspace())
    return Blocks(blocks, inputs.block(0, (0, n), (0, n)), inputs.block(1, (0, n), (0, n)), Workspace())


def multiply(world: Group, m: Measure, blocks: Blocks):
    """One multiply of `m.strategy`; returns this rank's bytes sent so far."""
    strategy = get(m.strategy)
    options = {} if m.overlap else {"overlap": False}
    strategy.run(world, strategy.mesh(world.size), blocks.blocks, _problem(m), blocks.workspace, **options)
    return world.traffic().bytes_sent()


def numpy_seconds(blocks: Blocks) -> float:
    """numpy's `a @ b` on all of this node's cores (call from the process's main thread)."""
    assert blocks.a_full is not None and blocks.b_full is not None, "numpy's run is rank 0's"
    with blas_threads(available_cores()):
        start = time.perf_counter()
        blocks.a_full @ blocks.b_full
        return time.perf_counter() - start


def timed_rank(world: Group, m: Measure):
    """MPI: time `m.reps` multiplies, each after numpy's at rank 0; the results dict at rank 0."""
    if m.ranks != world.size:
        raise ValueError(f"the measure is for {m.ranks} ranks, but {world.size} were started")
    if m.strategy in COLLECTIVES:
        return timed_collective(world, m)
    blocks = prepare(world.rank, world.size, m)

    def numpy_turn():  # the others wait in long sleeps: frequent wake-ups would slow numpy's threads (unfair)
        return alone_at_root(world, lambda: numpy_seconds(blocks), pause=NUMPY_TURN_PAUSE)

    def our_turn():
        barrier(world)
        start = time.perf_counter()
        multiply(world, m, blocks)
        return time.perf_counter() - start

    numpy_turn(), our_turn()  # warm-up: BLAS buffers, first-touch pages, MPI connections
    sent_before = world.traffic().bytes_sent()
    pairs = [(numpy_turn(), our_turn()) for _ in range(m.reps)]
    sent = gather(world, np.array([(world.traffic().bytes_sent() - sent_before) // m.reps]))
    peaks = gather(world, np.array([_peak_bytes(world, m, blocks)]))
    if world.rank != 0:
        return None
    return {
        **asdict(m),
        "numpy_seconds": [p[0] for p in pairs],
        "seconds": [p[1] for p in pairs],
        "bytes_sent": [int(s[0]) for s in sent],
        "peak_bytes": [int(p[0]) for p in peaks],
    }


def _peak_bytes(world: Group, m: Measure, blocks: Blocks) -> int:
    """Bytes of arrays this rank holds at its peak during one multiply: inputs plus what it allocates.

    numpy reports its allocations to tracemalloc; that is process-wide, so the
    figure is one rank's only when each rank is a process. A fresh workspace,
    so that its buffers are counted.
    """
    barrier(world)
    blocks.workspace = Workspace()
    tracemalloc.start()
    try:
        multiply(world, m, blocks)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return sum(b.nbytes for b in blocks.blocks.values()) + peak


def timed_threads(m: Measure) -> dict:
    """Threads: each repetition is numpy in this (main) thread, then one `run_threads` call, as a user makes it."""
    blocks = [prepare(rank, m.ranks, m) for rank in range(m.ranks)]

    def ours() -> tuple[float, list[int]]:
        start = time.perf_counter()
        sent = run_threads(m.ranks, lambda comm, rank: multiply(Group.world(comm, rank), m, blocks[rank]))
        return time.perf_counter() - start, sent

    numpy_seconds(blocks[0]), ours()  # warm-up
    pairs = [(numpy_seconds(blocks[0]), ours()) for _ in range(m.reps)]
    return {
        **asdict(m),
        "numpy_seconds": [p[0] for p in pairs],
        "seconds": [p[1][0] for p in pairs],
        "bytes_sent": pairs[0][1][1],
        "peak_bytes": None,
    }  # tracemalloc cannot tell threads apart


def main(argv=None) -> int:
    from spmd.transport.mpi import run_mpi

    m = Measure(**json.loads((argv or sys.argv[1:])[0]))
    result = (
        timed_threads(m)
        if m.backend == "threads"
        else run_mpi(lambda comm, rank: timed_rank(Group.world(comm, rank), m))
    )
    if result is not None:
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
