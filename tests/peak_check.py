"""Comparing a measured peak with a model's per-rank peaks, on either backend (not collected)."""

import tracemalloc

import numpy as np

from spmd.collectives import barrier, gather
from spmd.harness.memory import start_peak_memory, stop_peak_memory
from spmd.transport.group import Group


def peak_of_steps(world: Group, build, batches, one_rank_per_process: bool) -> int:
    """tracemalloc's peak over the steps of the engine build() makes (its building is not measured: it loads
    each initial layer whole, once); MPI: this rank's, threads: the whole process's, every rank held.

    What building allocates and keeps counts, so ask the model (strategy.cost) first: it fills the Layout's
    process-wide lru_caches with the keys building asks for. Otherwise a cache that resizes while building
    (its new dict table, ~295 KiB at 16384 slots, allocated inside the window while the old one was not)
    counts as held memory, at a point that depends on how many entries earlier tests left."""
    traces = start_peak_memory(world, one_rank_per_process)
    engine = build()
    barrier(world)
    if traces:
        tracemalloc.reset_peak()
    for x, target in batches:
        engine.step(x, target)
    barrier(world)
    return stop_peak_memory(traces)


def assert_peak_matches(world: Group, peak: int, model: list[int], one_rank_per_process: bool, slack: int) -> None:
    """Under MPI each rank's peak == its model; on threads rank 0's whole-process peak == the sum."""
    peaks = gather(world, np.array([peak]))
    if one_rank_per_process:
        assert abs(peak - model[world.rank]) <= slack, (peak, model[world.rank])
    elif world.rank == 0:
        assert abs(int(peaks[0][0]) - sum(model)) <= slack * world.size, (peaks[0][0], sum(model))
