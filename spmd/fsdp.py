"""python -m spmd.fsdp [flags]: the same as `python -m spmd fsdp [flags]` (kept for existing users)."""

import sys

if __name__ == "__main__":
    from spmd.harness.cli import main

    sys.exit(main(fixed="fsdp"))
