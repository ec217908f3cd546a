"""What a strategy is, as data: its mesh axes, placements, rank function, cost and schedule.

The harness, the CLI and the generic tests ask a Strategy, never a strategy's
name, so a new strategy is one new module registered in matmul/__init__.py.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from spmd.collectives.workspace import Workspace
from spmd.observe.schedule import Schedule
from spmd.transport.group import Group
from spmd.transport.mesh import Mesh, resolve_mesh

Range = tuple[int, int]
# (world, mesh, this rank's blocks, problem, workspace, **options) -> the result at rank 0, None elsewhere
RankFn = Callable[..., np.ndarray | None]
Placements = Callable[[Any, Mesh, int], dict[str, tuple[Range, Range]]]


@dataclass(frozen=True)
class Cost:
    """The closed form of one run, per rank: payload bytes sent and received, peak bytes of arrays held."""

    bytes_sent: list[int]
    bytes_received: list[int]
    peak_bytes: list[int]


@dataclass(frozen=True)
class Strategy:
    """A parallel algorithm as the harness and the tests need it.

    Attributes:
        name: the CLI name (`python -m spmd <name>`).
        summary: one line for --help.
        axes: the mesh axes it runs on, in order; a 1-axis strategy runs on all ranks by default.
        placements: (problem, mesh, rank) -> {operand: (rows, cols)}, the slices a rank starts with.
        rank_fn: (world, mesh, blocks, problem, workspace, **options) -> the result at rank 0, None elsewhere.
        cost: (problem, mesh) -> Cost, exact: the tests compare it with what was measured.
        schedule: mesh -> Schedule, for --schedule and the test that the run follows it.
    """

    name: str
    summary: str
    axes: tuple[str, ...]
    placements: Placements
    rank_fn: RankFn
    cost: Callable[[Any, Mesh], Cost]
    schedule: Callable[[Mesh], Schedule]

    def mesh(self, world_size: int, mesh: Mesh | None = None) -> Mesh:
        """`mesh` checked against this strategy and the world, or the default: one axis over every rank."""
        return resolve_mesh(self.name, self.axes, world_size, mesh)

    def blocks(self, problem, mesh: Mesh, rank: int, source: Callable[[str, Range, Range], np.ndarray]) -> dict:
        """This rank's starting blocks, each cut by source(operand, rows, cols)."""
        return {name: source(name, rows, cols) for name, (rows, cols) in self.placements(problem, mesh, rank).items()}

    def run(self, world: Group, mesh: Mesh, blocks: dict, problem, workspace: Workspace | None = None, **options):
        """Run this rank's part on `world`; the result at rank 0, None elsewhere.

        `options` go to the rank function (e.g. FSDP's overlap=False); an unknown one is a TypeError.
        """
        return self.rank_fn(world, mesh, blocks, problem, workspace, **options)
