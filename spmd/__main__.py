"""python -m spmd <strategy> [--mesh AXIS=N,...] [flags]: run one strategy on MPI ranks or threads.

Matrix multiplication strategies (dp, fsdp) and MLP training strategies (mlp-*) share the launcher;
the strategy may come before or after the flags (spmd/harness/front.py). Ctrl-C, SIGTERM and a closed pipe
end it as spmd/interrupts.py says.
"""

import sys

from spmd.harness.front import main
from spmd.interrupts import run_stoppable

if __name__ == "__main__":
    sys.exit(run_stoppable("python -m spmd", main, sys.argv[1:]))
