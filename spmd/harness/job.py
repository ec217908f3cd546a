"""What every rank of `python -m spmd.<strategy>` does: get its blocks, multiply, report.

The same function runs as a thread or as an MPI process; only the launcher differs.
"""

import json
import time
from dataclasses import dataclass

import numpy as np

from spmd.collectives import gather
from spmd.harness.memory import start_peak_memory, stop_peak_memory
from spmd.harness.report import accounting, format_report
from spmd.matmul.inputs import FileInputs, GeneratedInputs, InputError, describe
from spmd.matmul.problem import Problem, check_product, first_nonfinite, flops
from spmd.matmul.strategy import Strategy
from spmd.observe.trace import hidden_fraction, write_trace
from spmd.transport.clock import Tracer, now_us
from spmd.transport.group import Group
from spmd.transport.mesh import Mesh
from spmd.usage import say

OPERANDS = {"a": 0, "b": 1}  # operand name -> matrix number of the inputs


@dataclass(frozen=True)
class JobConfig:
    """One run's settings, checked on creation; `cli.parse` builds it."""

    strategy: Strategy
    mesh: Mesh | None = None  # None: the strategy's default over every rank
    m: int = 1024
    k: int = 1024
    n: int = 1024
    dtype: str = "float64"
    seed: int = 0
    a_path: str | None = None
    b_path: str | None = None
    out_path: str | None = None
    check: bool = False
    json: str | None = None  # "-": the report as one JSON line on stdout; a path: into that file
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


def agree_on_inputs(world: Group, inputs) -> None:
    """Rank 0 raises InputError if any rank's inputs differ in shape or dtype from its own.

    (A rank started with another file, or other flags, would otherwise compute
    with blocks that do not fit the others'.)
    """
    mine = np.frombuffer(describe(inputs).encode(), dtype=np.uint8)
    everyone = gather(world, mine)
    if everyone is None:
        return
    seen = [block.tobytes().decode() for block in everyone]
    odd = [f"rank {r} has {text}" for r, text in enumerate(seen) if text != seen[0]]
    if odd:
        raise InputError(f"ranks disagree on the inputs: rank 0 has {seen[0]}; " + "; ".join(odd))


def gather_spans(world: Group, since_us: float) -> list | None:
    """Every rank's traced spans that began after `since_us`, merged at rank 0 (None elsewhere)."""
    tracer = world.comm.tracer
    assert tracer is not None, "gather_spans needs the communicator's tracer"
    mine = json.dumps([s for s in tracer.of_rank(world.rank) if s[3] >= since_us]).encode()
    everyone = gather(world, np.frombuffer(mine, dtype=np.uint8))
    return None if everyone is None else [tuple(s) for block in everyone for s in json.loads(block.tobytes())]


def check_result(c: np.ndarray, inputs, m: int, k: int, n: int) -> dict:
    """--check's fields of the report: C against a @ b, or why it cannot be checked (inputs that are not finite)."""
    a, b = inputs.block(0, (0, m), (0, k)), inputs.block(1, (0, k), (0, n))
    bad_input = first_nonfinite("input A", a) or first_nonfinite("input B", b)
    if bad_input:  # NaN compares unequal to itself: no product of such inputs can be checked
        return {"check_problem": f"{bad_input}; the check needs finite inputs", "ok": False}
    error, tolerance = check_product(c, a, b)
    bad_c = first_nonfinite("C", c)
    checked = {"max_abs_error": error if not bad_c else float("inf"), "tolerance": tolerance}
    checked["ok"] = bool(error <= tolerance and not bad_c)
    return {**checked, "check_problem": f"{bad_c}, from finite inputs"} if bad_c else checked


def run_rank(world: Group, config: JobConfig, backend: str, one_rank_per_process: bool):
    """One rank's job; returns the report dict at rank 0, None elsewhere.

    `one_rank_per_process` (MPI) lets each rank measure its own peak memory;
    otherwise (threads) rank 0 measures the whole process, every rank together.
    """
    inputs = config.inputs()
    agree_on_inputs(world, inputs)
    (m, k), (_, n) = inputs.shapes
    strategy, rank = config.strategy, world.rank
    mesh = strategy.mesh(world.size, config.mesh)
    problem = Problem(m, k, n, np.dtype(inputs.dtypes[0]).itemsize)
    blocks = strategy.blocks(problem, mesh, rank, lambda name, rows, cols: inputs.block(OPERANDS[name], rows, cols))
    sent_before = world.traffic().bytes_sent()
    if config.trace_path is not None and world.comm.tracer is None:  # threads share one communicator
        world.comm.tracer = Tracer()
    # After every rank holds its inputs (counted apart, by nbytes), before any multiplies.
    traces_memory = start_peak_memory(world, one_rank_per_process)
    start, start_us = time.perf_counter(), now_us()
    c = strategy.run(world, mesh, blocks, problem)
    seconds = time.perf_counter() - start
    allocated = stop_peak_memory(traces_memory)
    sent = world.traffic().bytes_sent() - sent_before
    held = sum(block.nbytes for block in blocks.values())
    measured = gather(world, np.array([sent, allocated, held]))
    spans = gather_spans(world, start_us) if config.trace_path is not None else None
    if rank != 0:
        return None
    report = {
        "strategy": strategy.name,
        "mesh": str(mesh),
        "backend": backend,
        "ranks": world.size,
        "m": m,
        "k": k,
        "n": n,
        "dtype": str(c.dtype),
        "seconds": seconds,
        "gflops": flops(m, k, n, c.dtype) / seconds / 1e9 if seconds > 0 else float("inf"),
        **accounting(strategy, mesh, (m, k, n), [*inputs.dtypes, c.dtype], measured, per_process=one_rank_per_process),
    }
    if config.check:
        report.update(check_result(c, inputs, m, k, n))
    if config.out_path is not None:
        np.save(config.out_path, c, allow_pickle=False)
    if spans is not None and config.trace_path is not None:
        write_trace(config.trace_path, spans)
        report.update(trace=config.trace_path, hidden_fraction=hidden_fraction(spans))
    if config.json not in (None, "-"):
        with open(config.json, "w") as f:
            f.write(json.dumps(report) + "\n")
    say(json.dumps(report) if config.json == "-" else format_report(report))
    return report
