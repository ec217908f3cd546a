"""Peak memory of a run, measured with tracemalloc (numpy reports its arrays to it)."""

import tracemalloc

from spmd.collectives import barrier
from spmd.transport.group import Group


def start_peak_memory(world: Group, one_rank_per_process: bool) -> bool:
    """Start measuring; returns whether this rank measures.

    tracemalloc sees a whole process: under MPI each rank measures itself; on threads rank 0
    measures every rank together. Started between two barriers, so no rank has begun what is
    measured before every rank measures.
    """
    measures = one_rank_per_process or world.rank == 0
    barrier(world)
    if measures:
        tracemalloc.start()
    barrier(world)
    return measures


def stop_peak_memory(measures: bool) -> int:
    """The peak since the start (or the last reset), in bytes; -1 on a rank that does not measure."""
    if not measures:
        return -1
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak
