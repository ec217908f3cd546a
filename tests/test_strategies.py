"""Every registered strategy, one set of checks: result, bytes == cost, memory == cost, schedule, tiles once.

A new strategy in spmd.matmul.STRATEGIES is checked here with no new test code.
"""

import numpy as np
import pytest
from peak_check import assert_peak_matches

from spmd.collectives import barrier
from spmd.harness.memory import start_peak_memory, stop_peak_memory
from spmd.matmul import STRATEGIES
from spmd.transport.group import Group
from strategy_run import run_strategy

SHAPES = [(8, 6, 4), (7, 5, 11), (2, 3, 1), (33, 17, 65), (0, 4, 3)]
MEMORY_SLACK = 64 * 1024  # bytes of Python objects tracemalloc sees beside the arrays


def operands(shape, dtype=np.float64, seed=0):
    m, k, n = shape
    rng = np.random.default_rng(seed)
    return rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((k, n)).astype(dtype)


def result_traffic_and_schedule(comm, rank, name, shape, dtype):
    strategy = STRATEGIES[name]
    a, b = operands(shape, dtype)
    comm.traffic(rank).keep_log = True
    c, mesh, problem = run_strategy(comm, rank, strategy, a, b)
    if rank == 0:
        np.testing.assert_allclose(c, a @ b, rtol=1e-5 if dtype == np.float32 else 1e-12, atol=1e-5)
    else:
        assert c is None
    cost, traffic = strategy.cost(problem, mesh), comm.traffic(rank)
    assert traffic.bytes_sent() == cost.bytes_sent[rank]
    assert traffic.bytes_received() == cost.bytes_received[rank]
    assert [dst for event, dst, _, _ in traffic.log if event == "send"] == strategy.schedule(mesh).sends(rank)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f8", "f4"])
def test_result_bytes_and_schedule(world, name, shape, dtype):
    world.run(result_traffic_and_schedule, name, shape, dtype)


def memory_matches_cost(comm, rank, name, one_rank_per_process):
    """Peak bytes of arrays per rank (inputs + what the run allocates) == the cost's closed form.

    tracemalloc sees a whole process: one rank under MPI, every rank on threads (then the sum is compared).
    """
    strategy, world = STRATEGIES[name], Group.world(comm, rank)
    a, b = operands((300, 200, 100))
    traces = start_peak_memory(world, one_rank_per_process)
    # Its blocks are contiguous copies, counted; on threads every rank holds them until all have run,
    # so the process-wide peak is the sum of the ranks' peaks.
    _, mesh, problem = run_strategy(comm, rank, strategy, a, b, before_return=barrier)
    peak = stop_peak_memory(traces)
    assert_peak_matches(world, peak, strategy.cost(problem, mesh).peak_bytes, one_rank_per_process, MEMORY_SLACK)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_peak_memory_equals_the_cost(world, name):
    world.run(memory_matches_cost, name, world.one_rank_per_process)


class CountingBlock(np.ndarray):
    """An A block that logs (first row, row count, B operand) of every matmul it (or a slice) takes part in."""

    def __array_finalize__(self, obj):
        self.log = getattr(obj, "log", None)
        self.origin = getattr(obj, "origin", None)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        plain = [x.view(np.ndarray) if isinstance(x, CountingBlock) else x for x in inputs]
        if "out" in kwargs:
            kwargs["out"] = tuple(o.view(np.ndarray) if isinstance(o, CountingBlock) else o for o in kwargs["out"])
        if ufunc is np.matmul and isinstance(inputs[0], CountingBlock):
            first = (inputs[0].__array_interface__["data"][0] - self.origin) // max(inputs[0].strides[0], 1)
            self.log.append((first, inputs[0].shape[0], plain[1].copy()))
        return getattr(ufunc, method)(*plain, **kwargs)


def columns_of(b, operand) -> range:
    """Which columns of B `operand` is, found by content (B's random columns are all distinct)."""
    width = operand.shape[1]
    for lo in range(b.shape[1] - width + 1):
        if np.array_equal(b[:, lo : lo + width], operand):
            return range(lo, lo + width)
    raise AssertionError(f"a matmul used a {operand.shape} operand that is no block of B")


def every_tile_once(comm, rank, name):
    size = comm.num_devices
    m, k, n = 300 * size + 1, 3, 3 * size + 2  # uneven on purpose; several row panels per rank
    a, b = operands((m, k, n))
    log, rows = [], []

    def counting(block):
        block = block.view(CountingBlock)
        block.log, block.origin = log, block.__array_interface__["data"][0]
        rows.append(block.shape[0])
        return block

    run_strategy(comm, rank, STRATEGIES[name], a, b, wrap_a=counting)
    done = np.zeros((rows[0], n), dtype=int)
    for first, count, operand in log:
        cols = columns_of(b, operand)
        done[first : first + count, cols.start : cols.stop] += 1
    assert (done == 1).all(), "some tile of this rank's rows of C was computed twice or never"


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_tile_of_c_is_computed_exactly_once(world, name):
    world.run(every_tile_once, name)
