"""The planner's records: a cluster (devices, memory, links, speed) and one layout's estimate on it."""

from __future__ import annotations

from dataclasses import dataclass

from spmd.transport.mesh import Mesh


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
        for name, value in (
            ("memory_bytes", self.memory_bytes),
            ("intra_bytes_per_s", self.intra_bytes_per_s),
            ("inter_bytes_per_s", self.inter_bytes_per_s),
            ("flops_per_s", self.flops_per_s),
        ):
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")

    def links(self, mesh: Mesh) -> dict[str, str]:
        """Per mesh axis: "node" (its groups stay inside one), "network", or "-" (one rank: no link)."""
        return {
            axis: "-"
            if mesh.axis_size(axis) == 1
            else "node"
            if inside_a_node(mesh, axis, self.per_node)
            else "network"
            for axis in mesh.names
        }

    def bandwidth(self, link: str) -> float:
        return {"node": self.intra_bytes_per_s, "network": self.inter_bytes_per_s, "-": float("inf")}[link]


@dataclass(frozen=True)
class Estimate:
    strategy: str  # a preset's name (mlp-fsdp), or the layout's description
    mesh: Mesh
    memory: dict[str, int]  # by kind, the rank that holds the most
    sent: dict[str, int]  # per mesh axis, the rank that sends the most over it
    links: dict[str, str]  # Cluster.links
    compute_seconds: float
    comm_seconds: float
    fits: bool

    @property
    def peak(self) -> int:
        return sum(self.memory.values())

    @property
    def step_seconds(self) -> float:
        return self.compute_seconds + self.comm_seconds


def inside_a_node(mesh: Mesh, axis: str, per_node: int) -> bool:
    """Whether every group along `axis` lies inside one node (ranks row-major, nodes of per_node ranks)."""
    names = mesh.names
    stride = 1
    for later in names[names.index(axis) + 1 :]:
        stride *= mesh.axis_size(later)
    span = stride * mesh.axis_size(axis)
    return span <= per_node and per_node % span == 0
