"""Per-device memory, bytes per link and an estimated step time for every strategy and mesh, at any scale.

Every byte figure comes from the same closed forms the tests assert against
measured runs (each mlp-* preset's composition); nothing here is a second model of the
strategies. What is added is only the cluster: which mesh axes stay inside a
node, the links' bandwidths and the devices' speed, for a step time that
assumes no overlap of compute and communication (an upper bound).
"""

from __future__ import annotations

from dataclasses import dataclass

from spmd.model.config import Net
from spmd.model.kernels import MEMORY_KINDS
from spmd.trainers.presets import PRESETS, Preset
from spmd.transport.mesh import Mesh

COMPUTED_ITEMSIZE = 4  # the costs are evaluated for float32, then scaled: every figure is elements x bytes


@dataclass(frozen=True)
class Model:
    """spmd's MLP at planning scale; `element_bytes` for weights, state and activations."""

    layers: int
    hidden: int
    ffn: int
    tokens: int
    element_bytes: int = 2
    microbatches: int = 8  # for pipelines

    def net(self, preset: Preset, stages: int = 1) -> Net:
        """The MLP `preset` runs; interleaved pipelines take 2 chunks a rank where the layers allow (and
        refuse micro-batches that are not a multiple of the stages: listed as refused)."""
        m = self.microbatches if preset.pipelined else 1
        chunks = max(1, min(2, self.layers // stages)) if preset.chunked and stages > 1 else 1
        return preset.net(
            layers=self.layers,
            hidden=self.hidden,
            ffn=self.ffn,
            batch=self.tokens,
            microbatches=m,
            chunks=chunks,
            dtype="float32",
        )

    @property
    def parameters(self) -> int:
        return self.layers * (2 * self.hidden * self.ffn + self.hidden)


@dataclass(frozen=True)
class Cluster:
    devices: int
    memory_bytes: float
    per_node: int
    intra_bytes_per_s: float
    inter_bytes_per_s: float
    flops_per_s: float

    def __post_init__(self):
        if self.devices < 1 or self.per_node < 1:
            raise ValueError("devices and devices per node must be >= 1")
        for name in ("memory_bytes", "intra_bytes_per_s", "inter_bytes_per_s", "flops_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class Estimate:
    strategy: str
    mesh: Mesh
    memory: dict[str, int]  # by kind, the rank that holds the most
    sent: dict[str, int]  # per mesh axis, the rank that sends the most over it
    links: dict[str, str]  # per mesh axis: "node" (stays inside one), "network", or "-" (one rank: no link)
    compute_seconds: float
    comm_seconds: float
    fits: bool

    @property
    def peak(self) -> int:
        return sum(self.memory.values())

    @property
    def step_seconds(self) -> float:
        return self.compute_seconds + self.comm_seconds


def meshes(trainer: Preset, devices: int) -> list[Mesh]:
    """Every mesh of the trainer's axes over `devices` (2-D: each divisor for the last axis)."""
    if len(trainer.axes) == 1:
        return [Mesh({trainer.axes[0]: devices})]
    outer, inner = trainer.axes
    return [Mesh({outer: devices // t, inner: t}) for t in range(1, devices + 1) if devices % t == 0]


def inside_a_node(mesh: Mesh, axis: str, per_node: int) -> bool:
    """Whether every group along `axis` lies inside one node (ranks row-major, nodes of per_node ranks)."""
    names = mesh.names
    stride = 1
    for later in names[names.index(axis) + 1 :]:
        stride *= mesh.axis_size(later)
    span = stride * mesh.axis_size(axis)
    return span <= per_node and per_node % span == 0


def estimate(trainer: Preset, model: Model, cluster: Cluster, mesh: Mesh) -> Estimate:
    """One strategy on one mesh; ValueError if the strategy cannot run there (the reason named)."""
    net = model.net(trainer, mesh.size if trainer.pipelined else 1)
    mesh = trainer.validate(net, cluster.devices, mesh)
    cost = trainer.composition.cost(net, mesh)

    def scaled(nbytes: int) -> int:
        return nbytes * model.element_bytes // COMPUTED_ITEMSIZE

    worst = max(range(mesh.size), key=lambda r: cost.peak_bytes[r])
    memory = {kind: scaled(cost.memory[worst][kind]) for kind in MEMORY_KINDS}
    links = {
        axis: "-" if mesh.axis_size(axis) == 1 else "node" if inside_a_node(mesh, axis, cluster.per_node) else "network"
        for axis in mesh.names
    }
    bandwidth = {"node": cluster.intra_bytes_per_s, "network": cluster.inter_bytes_per_s, "-": float("inf")}
    comm = max(sum(scaled(tally.sent[axis]) / bandwidth[links[axis]] for axis in mesh.names) for tally in cost.traffic)
    compute = max(cost.flops) / cluster.flops_per_s
    if trainer.pipelined:  # a pipeline idles this share of its step (1F1B: (p-1)/(m+p-1))
        compute /= 1 - trainer.composition.bubble(net, mesh)
    sent = {axis: max(scaled(t.sent[axis]) for t in cost.traffic) for axis in mesh.names}
    fits = sum(memory.values()) <= cluster.memory_bytes
    return Estimate(trainer.name, mesh, memory, sent, links, compute, comm, fits)


def plan(
    model: Model, cluster: Cluster, names: list[str] | None = None, mesh: Mesh | None = None
) -> tuple[list[Estimate], list[tuple[str, Mesh, str]]]:
    """Every (strategy, mesh) that can run: fitting ones first, fastest first; and those that cannot, why."""
    estimates, refused = [], []
    for name in names or PRESETS:
        trainer = PRESETS[name]
        candidates = (
            [mesh]
            if mesh is not None and mesh.names == trainer.axes
            else []
            if mesh is not None
            else meshes(trainer, cluster.devices)
        )
        for candidate in candidates:
            try:
                estimates.append(estimate(trainer, model, cluster, candidate))
            except ValueError as exc:
                refused.append((name, candidate, str(exc)))
    estimates.sort(key=lambda e: (not e.fits, e.step_seconds if e.fits else e.peak))
    return estimates, refused
