"""Refusing a run that cannot fit, before any rank starts: the exact memory model against this machine.

The closed form (spmd.parallel.cost, asserted equal to what the ranks hold in every test) gives each rank's
arrays by kind; the ranks of a run started here share this machine's memory (threads: one process; mpirun on
one host: its processes). A run whose ranks need more than the memory available (MemAvailable of
/proc/meminfo, or --memory-limit GB) is refused with one line naming the need, what is available and the flags
that lower it. Python's own objects and the batch come on top, so the check is a floor, not a promise.
"""

from __future__ import annotations

import os

from spmd.usage import UsageError

GIB = 2**30


def ranks_on_this_machine(world: int) -> int:
    """How many of the run's ranks share this machine: mpirun's local count where it says (MPICH, Open MPI), else
    every rank (threads, or one host)."""
    for name in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return world


def available_bytes() -> int | None:
    """This machine's available memory (Linux's MemAvailable), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_fits(memory: list[dict[str, int]], limit_gb: float | None, ranks_here: int) -> None:
    """UsageError if the `ranks_here` fullest ranks of `memory` (bytes by kind per rank) exceed the limit."""
    limit = limit_gb * GIB if limit_gb is not None else available_bytes()
    if limit is None:
        return
    per_rank = sorted((sum(m.values()) for m in memory), reverse=True)
    need = sum(per_rank[:ranks_here])
    if need > limit:
        source = f"--memory-limit {limit_gb:g} GiB" if limit_gb is not None else "available on this machine"
        raise UsageError(
            f"this run needs {per_rank[0] / GIB:.2f} GiB on its fullest rank, {need / GIB:.2f} GiB for "
            f"its {ranks_here} ranks on this machine, and {limit / GIB:.2f} GiB is {source}: lower "
            "--batch or "
            "--seq, shard more (fsdp, tp, pp), or --recompute"
        )
