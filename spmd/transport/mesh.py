"""Mesh: named axes over the world's ranks, and the group of each axis.

Ranks fill the grid row-major with the last axis fastest, as in Megatron and
picotron: on Mesh({"fsdp": 2, "tp": 2}) ranks 0 and 1 are TP peers (one node's
fast links), ranks 0 and 2 FSDP peers. A group over a set of axes gets the
context given by that set (a bitmask), so the groups of different axes never
share tags, and the groups of one axis never share a rank.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from spmd.transport.group import MAX_CONTEXT, Group

MAX_AXES = 6  # contexts are axis bitmasks: 2**6 - 1 < MAX_CONTEXT


@dataclass(frozen=True)
class Mesh:
    """Axis name -> size, in order (first axis slowest). `Mesh.parse("fsdp=2,tp=2")` reads the CLI form."""

    axes: tuple[tuple[str, int], ...]

    def __init__(self, axes: Mapping[str, int] | Iterable[tuple[str, int]]):
        pairs = tuple((str(name), size) for name, size in (axes.items() if isinstance(axes, Mapping) else axes))
        object.__setattr__(self, "axes", pairs)
        self.__post_init__()

    def __post_init__(self):
        if not self.axes:
            raise ValueError("a mesh needs at least one axis")
        if len(self.axes) > MAX_AXES:
            raise ValueError(f"a mesh has at most {MAX_AXES} axes, got {len(self.axes)}")
        names = [name for name, _ in self.axes]
        if len(set(names)) != len(names):
            raise ValueError(f"mesh axis names repeat: {names}")
        for name, size in self.axes:
            if not name.isidentifier():
                raise ValueError(f"mesh axis name {name!r} is not an identifier")
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"mesh axis {name!r} needs a size >= 1, got {size!r}")
        assert (1 << len(self.axes)) - 1 <= MAX_CONTEXT

    @classmethod
    def parse(cls, text: str) -> Mesh:
        """Mesh from 'fsdp=2,tp=2'; ValueError naming the part that is not name=size."""
        axes = []
        for part in text.split(","):
            name, eq, size = part.strip().partition("=")
            if not eq or not size.strip().isdigit():
                raise ValueError(f"mesh {text!r}: expected name=size parts like fsdp=2,tp=2, got {part!r}")
            axes.append((name.strip(), int(size)))
        return cls(axes)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.axes)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(size for _, size in self.axes)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def axis_size(self, axis: str) -> int:
        return self.shape[self._index(axis)]

    def check_world(self, world_size: int) -> None:
        """ValueError unless the axis sizes multiply to `world_size`."""
        if self.size != world_size:
            raise ValueError(
                f"mesh {self} has {self.size} ranks ({' x '.join(map(str, self.shape))}) but the world has {world_size}"
            )

    def coords(self, rank: int) -> dict[str, int]:
        """Axis name -> this rank's index along it."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside mesh {self} (0..{self.size - 1})")
        out = {}
        for name, size in reversed(self.axes):
            rank, out[name] = divmod(rank, size)
        return {name: out[name] for name in self.names}

    def rank_of(self, coords: Mapping[str, int]) -> int:
        """The rank at `coords` (every axis named)."""
        rank = 0
        for name, size in self.axes:
            index = coords[name]
            if not 0 <= index < size:
                raise ValueError(f"coordinate {name}={index} is outside 0..{size - 1}")
            rank = rank * size + index
        return rank

    def members(self, axes: str | tuple[str, ...], rank: int) -> tuple[int, ...]:
        """The ranks that share every coordinate of `rank` except along `axes` (rank order)."""
        axes = self._axes(axes)
        mine = self.coords(rank)
        free = [name for name in self.names if name in axes]
        result = [mine]
        for name in free:  # enumerate the free axes, slowest first
            result = [{**c, name: i} for c in result for i in range(self.axis_size(name))]
        return tuple(sorted(self.rank_of(c) for c in result))

    def context(self, axes: str | tuple[str, ...]) -> int:
        """The tag context of the groups over `axes`: one bit per axis, so each set of axes has its own."""
        return sum(1 << self._index(name) for name in self._axes(axes))

    def group(self, world: Group, axes: str | tuple[str, ...]) -> Group:
        """The calling rank's group along `axes` (one axis name, or several: a flattened sub-mesh)."""
        self.check_world(world.size)
        return Group(
            world.comm,
            world.global_rank,
            tuple(world.to_global(r) for r in self.members(axes, world.rank)),
            self.context(axes),
        )

    def _axes(self, axes: str | tuple[str, ...]) -> tuple[str, ...]:
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        for name in axes:
            self._index(name)
        if not axes:
            raise ValueError("name at least one mesh axis")
        return axes

    def _index(self, axis: str) -> int:
        if axis not in self.names:
            raise ValueError(f"mesh {self} has no axis {axis!r} (axes: {', '.join(self.names)})")
        return self.names.index(axis)

    def __str__(self) -> str:
        return ",".join(f"{name}={size}" for name, size in self.axes)


def resolve_mesh(strategy: str, axes: tuple[str, ...], world_size: int, mesh: Mesh | None = None) -> Mesh:
    """`mesh` checked against a strategy's axes and the world, or the default: one axis over every rank."""
    if mesh is None:
        if len(axes) > 1:
            raise ValueError(
                f"strategy {strategy!r} runs on a {len(axes)}-D mesh: give --mesh "
                + ",".join(f"{axis}=N" for axis in axes)
            )
        mesh = Mesh({axes[0]: world_size})
    if mesh.names != axes:
        raise ValueError(f"strategy {strategy!r} needs mesh axes {','.join(axes)}, got {mesh}")
    mesh.check_world(world_size)
    return mesh


def bytes_by_axis(traffic, mesh: Mesh) -> dict[str, tuple[int, int]]:
    """(bytes sent, received) of a rank's Traffic over each of `mesh`'s axes (a message's tag says its group's
    axis), and over "world" (every other group: the whole world's, e.g. the gradient norm's sum)."""
    from spmd.transport.group import TAGS_PER_CONTEXT

    axis_of = {mesh.context(axis): axis for axis in mesh.names}
    out = {axis: [0, 0] for axis in (*mesh.names, "world")}
    for column, counts in ((0, traffic.sent_bytes), (1, traffic.received_bytes)):
        for (_, tag), nbytes in counts.items():
            out[axis_of.get(tag // TAGS_PER_CONTEXT, "world")][column] += nbytes
    return {axis: (sent, received) for axis, (sent, received) in out.items()}
