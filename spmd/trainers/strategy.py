"""What a training strategy is, as data: its mesh axes, how it builds a rank, its closed-form cost."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from spmd.model.config import Net
from spmd.observe.schedule import Schedule
from spmd.parallel.accounting import TrainCost
from spmd.transport.mesh import Mesh, resolve_mesh
from spmd.workloads.mlp import MLP, reference_train

Model = MLP | Net  # the MLP workload, or the composed engine's model (for the optimizer and precision flags)


@dataclass(frozen=True)
class TrainingStrategy:
    """A parallel training strategy as the CLI and the generic tests need it.

    Attributes:
        name: the CLI name (`python -m spmd <name>`).
        summary: one line for --help.
        axes: its mesh axes, in order (1 axis: all ranks by default).
        build: (world, mesh, mlp) -> this rank's engine: .step(x, target) -> total loss, .owned(), .arena.
        cost: (mlp, mesh) -> TrainCost, exact: the tests compare it with what was measured.
        check: (mlp, mesh) -> None, or a ValueError naming what does not fit, before any rank starts.
        schedule: (mlp, mesh) -> Schedule, the step table --schedule prints.
        blocking: () -> the same strategy with blocking collectives (--no-overlap).
        microbatched: it streams the batch in mlp.microbatches pieces (the others take it whole).
        bubble: (mlp, mesh) -> the idle share of a step its schedule predicts (pipelines).
        chunked: it runs mlp.chunks model chunks per rank (the others take exactly 1).
    """

    name: str
    summary: str
    axes: tuple[str, ...]
    build: Callable
    cost: Callable[[Model, Mesh], TrainCost]
    check: Callable[[Model, Mesh], None]
    schedule: Callable[[Model, Mesh], Schedule]
    blocking: Callable[[], TrainingStrategy]
    microbatched: bool = False
    bubble: Callable[[Model, Mesh], float] | None = None
    chunked: bool = False
    reference: Callable = reference_train  # (model) -> (losses, final layers) on one device
    describe: Callable[[Mesh], str] | None = None  # how the ranks are laid out, for reports and plots

    def mesh(self, world_size: int, mesh: Mesh | None = None) -> Mesh:
        """`mesh` checked against this strategy and the world, or the default: one axis over every rank."""
        return resolve_mesh(self.name, self.axes, world_size, mesh)

    def validate(self, mlp: Model, world_size: int, mesh: Mesh | None = None) -> Mesh:
        """The mesh, after every check of the strategy against the world and the model."""
        mesh = self.mesh(world_size, mesh)
        if mlp.microbatches != 1 and not self.microbatched:
            raise ValueError(f"strategy {self.name!r} takes the batch whole: micro-batches are for pipelines")
        if mlp.chunks != 1 and not self.chunked:
            raise ValueError(
                f"strategy {self.name!r} runs one model chunk per rank: --chunks is for "
                "interleaved pipelines (mlp-pp-interleaved)"
            )
        self.check(mlp, mesh)
        return mesh
