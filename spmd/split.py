"""A rank with cores to itself splits its attention and its transcendental kernels over them, in threads of its own.

One rank alone on a 2-core machine runs its GEMMs on OpenBLAS's threads, every core, but would run attention's
many small matmuls and softmaxes one after another, and a ufunc on one core. Inside `own_cores(n)` attention
splits n ways by sequences (BLAS held to one thread meanwhile: `one_blas_thread`), and a kernel with an exp or a
tanh an element (`by_rows`: SiLU, GELU) by rows; numpy releases the GIL in BLAS and in its ufunc loops, so the
pieces run at once. A pass that only loads and stores (an add, a norm, RoPE) is left whole: two cores share the
memory's bandwidth, and a split costs ~35 us (measured: no gain at a layer's sizes). Nothing is allocated: each
piece writes its own rows of the same arrays, and every element is computed as a rank of one core computes it
(BLAS on one thread; a row's reductions included), so a lone rank and a rank of one core agree to the bit.
A rank with one core (two ranks on two cores, or the threads backend's ranks sharing a process) splits nothing.
"""

from __future__ import annotations

import functools
import inspect
import queue
import threading
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from typing import TypeVar, cast

from threadpoolctl import ThreadpoolController

SPLIT_ELEMENTS = 1 << 16  # a kernel's smallest array worth splitting (an exp over it: ~0.15 ms a core)

_local = threading.local()
_helpers_started: list[queue.SimpleQueue] = []  # each helper thread's jobs: (task, where to say it ended)
_start_lock = threading.Lock()


def width() -> int:
    """How many ways the calling thread's kernels split (1 outside own_cores, and in its helper threads)."""
    return getattr(_local, "width", 1)


def _helper(jobs: queue.SimpleQueue) -> None:
    while True:
        task, ended = jobs.get()
        try:
            task()
            ended.put(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the rank that gave the task
            ended.put(exc)


def _helpers(count: int) -> list[queue.SimpleQueue]:
    """The process's helper threads, at least `count` (daemons kept for the process: a queue each, which costs
    a third of a thread pool's ~60 us a task)."""
    with _start_lock:
        while len(_helpers_started) < count:
            jobs: queue.SimpleQueue = queue.SimpleQueue()
            threading.Thread(target=_helper, args=(jobs,), name="spmd-core", daemon=True).start()
            _helpers_started.append(jobs)
        return _helpers_started[:count]


@contextmanager
def own_cores(cores: int):
    """The calling thread (a rank alone in its process) splits its kernels `cores` ways meanwhile; with
    cores <= 1, nothing changes."""
    if cores <= 1:
        yield
        return
    _helpers(cores - 1)
    _local.width = cores
    try:
        yield
    finally:
        _local.width = 1


@functools.cache
def _openblas() -> tuple:
    """(set, get) of each OpenBLAS numpy loaded, called directly: threadpoolctl lets only the thread that first
    limited BLAS (the transport's) change it again, and a rank may run on another thread."""
    found = []
    controllers = ThreadpoolController().select(user_api="blas").lib_controllers
    for lib in controllers:
        names = [
            (f"{p}openblas_set_num_threads{x}", f"{p}openblas_get_num_threads{x}")
            for p in ("", "scipy_")
            for x in ("", "64_")
        ]
        calls = [(getattr(lib.dynlib, a, None), getattr(lib.dynlib, b, None)) for a, b in names]
        found += [(set_, get) for set_, get in calls if set_ is not None and get is not None][:1]
    return tuple(found) if len(found) == len(controllers) else ()


@contextmanager
def one_blas_thread():
    """BLAS on one thread meanwhile, for pieces that call it at once (each asking for every core, they would wait
    on each other); yields whether it could (numpy's BLAS is OpenBLAS), else the pieces should not split. Safe
    while no other thread is inside BLAS: the rank's helpers are idle between its kernels."""
    libraries = _openblas()
    before = [get() for _, get in libraries]
    for set_, _ in libraries:
        set_(1)
    try:
        yield bool(libraries)
    finally:
        for (set_, _), count in zip(libraries, before, strict=True):
            set_(count)


def run(tasks: Sequence[Callable[[], object]]) -> None:
    """Run the tasks at once: the first here, the others on the helper threads; an exception in any is raised
    here once all have ended (none is left writing into the rank's arrays)."""
    ended: queue.SimpleQueue = queue.SimpleQueue()
    for jobs, task in zip(_helpers(len(tasks) - 1), tasks[1:], strict=True):
        jobs.put((task, ended))
    error: BaseException | None = None
    ways, _local.width = width(), 1  # a piece does not split again
    try:
        tasks[0]()
    except BaseException as exc:  # noqa: BLE001 - raised below, after the other pieces end
        error = exc
    finally:
        _local.width = ways
    for _ in tasks[1:]:
        failed = ended.get()  # wait for every piece, failed or not
        error = error or failed
    if error is not None:
        raise error


def blocks(n: int, ways: int) -> list[tuple[int, int]]:
    """n split into `ways` contiguous blocks as equal as they can be (the first n % ways one longer)."""
    base, extra = divmod(n, ways)
    bounds, lo = [], 0
    for i in range(ways):
        hi = lo + base + (i < extra)
        bounds.append((lo, hi))
        lo = hi
    return bounds


F = TypeVar("F", bound=Callable)


def by_rows(*names: str) -> Callable[[F], F]:
    """A kernel whose arguments `names` are arrays of the same rows (its first axis), and whose other arguments
    every row shares, computing each row from its own rows only: split by rows when worth it."""

    def wrap(kernel: F) -> F:
        parameters = list(inspect.signature(kernel).parameters)
        at = [parameters.index(name) for name in names]

        @functools.wraps(kernel)
        def split_kernel(*args, **kwargs):
            ways, first = width(), args[at[0]]
            if ways == 1 or first.size < SPLIT_ELEMENTS or first.shape[0] < ways:
                return kernel(*args, **kwargs)
            pieces = []
            for lo, hi in blocks(first.shape[0], ways):
                part = list(args)
                for i in at:
                    part[i] = args[i][lo:hi]
                pieces.append(functools.partial(kernel, *part, **kwargs))
            run(pieces)

        return cast(F, split_kernel)

    return wrap
