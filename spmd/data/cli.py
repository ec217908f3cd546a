"""python -m spmd data COMMAND: the corpus commands (prepare)."""

from __future__ import annotations

from spmd.data import prepare
from spmd.usage import UsageError, fail

COMMANDS = {"prepare": prepare.main}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in COMMANDS:
        fail(
            "python -m spmd data",
            f"name a command: {', '.join(COMMANDS)} (e.g. python -m spmd data prepare --out corpus)",
        )
    try:
        return COMMANDS[argv[0]](argv[1:])
    except (UsageError, ValueError) as exc:
        fail(f"python -m spmd data {argv[0]}", str(exc))
    return 1
