"""Training from Python, as dp_mat_mul is matmul from Python: one call runs a strategy's steps on threads.

    from spmd import train_mlp
    run = train_mlp("mlp-fsdp", devices=4, layers=4, hidden=64, steps=3)
    run.losses, run.memory[0]["params"], run.bytes_sent, run.layers[0]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from spmd.transport.group import Group
from spmd.transport.mesh import Mesh
from spmd.transport.threads import run_threads
from spmd.workloads.mlp import MLP


@dataclass(frozen=True)
class TrainingRun:
    """What a run left: the loss per step, and per rank the bytes it sent and held by kind; the final layers."""

    strategy: str
    mesh: Mesh
    mlp: MLP
    losses: list[float]
    bytes_sent: list[int]
    memory: list[dict[str, int]]
    layers: list[np.ndarray]  # every layer's flat parameters [W1, W2, g], assembled from the ranks that own them


def train_mlp(strategy: str, devices: int = 4, mesh: str | Mesh | None = None, **mlp_fields) -> TrainingRun:
    """Train the MLP with `strategy` (a name of spmd.train.TRAINERS) on `devices` threads; mlp_fields go to MLP."""
    from spmd.train import TRAINERS

    if strategy not in TRAINERS:
        raise ValueError(f"unknown training strategy {strategy!r}; one of {', '.join(TRAINERS)}")
    trainer, mlp = TRAINERS[strategy], MLP(**mlp_fields)
    mesh = trainer.validate(mlp, devices, Mesh.parse(mesh) if isinstance(mesh, str) else mesh)

    def rank_fn(comm, rank):
        engine = trainer.build(Group.world(comm, rank), mesh, mlp)
        losses = [engine.step(*mlp.batch(step)) for step in range(mlp.steps)]
        return losses, comm.traffic(rank).bytes_sent(), engine.arena.by_kind(), engine.owned()

    results = run_threads(devices, rank_fn)
    layers = [np.zeros(mlp.layer_size, dtype=mlp.dtype) for _ in range(mlp.layers)]
    for *_, owned in results:
        for layer, index, values in owned:
            layers[layer][index] = values
    return TrainingRun(strategy, mesh, mlp, results[0][0], [r[1] for r in results], [r[2] for r in results], layers)
