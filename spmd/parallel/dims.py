"""The mesh of a composed run: any subset of the axes pp, dp, fsdp, ep, cp, tp, in that one nesting order.

Pipeline outermost, tensor innermost (as Megatron and torchtitan): the last axis is fastest, so a tp
group is adjacent ranks (one node), and a pp stage spans the rest. dp replicates the model, fsdp shards
it (both: HSDP, sharded inside an fsdp group, replicated across dp); cp splits every sequence's tokens
(context parallelism: the weights replicated over it, their gradients summed over it). ep splits a mixture of
experts' experts and, for everything else, is one more data axis: the batch is split over dp x fsdp x ep, the
dense weights' gradients summed over it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from spmd.transport.mesh import Mesh

AXES = ("pp", "dp", "fsdp", "ep", "cp", "tp")


@dataclass(frozen=True)
class Dims:
    """Axis sizes of a composed run (1 where the mesh leaves an axis out)."""

    mesh: Mesh
    _sizes: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        names = self.mesh.names
        for name in names:
            if name not in AXES:
                raise ValueError(f"--mesh {self.mesh}: unknown axis {name!r}; the axes are {', '.join(AXES)}")
        object.__setattr__(self, "_sizes", dict(self.mesh.axes))  # asked for often: the cost model at scale
        order = [AXES.index(n) for n in names]
        if order != sorted(order):
            raise ValueError(
                f"--mesh {self.mesh}: axes go in the order {', '.join(AXES)} (pipeline outermost, "
                f"tensor innermost); write --mesh "
                + ",".join(f"{n}={self.mesh.axis_size(n)}" for n in sorted(names, key=AXES.index))
            )

    @classmethod
    def parse(cls, text: str) -> Dims:
        return cls(Mesh.parse(text))

    def size(self, axis: str) -> int:
        return self._sizes.get(axis, 1)

    def coord(self, axis: str, rank: int) -> int:
        return _coords(self.mesh, rank).get(axis, 0)

    @property
    def data_size(self) -> int:
        """Ranks the batch is split over: dp x fsdp x ep."""
        return self.size("dp") * self.size("fsdp") * self.size("ep")

    def data_rank(self, rank: int) -> int:
        return (self.coord("dp", rank) * self.size("fsdp") + self.coord("fsdp", rank)) * self.size("ep") + self.coord(
            "ep", rank
        )


@functools.lru_cache(maxsize=4096)
def _coords(mesh: Mesh, rank: int) -> dict[str, int]:
    return mesh.coords(rank)  # the caller only reads it
