"""python -m spmd.dp [flags]: the same as `python -m spmd dp [flags]` (kept for existing users)."""

import sys

if __name__ == "__main__":
    from spmd.harness.cli import main

    sys.exit(main(fixed="dp"))
