"""How many BLAS threads each rank gets, so D ranks on C cores do not oversubscribe them."""

import os
from contextlib import contextmanager

from threadpoolctl import threadpool_info, threadpool_limits


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity, not the machine's total)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def blas_threads_per_rank(ranks_on_host: int, cores: int | None = None) -> int:
    """An equal share of the host's cores for each of its ranks, at least 1."""
    return max(1, (cores or available_cores()) // max(1, ranks_on_host))


@contextmanager
def blas_threads(count: int):
    """Limit the BLAS libraries numpy uses to `count` threads meanwhile (process-wide)."""
    with threadpool_limits(limits=count, user_api="blas"):
        yield


def blas_thread_count() -> int:
    """The threads numpy's BLAS may use now (a rank's share, inside the transport's blas_threads)."""
    return max((i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"), default=1)
