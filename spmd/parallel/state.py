"""What one rank of a composed run holds from step to step (RankState), taken from its arena by kind.

Per local unit i (the order of the rank's RankPlan.units): its parameters as held, its gradient, the fp32
master and the optimizer's state of the part its optimizer updates; the step count and the last step's
gradient norm. The engine computes on it; the checkpoint writes and restores it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from spmd.model.config import Net
from spmd.model.kernels import Arena
from spmd.model.optimizers import STATE
from spmd.parallel.rank_plan import RankPlan
from spmd.parallel.sharding import Sharding


@dataclass
class RankState:
    params: list[np.ndarray]  # in the compute dtype: the fsdp shard (ZeRO-3) or the tensor slice whole
    grads: list[np.ndarray]  # the fsdp shard (reduced as each gradient is whole) or the slice whole
    master: list[np.ndarray] | None  # mixed precision: fp32 values of the optimizer's part
    optimizer: dict[str, list[np.ndarray]]  # per kind of optimizer state (optimizers.STATE), of the optimizer's part
    # ZeRO-3's gathered weights: one unit at a time, as wide as the widest (two with overlap: the next arriving),
    # or (no reshard after forward) every unit, kept for the step; None when the parameters are held whole
    gathered: list[np.ndarray] | None
    # a unit's gradient before it is reduced (two with overlap: one reducing, the next being computed), or
    # accumulated over micro-batches; None when the backward writes into `grads` directly
    layer_grad: np.ndarray | None
    steps_done: int = 0
    grad_norm: float = math.nan  # the last step's global gradient norm (NaN until one is clipped)


def optimizer_parts(plan: RankPlan, sharding: Sharding) -> list[int]:
    """Per local unit, the elements this rank's optimizer updates: its fsdp shard, or the whole slice."""
    return [u.shard_size if sharding.optimizer else u.size for u in plan.units]


def allocate_state(
    arena: Arena, plan: RankPlan, sharding: Sharding, net: Net, grads_sharded: bool, gathers: int, unit_grads: int
) -> RankState:
    """A zeroed RankState from `arena`: `grads_sharded`, each gradient held as its fsdp shard; `gathers`, the
    units gathered at a time (0: none; every unit when the layout keeps them from forward to update);
    `unit_grads`, the unit gradients kept before their reduction (0: none)."""
    take = arena.take
    widths, shards = [u.size for u in plan.units], [u.shard_size for u in plan.units]
    params = [take("params", (s if sharding.params else w,)) for s, w in zip(shards, widths, strict=True)]
    gathered: list[np.ndarray] | None = None
    if gathers:
        gathered = (
            list(take("params", (gathers, max(widths))))
            if sharding.reshard_after_forward
            else [take("params", (w,)) for w in widths]
        )
    grads = [take("grads", (s if grads_sharded else w,)) for s, w in zip(shards, widths, strict=True)]
    layer_grad = take("grads", (unit_grads, max(widths))) if unit_grads else None
    parts = optimizer_parts(plan, sharding)
    master = [take("master", (q,)) for q in parts] if net.policy.mixed else None
    moments = {kind: [take("optimizer", (q,)) for q in parts] for kind in STATE[net.optimizer]}
    return RankState(params, grads, master, moments, gathered, layer_grad)
