"""MLP training under each parallel strategy: the registry the CLI and the generic tests read."""

from spmd.train.pipeline import GPIPE, INTERLEAVED, ONE_F_ONE_B
from spmd.train.record import TrainCost, Trainer
from spmd.train.sequence_parallel import SP
from spmd.train.sharded import DP, FSDP, FSDP_TP, TP, ZERO1, ZERO2

TRAINERS: dict[str, Trainer] = {
    t.name: t for t in (DP, ZERO1, ZERO2, FSDP, TP, SP, GPIPE, ONE_F_ONE_B, INTERLEAVED, FSDP_TP)
}


def get_trainer(name: str) -> Trainer:
    """The training strategy called `name`; KeyError listing the known ones otherwise."""
    try:
        return TRAINERS[name]
    except KeyError:
        raise KeyError(f"unknown training strategy {name!r}; known: {', '.join(TRAINERS)}") from None


__all__ = ["TRAINERS", "TrainCost", "Trainer", "get_trainer"]
