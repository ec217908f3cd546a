"""How a command ends when the user stops it: Ctrl-C (SIGINT) or SIGTERM end the job within moments with one
line, printed once per job (rank 0 under an MPI launcher), exit status 130 or 143 and no traceback (unless
--debug or SPMD_DEBUG=1); output piped into a reader that stops early (`| head`) ends quietly."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable

from spmd.usage import debugging, launcher_rank

SIGTERM_EXIT, SIGINT_EXIT = 128 + signal.SIGTERM, 128 + signal.SIGINT


class Terminated(BaseException):
    """SIGTERM, raised where the program is, as Ctrl-C raises KeyboardInterrupt (so cleanup runs)."""


def _terminate(signum, frame) -> None:
    raise Terminated()


def run_stoppable(prog: str, main: Callable[[], int | None], argv: list[str]) -> int:
    """main()'s exit status, or 130/143 with one line if the user stopped it, 0 if stdout's reader went away."""
    signal.signal(signal.SIGTERM, _terminate)
    debug = debugging() or "--debug" in argv
    try:
        return main() or 0
    except (KeyboardInterrupt, Terminated) as stop:
        if debug:
            raise
        status = SIGTERM_EXIT if isinstance(stop, Terminated) else SIGINT_EXIT
        if launcher_rank() == 0:
            sys.stderr.write(f"\n{prog}: stopped by {'SIGTERM' if status == SIGTERM_EXIT else 'Ctrl-C'}\n")
        return status
    except BrokenPipeError:  # `python -m spmd ... | head`: the reader is gone; say nothing more
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's last flush must not fail again
        return 0
