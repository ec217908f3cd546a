"""python -m spmd.bench --out DIR [--quick]: see spmd/bench/run.py."""

import sys

from spmd.bench.run import main

if __name__ == "__main__":
    sys.exit(main())
