"""python -m spmd.bench --out DIR [--quick]: see spmd/bench/run.py; python -m spmd.bench lm ...: spmd/bench/lm.py."""

import sys

from spmd.bench import lm, run

if __name__ == "__main__":
    if sys.argv[1:2] == ["lm"]:
        sys.exit(lm.main(sys.argv[2:]))
    sys.exit(run.main())
