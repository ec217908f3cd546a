"""Stopping a run as a user does: Ctrl-C or SIGTERM end it at once with one line and 130 or 143, on threads and
under mpiexec, no traceback, no per-rank noise; a --save folder is not made before the first checkpoint; output
piped into a reader that stops early ends quietly."""

import os
import signal
import subprocess
import sys
import time

import pytest

LONG_RUN = ["-m", "spmd", "train", "--model", "llama", "--steps", "100000", "--quiet"]


# Run with SIGINT at its default: a shell starts a background job (`make test &`, a script's `... &`) with SIGINT
# ignored, children inherit that, and Python then installs no Ctrl-C handler (these tests timed out so).
DEFAULT_SIGINT = [
    "-c",
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])",
]


def started(command: list[str], wait: float = 6.0) -> subprocess.Popen:
    """The command running (its imports done, its ranks stepping) after `wait` seconds."""
    process = subprocess.Popen(
        [sys.executable, *DEFAULT_SIGINT, *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    time.sleep(wait)
    assert process.poll() is None, process.communicate()
    return process


def ended(process: subprocess.Popen, timeout: float = 30) -> tuple[str, str]:
    """(stdout, stderr) once the process ends; one that does not is killed, its ranks too, and fails the test
    (a run left behind would slow every later test)."""
    try:
        return process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise


@pytest.mark.parametrize("backend", ["threads", "mpi"])
@pytest.mark.parametrize(
    "sig, status, words", [(signal.SIGINT, 130, "stopped by Ctrl-C"), (signal.SIGTERM, 143, "stopped by SIGTERM")]
)
def test_a_stopped_run_ends_at_once_with_one_line(tmp_path, mpiexec, backend, sig, status, words):
    save = tmp_path / "ckpt"
    launch = [mpiexec, "-n", "2", sys.executable] if backend == "mpi" else [sys.executable]
    process = started([*launch, *LONG_RUN, "--save", str(save), *(["--devices", "2"] if backend == "threads" else [])])
    stopped_at = time.monotonic()
    process.send_signal(sig)
    out, err = ended(process)
    assert time.monotonic() - stopped_at < 10
    assert process.returncode == status, err
    lines = err.strip().splitlines()
    # one line, once; under mpiexec the launcher may end the ranks before rank 0's line passes through it
    assert len(lines) == 1 if backend == "threads" else len(lines) <= 1, err
    assert all(words in line for line in lines), err
    assert "Traceback" not in err and not save.exists()


def test_output_piped_into_a_reader_that_stops_early_ends_quietly():
    done = subprocess.run(
        f"{sys.executable} -m spmd train --model llama --devices 2 --steps 3 | head -1",
        shell=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout.startswith("spmd train:")
    assert "Error" not in done.stderr and "Traceback" not in done.stderr


def test_with_debug_a_stopped_run_shows_where_it_was():
    process = started([sys.executable, *LONG_RUN, "--devices", "2", "--debug"])
    process.send_signal(signal.SIGINT)
    _, err = ended(process)
    assert process.returncode != 0 and "KeyboardInterrupt" in err
