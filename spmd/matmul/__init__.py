"""The problem statement's matmul, C = A @ B, and its strategies by name: the registry the CLI, the harness and
the generic tests read."""

from spmd.matmul.dp import DP
from spmd.matmul.fsdp import FSDP
from spmd.matmul.strategy import Cost, Strategy
from spmd.observe.schedule import Cell, Schedule

STRATEGIES: dict[str, Strategy] = {s.name: s for s in (DP, FSDP)}


def get(name: str) -> Strategy:
    """The strategy called `name`; KeyError listing the known ones otherwise."""
    try:
        return STRATEGIES[name]
    except KeyError:
        raise KeyError(f"unknown strategy {name!r}; known: {', '.join(STRATEGIES)}") from None


__all__ = ["STRATEGIES", "Cell", "Cost", "Schedule", "Strategy", "get"]
