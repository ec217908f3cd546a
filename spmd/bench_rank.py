"""One benchmark measurement: our multiply against numpy's, repetition by repetition.

Each repetition first times numpy's `a @ b` on all the node's cores, then
our multiply, so every ratio compares two runs a second apart. On MPI
(`mpiexec -n R python -m spmd.bench_rank '<json config>'`, one JSON line from
rank 0) rank 0 runs numpy while the other ranks wait without spinning. On
threads (`python -m spmd.bench_rank`, no mpiexec) numpy runs in the main
thread between `run_threads` calls (OpenBLAS takes its thread count only
from the main thread).
"""

import json
import sys
import time
import tracemalloc
from dataclasses import asdict, dataclass

import numpy as np

from spmd.collectives import Workspace, barrier, gather, ring_allgather
from spmd.cores import available_cores, blas_threads
from spmd.dp import dp_rank
from spmd.fsdp import fsdp_rank
from spmd.inputs import GeneratedInputs
from spmd.layout import block_range
from spmd.mpi import MAX_PAUSE
from spmd.threads import run_threads


NUMPY_TURN_PAUSE = 0.02  # seconds between polls of ranks waiting out numpy's run


@dataclass(frozen=True)
class Measure:
    """What to time: `strategy` ("dp", "fsdp" or "ring"), n x n matrices of `dtype`."""

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

    a_block: np.ndarray
    b_block: np.ndarray
    a_full: np.ndarray | None
    b_full: np.ndarray | None
    workspace: Workspace  # kept across repetitions, as a training loop keeps its buffers


def prepare(rank: int, size: int, m: Measure) -> Blocks:
    n = m.n
    inputs = GeneratedInputs(n, n, n, np.dtype(m.dtype), seed=0)
    cols = (0, n) if m.strategy == "dp" else block_range(n, size, rank)
    full = (inputs.block(0, (0, n), (0, n)), inputs.block(1, (0, n), (0, n))) if rank == 0 else (None, None)
    return Blocks(inputs.block(0, block_range(n, size, rank), (0, n)), inputs.block(1, (0, n), cols), *full,
                  Workspace())


def multiply(comm, rank: int, m: Measure, blocks: Blocks):
    """One multiply of `m.strategy`; returns this rank's bytes sent so far."""
    if m.strategy == "dp":
        dp_rank(comm, rank, blocks.a_block, blocks.b_block, m_rows=m.n, workspace=blocks.workspace)
    else:
        fsdp_rank(comm, rank, blocks.a_block, blocks.b_block, (m.n, m.n), overlap=m.overlap,
                  workspace=blocks.workspace)
    return comm.traffic(rank).bytes_sent()


def numpy_seconds(blocks: Blocks) -> float:
    """numpy's `a @ b` on all of this node's cores (call from the process's main thread)."""
    with blas_threads(available_cores()):
        start = time.perf_counter()
        blocks.a_full @ blocks.b_full
        return time.perf_counter() - start


def timed_rank(comm, rank: int, m: Measure):
    """MPI: time `m.reps` multiplies, each after numpy's at rank 0; the results dict at rank 0."""
    if m.ranks != comm.num_devices:
        raise ValueError(f"the measure is for {m.ranks} ranks, but {comm.num_devices} were started")
    if m.strategy == "ring":
        return _timed_ring(comm, rank, m)
    blocks = prepare(rank, comm.num_devices, m)

    def numpy_turn():
        barrier(comm, rank)
        seconds = None
        if rank == 0:
            seconds = numpy_seconds(blocks)
        else:  # wait in long sleeps: frequent wake-ups would slow numpy's threads (unfair to numpy)
            comm.max_pause = NUMPY_TURN_PAUSE
        barrier(comm, rank)
        comm.max_pause = MAX_PAUSE
        return seconds

    def our_turn():
        barrier(comm, rank)
        start = time.perf_counter()
        multiply(comm, rank, m, blocks)
        return time.perf_counter() - start

    numpy_turn(), our_turn()  # warm-up: BLAS buffers, first-touch pages, MPI connections
    sent_before = comm.traffic(rank).bytes_sent()
    pairs = [(numpy_turn(), our_turn()) for _ in range(m.reps)]
    sent = gather(comm, rank, np.array([(comm.traffic(rank).bytes_sent() - sent_before) // m.reps]))
    peaks = gather(comm, rank, np.array([_peak_bytes(comm, rank, m, blocks)]))
    if rank != 0:
        return None
    return {
        **asdict(m),
        "numpy_seconds": [p[0] for p in pairs],
        "seconds": [p[1] for p in pairs],
        "bytes_sent": [int(s[0]) for s in sent],
        "peak_bytes": [int(p[0]) for p in peaks],
    }


def _peak_bytes(comm, rank, m: Measure, blocks: Blocks) -> int:
    """Bytes of arrays this rank holds at its peak during one multiply: inputs plus what it allocates.

    numpy reports its allocations to tracemalloc; that is process-wide, so the
    figure is one rank's only when each rank is a process. A fresh workspace,
    so that its buffers are counted.
    """
    barrier(comm, rank)
    blocks.workspace = Workspace()
    tracemalloc.start()
    try:
        multiply(comm, rank, m, blocks)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return blocks.a_block.nbytes + blocks.b_block.nbytes + peak


def _timed_ring(comm, rank: int, m: Measure):
    """Our ring all-gather of an n x n matrix (column blocks) against MPI_Allgather of the same bytes."""
    from mpi4py import MPI

    size, n = comm.num_devices, m.n
    widths = [hi - lo for lo, hi in (block_range(n, size, r) for r in range(size))]
    if len(set(widths)) != 1:
        raise ValueError(f"the ring bandwidth check needs n divisible by the ranks, got {n} over {size}")
    block = np.full((n, widths[0]), float(rank), dtype=m.dtype)
    gathered = np.empty(size * block.size, dtype=m.dtype)

    def ring_seconds():
        barrier(comm, rank)
        start = time.perf_counter()
        for _ in ring_allgather(comm, rank, block, lambda owner: block.shape):
            pass
        return time.perf_counter() - start

    def allgather_seconds():
        barrier(comm, rank)
        start = time.perf_counter()
        MPI.COMM_WORLD.Allgather(block, gathered)
        return time.perf_counter() - start

    ring_seconds(), allgather_seconds()
    pairs = [(allgather_seconds(), ring_seconds()) for _ in range(m.reps)]
    if rank != 0:
        return None
    return {**asdict(m), "bytes": n * n * np.dtype(m.dtype).itemsize,
            "allgather_seconds": [p[0] for p in pairs], "seconds": [p[1] for p in pairs]}


def timed_threads(m: Measure) -> dict:
    """Threads: each repetition is numpy in this (main) thread, then one `run_threads` call, as a user makes it."""
    blocks = [prepare(rank, m.ranks, m) for rank in range(m.ranks)]

    def ours() -> tuple[float, list[int]]:
        start = time.perf_counter()
        sent = run_threads(m.ranks, lambda comm, rank: multiply(comm, rank, m, blocks[rank]))
        return time.perf_counter() - start, sent

    numpy_seconds(blocks[0]), ours()  # warm-up
    pairs = [(numpy_seconds(blocks[0]), ours()) for _ in range(m.reps)]
    return {**asdict(m), "numpy_seconds": [p[0] for p in pairs], "seconds": [p[1][0] for p in pairs],
            "bytes_sent": pairs[0][1][1], "peak_bytes": None}  # tracemalloc cannot tell threads apart


def main(argv=None) -> int:
    from spmd.mpi import run_mpi

    m = Measure(**json.loads((argv or sys.argv[1:])[0]))
    result = timed_threads(m) if m.backend == "threads" else run_mpi(lambda comm, rank: timed_rank(comm, rank, m))
    if result is not None:
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
