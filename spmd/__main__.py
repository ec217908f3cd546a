"""python -m spmd <strategy> [--mesh AXIS=N,...] [flags]: run one strategy on MPI ranks or threads."""

import sys

from spmd.harness.cli import main

if __name__ == "__main__":
    sys.exit(main())
