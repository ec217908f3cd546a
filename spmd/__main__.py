"""python -m spmd <strategy> [--mesh AXIS=N,...] [flags]: run one strategy on MPI ranks or threads.

Matrix multiplication strategies (dp, fsdp) and MLP training strategies (mlp-*) share the launcher.
"""

import sys

from spmd.harness import cli, train_cli
from spmd.train import TRAINERS

if __name__ == "__main__":
    training = len(sys.argv) > 1 and sys.argv[1] in TRAINERS
    sys.exit(train_cli.main() if training else cli.main())
