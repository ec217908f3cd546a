"""python -m spmd.bench --out DIR [--quick]: see spmd/bench/run.py; python -m spmd.bench lm ...: spmd/bench/lm.py;
python -m spmd.bench text ...: spmd/bench/text.py."""

import sys

from spmd.bench import lm, run, text

if __name__ == "__main__":
    if sys.argv[1:2] == ["lm"]:
        sys.exit(lm.main(sys.argv[2:]))
    if sys.argv[1:2] == ["text"]:
        sys.exit(text.main(sys.argv[2:]))
    sys.exit(run.main())
