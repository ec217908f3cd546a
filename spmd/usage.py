"""One error policy for every entry point: a user mistake is one line that names the flag or file and what
would be right, printed once (by rank 0 when an MPI launcher started every process), exit status 2.

Everything that can be checked before a rank starts is checked here: flags in range, files readable,
output paths writable, --devices against the processes mpirun started.
"""

from __future__ import annotations

import argparse
import difflib
import math
import os
import sys
from typing import NoReturn

USAGE_EXIT = 2
DEBUG_ENV = "SPMD_DEBUG"  # set to 1 (or pass --debug) for the Python traceback of a failing rank
_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")


class UsageError(ValueError):
    """A mistake in how spmd was called; its message names the flag or file."""


def launcher_rank() -> int:
    """This process's rank as an MPI launcher numbered it (0 when none did), without initializing MPI."""
    for var in _RANK_VARS:
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def debugging() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def fail(prog: str, message: str) -> NoReturn:
    """Print `prog: error: message` once per job and exit 2."""
    if launcher_rank() == 0:
        sys.stderr.write(f"{prog}: error: {message}\n")
        sys.stderr.flush()
    sys.exit(USAGE_EXIT)


class Parser(argparse.ArgumentParser):
    """argparse with the policy: one line (no usage block), once per job, exit 2; every flag's help ends with
    its default, in one style, unless it already says it."""

    def format_help(self) -> str:
        for action in self._actions:
            default = action.default
            if (
                action.help == argparse.SUPPRESS
                or default is None
                or default is False
                or default == ""
                or default == argparse.SUPPRESS
                or action.nargs == 0
                or "default" in (action.help or "")
            ):
                continue
            action.help = f"{action.help} (default {default})" if action.help else f"(default {default})"
        return super().format_help()

    def error(self, message: str) -> NoReturn:
        fail(self.prog, message + self.closest(message) + f" (see {self.prog} --help)")

    def closest(self, message: str) -> str:
        """For a mistyped flag, the flags it is closest to."""
        if not message.startswith("unrecognized arguments:"):
            return ""
        known = [flag for flag in self._option_string_actions if flag.startswith("--")]
        hints = []
        for word in message.split(":", 1)[1].split():
            if word.startswith("--"):
                close = difflib.get_close_matches(word.split("=", 1)[0], known, n=2, cutoff=0.6)
                hints += [f"{word}: did you mean {' or '.join(close)}?"] if close else []
        return "; " + "; ".join(hints) if hints else ""


def readable(flag: str, path: str) -> str:
    if not os.path.exists(path):
        raise UsageError(f"{flag} {path}: no such file")
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path}: is a directory, not a file")
    if not os.access(path, os.R_OK):
        raise UsageError(f"{flag} {path}: cannot be read (permission denied)")
    return path


def writable(flag: str, path: str | None) -> str | None:
    """`path` can be created or overwritten: checked before the run, so a finished run is never lost to it."""
    if path is None or path == "-":
        return path
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path}: is a directory; give a file name")
    if not os.path.isdir(folder):
        raise UsageError(f"{flag} {path}: folder {folder} does not exist (create it first)")
    if not os.access(folder, os.W_OK):
        raise UsageError(f"{flag} {path}: folder {folder} is not writable")
    return path


def at_least(flag: str, value, low, what: str = ""):
    """`value` unless it is below `low` (or not a number): then a UsageError naming the flag."""
    if value is not None and (isinstance(value, float) and not math.isfinite(value) or value < low):
        raise UsageError(f"{flag} must be >= {low}{what}, got {value}")
    return value


def say(text: str, end: str = "\n") -> bool:
    """Print a report (or a piece of one) to stdout, flushed; if its reader has gone (`| head`), stop writing
    there, quietly, and return False."""
    try:
        print(text, end=end, flush=True)
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's last flush must not fail either
        return False
    return True
