"""python -m spmd <strategy> [--mesh AXIS=N,...] [flags]: run one strategy on MPI ranks or threads.

Matrix multiplication strategies (dp, fsdp) and MLP training strategies (mlp-*) share the launcher;
the strategy may come before or after the flags (spmd/harness/front.py).
"""

import sys

from spmd.harness.front import main

if __name__ == "__main__":
    sys.exit(main())
