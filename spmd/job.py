"""What every rank of `python -m spmd.<strategy>` does: get its blocks, multiply, report.

The same function runs as a thread or as an MPI process; only the launcher differs.
"""

import json
import time
import tracemalloc
from dataclasses import dataclass
from typing import Callable

import numpy as np

from spmd.collectives import barrier, gather
from spmd.inputs import FileInputs, GeneratedInputs, InputError, describe
from spmd.layout import block_range
from spmd.report import accounting, format_report
from spmd.trace import Tracer, hidden_fraction, now_us, write_trace

A, B = 0, 1  # matrix numbers of the inputs


@dataclass(frozen=True)
class Strategy:
    """A parallel matmul as the job runner needs it.

    Attributes:
        name: short name for reports ("dp", "fsdp").
        b_columns: (n, num_devices, rank) -> the columns [lo, hi) of B a rank starts with.
        rank_fn: (comm, rank, a_block, b_block, c_shape) -> C at rank 0, None elsewhere.
    """

    name: str
    b_columns: Callable[[int, int, int], tuple[int, int]]
    rank_fn: Callable


@dataclass(frozen=True)
class JobConfig:
    """One run's settings, checked on creation; `cli.parse` builds it."""

    strategy: Strategy
    m: int = 1024
    k: int = 1024
    n: int = 1024
    dtype: str = "float64"
    seed: int = 0
    a_path: str | None = None
    b_path: str | None = None
    out_path: str | None = None
    check: bool = False
    json: bool = False
    trace_path: str | None = None  # write a Chrome trace of every rank here
    schedule: bool = False  # print the per-step schedule instead of running

    def __post_init__(self):
        for name in ("m", "k", "n"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name} must be >= 0, got {getattr(self, name)}")
        if (self.a_path is None) != (self.b_path is None):
            raise ValueError("--a and --b go together: give both input files or neither")
        np.dtype(self.dtype)  # raises TypeError naming an unknown dtype

    def inputs(self):
        """The input source, opened on the calling rank (files are checked here)."""
        if self.a_path is not None:
            return FileInputs(self.a_path, self.b_path)
        return GeneratedInputs(self.m, self.k, self.n, np.dtype(self.dtype), self.seed)


def flops(m: int, k: int, n: int, dtype: np.dtype) -> float:
    """Real floating-point operations of an (m x k) @ (k x n) product."""
    return 2.0 * m * k * n * (4 if dtype.kind == "c" else 1)


def check_product(c: np.ndarray, a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """(max abs error of c against a @ b, the tolerance it must meet).

    Integers must match exactly. For floats the tolerance is the worst-case
    rounding bound of a length-k dot product, 2 k eps max|a| max|b|, paid by
    both c and the reference, so any real mistake (a wrong or missing block) exceeds it.
    """
    expected = a @ b
    if c.shape != expected.shape or c.dtype != expected.dtype:
        return float("inf"), 0.0
    if c.dtype.kind in "biu":  # compared in float64: no wrap-around, no bool arithmetic
        c, expected = c.astype(np.float64), expected.astype(np.float64)
        return float(np.max(np.abs(c - expected), initial=0.0)), 0.0
    error = float(np.max(np.abs(c - expected), initial=0.0))
    bound = np.max(np.abs(a), initial=0.0) * np.max(np.abs(b), initial=0.0)
    return error, float(4 * a.shape[1] * np.finfo(c.dtype).eps * bound)


def agree_on_inputs(comm, rank: int, inputs) -> None:
    """Rank 0 raises InputError if any rank's inputs differ in shape or dtype from its own.

    (A rank started with another file, or other flags, would otherwise compute
    with blocks that do not fit the others'.)
    """
    mine = np.frombuffer(describe(inputs).encode(), dtype=np.uint8)
    everyone = gather(comm, rank, mine)
    if everyone is None:
        return
    seen = [block.tobytes().decode() for block in everyone]
    odd = [f"rank {r} has {text}" for r, text in enumerate(seen) if text != seen[0]]
    if odd:
        raise InputError(f"ranks disagree on the inputs: rank 0 has {seen[0]}; " + "; ".join(odd))


def gather_spans(comm, rank: int, since_us: float) -> list | None:
    """Every rank's traced spans that began after `since_us`, merged at rank 0 (None elsewhere)."""
    mine = json.dumps([s for s in comm.tracer.of_rank(rank) if s[3] >= since_us]).encode()
    everyone = gather(comm, rank, np.frombuffer(mine, dtype=np.uint8))
    return None if everyone is None else [tuple(s) for block in everyone for s in json.loads(block.tobytes())]


def run_rank(comm, rank: int, config: JobConfig, backend: str):
    """One rank's job; returns the report dict at rank 0, None elsewhere."""
    inputs = config.inputs()
    agree_on_inputs(comm, rank, inputs)
    (m, k), (_, n) = inputs.shapes
    size = comm.num_devices
    a_block = inputs.block(A, block_range(m, size, rank), (0, k))  # a_block: (M/D, K)
    b_block = inputs.block(B, (0, k), config.strategy.b_columns(n, size, rank))  # (K, N) or (K, N/D)
    sent_before = comm.traffic(rank).bytes_sent()
    if config.trace_path is not None and comm.tracer is None:  # threads share one communicator
        comm.tracer = Tracer()
    # tracemalloc (numpy reports its arrays to it) sees a whole process: under MPI one
    # rank; on threads rank 0 traces all ranks at once. Started between two barriers:
    # after every rank holds its inputs (counted apart, by nbytes), before any multiplies.
    traces_memory = backend == "mpi" or rank == 0
    barrier(comm, rank)
    if traces_memory:
        tracemalloc.start()
    barrier(comm, rank)
    start, start_us = time.perf_counter(), now_us()
    c = config.strategy.rank_fn(comm, rank, a_block, b_block, (m, n))
    seconds = time.perf_counter() - start
    allocated = -1
    if traces_memory:
        allocated = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    sent = comm.traffic(rank).bytes_sent() - sent_before
    measured = gather(comm, rank, np.array([sent, allocated, a_block.nbytes + b_block.nbytes]))
    spans = gather_spans(comm, rank, start_us) if config.trace_path is not None else None
    if rank != 0:
        return None
    report = {
        "strategy": config.strategy.name,
        "backend": backend,
        "ranks": size,
        "m": m,
        "k": k,
        "n": n,
        "dtype": str(c.dtype),
        "seconds": seconds,
        "gflops": flops(m, k, n, c.dtype) / seconds / 1e9 if seconds > 0 else float("inf"),
        **accounting(config.strategy.name, (m, k, n), [a_block.dtype, b_block.dtype, c.dtype], measured,
                     per_process=backend == "mpi"),
    }
    if config.check:
        error, tolerance = check_product(
            c, inputs.block(A, (0, m), (0, k)), inputs.block(B, (0, k), (0, n))
        )
        report.update(max_abs_error=error, tolerance=tolerance, ok=bool(error <= tolerance))
    if config.out_path is not None:
        np.save(config.out_path, c, allow_pickle=False)
    if spans is not None:
        write_trace(config.trace_path, spans)
        report.update(trace=config.trace_path, hidden_fraction=hidden_fraction(spans))
    print(json.dumps(report) if config.json else format_report(report), flush=True)
    return report
