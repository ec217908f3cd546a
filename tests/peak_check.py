"""Comparing a measured peak with a model's per-rank peaks, on either backend (not collected)."""

import numpy as np

from spmd.collectives import gather
from spmd.transport.group import Group


def assert_peak_matches(world: Group, peak: int, model: list[int], one_rank_per_process: bool, slack: int) -> None:
    """Under MPI each rank's peak == its model; on threads rank 0's whole-process peak == the sum."""
    peaks = gather(world, np.array([peak]))
    if one_rank_per_process:
        assert abs(peak - model[world.rank]) <= slack, (peak, model[world.rank])
    elif world.rank == 0:
        assert abs(int(peaks[0][0]) - sum(model)) <= slack * world.size, (peaks[0][0], sum(model))
