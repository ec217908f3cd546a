"""MLP training strategies by name: presets of the composed engine (spmd/parallel), read by the CLI and the
generic tests."""

from spmd.trainers.presets import PRESETS
from spmd.trainers.strategy import TrainCost, TrainingStrategy

TRAINERS: dict[str, TrainingStrategy] = {t.name: t for t in PRESETS}

__all__ = ["TRAINERS", "TrainCost", "TrainingStrategy"]
