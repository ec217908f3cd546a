"""One test body, many worlds.

A test that takes the `world` fixture runs its rank function on every rank of
that world and asserts inside it. Plain `pytest` runs it on threads at 1, 2,
3 and 4 ranks; `mpiexec -n N python -m mpi4py -m pytest --with-mpi` runs it
on the N MPI processes, and only the `world` tests run there.

A skipped test fails the session: a check that did not run is not a pass.
"""

import ast
import functools
import os
import shutil
import sys
from pathlib import Path

import pytest

from spmd.transport.threads import run_threads

THREAD_SIZES = (1, 2, 3, 4)
# A recv waiting this long fails with its diagnosis, well before pytest-timeout
# (120 s, pyproject.toml) would end the run with bare stacks.
RECV_TIMEOUT = 60.0


class ThreadWorld:
    backend = "threads"
    one_rank_per_process = False  # every rank is a thread of this process

    def __init__(self, size: int):
        self.size = size

    def run(self, rank_fn, *args) -> None:
        """Run rank_fn(comm, rank, *args) on every rank; a failure on any rank fails the test."""
        run_threads(self.size, lambda comm, rank: rank_fn(comm, rank, *args), timeout=RECV_TIMEOUT)

    def __repr__(self):
        return f"threads-{self.size}"


class MPIWorld:
    backend = "mpi"
    one_rank_per_process = True

    def __init__(self, config):
        from mpi4py import MPI

        self.size = MPI.COMM_WORLD.Get_size()
        self._capture = config.pluginmanager.get_plugin("capturemanager")

    def run(self, rank_fn, *args) -> None:
        """Run rank_fn on this process's rank; a failure aborts the whole MPI job.

        Output capture is off meanwhile: the failing rank's traceback must reach
        the terminal before MPI_Abort ends every process, pytest's report included.
        """
        from spmd.transport.mpi import run_mpi

        with self._capture.global_and_fixture_disabled():
            run_mpi(lambda comm, rank: rank_fn(comm, rank, *args), timeout=RECV_TIMEOUT)

    def __repr__(self):
        return f"mpi-{self.size}"


def _with_mpi(config) -> bool:
    return bool(config.getoption("--with-mpi", default=False))


def pytest_generate_tests(metafunc):
    if "world" in metafunc.fixturenames:
        worlds = [MPIWorld(metafunc.config)] if _with_mpi(metafunc.config) else [ThreadWorld(n) for n in THREAD_SIZES]
        metafunc.parametrize("world", worlds, ids=repr)


@functools.cache
def _takes_world(path: Path) -> bool:
    """Whether a function in this file (a test or a fixture) takes the `world` fixture."""
    nodes = ast.walk(ast.parse(path.read_text()))
    functions = [n for n in nodes if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    return any(a.arg == "world" for f in functions for a in f.args.args)


def pytest_ignore_collect(collection_path, config):
    """Under MPI, a test file with no world test is not imported: its imports cost each rank seconds."""
    if _with_mpi(config) and collection_path.suffix == ".py" and collection_path.name.startswith("test_"):
        return not _takes_world(collection_path) or None
    return None


def pytest_collection_modifyitems(config, items):
    """Under MPI, run only the world tests (deselected, not skipped)."""
    if not _with_mpi(config):
        for item in items:  # a world test in a file pytest_ignore_collect would pass over under MPI
            if "world" in getattr(item, "fixturenames", ()) and not _takes_world(Path(item.fspath)):
                raise pytest.UsageError(
                    f"{item.nodeid} takes `world` only through a fixture of another file: "
                    "under MPI its file would not be collected (see _takes_world)"
                )
        return
    keep = [item for item in items if "world" in getattr(item, "fixturenames", ())]
    config.hook.pytest_deselected(items=[item for item in items if item not in keep])
    items[:] = keep


@pytest.hookimpl(trylast=True)  # after the terminal reporter is registered
def pytest_configure(config):
    # Under MPI only rank 0 prints the usual report; a failing rank still
    # prints its traceback (run_mpi) and aborts the job.
    if _with_mpi(config) and os.environ.get("PMI_RANK", "0") != "0":
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            config.pluginmanager.unregister(reporter)


def pytest_sessionfinish(session, exitstatus):
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = len(reporter.stats.get("skipped", [])) if reporter is not None else 0
    if skipped and exitstatus == 0:
        sys.stderr.write(f"\n{skipped} test(s) skipped: a check that did not run is a failure here\n")
        session.exitstatus = 1


@pytest.fixture(scope="session")
def mpiexec() -> str:
    """The mpiexec beside this Python (the venv's), else the one on PATH; missing MPI fails."""
    beside = Path(sys.executable).parent / "mpiexec"
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if found is None:
        pytest.fail("mpiexec not found: install the MPI runtime (make install) - MPI tests never skip")
    return found
