"""A unit's parameter table, and everything derived from it.

A table is a unit kind's pieces in the unit's flat order, each with its name, its whole shape and, per axis, the
range that splits it: "heads" (query heads' columns), "kv" (kv heads' columns), "ffn" (channels), "vocab"
(rows) over the tensor axis, "experts" over ep, or None (whole on every rank). From it: a rank's share of the
unit (`local`: its pieces' shapes under a cut), its size, the views of a flat buffer as named arrays (`Flat`),
where a rank's slice lives in the whole unit (`tensor_index`), the elements before a mixture of experts' experts
(`dense_prefix`), and which elements a rank is the first holder of (`first_holders`: what it writes to a
checkpoint and counts in the gradient norm). A piece that no tensor-axis range splits is replicated over tp,
likewise over ep.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np

from spmd.model.blocks import Share

TP_SPLITS = frozenset({"heads", "kv", "ffn", "vocab"})
EP_SPLITS = frozenset({"experts"})


@dataclass(frozen=True)
class Piece:
    """One named array of a unit: its whole shape and, per axis, the range that splits it (() : none)."""

    name: str
    shape: tuple[int, ...]
    split: tuple[str | None, ...] = ()

    def __post_init__(self) -> None:
        if self.split and len(self.split) != len(self.shape):
            raise ValueError(f"{self.name}: a split per axis of {self.shape}, got {self.split}")
        if not set(self.split) <= TP_SPLITS | EP_SPLITS | {None}:
            raise ValueError(f"{self.name}: unknown split in {self.split}")

    @property
    def axes(self) -> tuple[str | None, ...]:
        return self.split or (None,) * len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def over_tp(self) -> bool:
        """Whether a tensor-axis range splits it (else every tp rank holds it whole)."""
        return bool(set(self.axes) & TP_SPLITS)

    @property
    def over_ep(self) -> bool:
        """Whether ep splits it (a mixture of experts' stacked weights; else every ep rank holds it whole)."""
        return bool(set(self.axes) & EP_SPLITS)


Table = tuple[Piece, ...]
# A rank's range of each split, in elements of the axes it splits: heads and kv as columns (heads x head size)
Cut = Mapping[str, tuple[int, int]]


def share_cut(share: Share) -> dict[str, tuple[int, int]]:
    """The cut of a share's sizes (where its ranges start changes no size and no view)."""
    return {
        "heads": (0, share.attention),
        "kv": (0, share.kv_width),
        "ffn": (0, share.ffn),
        "vocab": (0, share.vocab),
        "experts": share.experts,
    }


def _ranges(piece: Piece, cut: Cut) -> tuple[tuple[int, int], ...]:
    return tuple((0, n) if key is None else cut[key] for n, key in zip(piece.shape, piece.axes, strict=True))


def local(table: Table, cut: Cut) -> Table:
    """The table of a rank's share: each split axis cut to the rank's range."""
    return tuple(replace(p, shape=tuple(hi - lo for lo, hi in _ranges(p, cut))) for p in table)


def size(table: Table) -> int:
    return sum(p.size for p in table)


def local_sizes(table: Table, cut: Cut) -> list[int]:
    """Each piece's elements in a rank's share: local(table, cut)'s sizes, without building its pieces (the
    planner asks them for every unit of every rank it costs)."""
    return [math.prod(hi - lo for lo, hi in _ranges(p, cut)) for p in table]


def dense_prefix(table: Table, cut: Cut) -> int:
    """Elements of a rank's share before the first piece split over ep (all of them if none is): the same on
    every ep rank."""
    at = 0
    for p, n in zip(table, local_sizes(table, cut), strict=True):
        if p.over_ep:
            break
        at += n
    return at


class Flat:
    """A table laid out in one flat vector, piece after piece: views of a buffer as its pieces' arrays."""

    def __init__(self, table: Table):
        self.table, runs, at = table, [], 0
        for p in table:
            runs.append((at, at + p.size, p.shape))
            at += p.size
        self.runs: tuple[tuple[int, int, tuple[int, ...]], ...] = tuple(runs)
        self.size = at

    def views(self, flat: np.ndarray) -> tuple[np.ndarray, ...]:
        """The pieces' arrays in the table's order (views of `flat`)."""
        return tuple(flat[start:stop].reshape(shape) for start, stop, shape in self.runs)

    def named(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        return {p.name: view for p, view in zip(self.table, self.views(flat), strict=True)}


def tensor_index(table: Table, cut: Cut) -> np.ndarray:
    """Where a rank's slice lives in the whole unit: each piece's elements in the cut's ranges, in the order of
    a unit laid out by local(table, cut) (so the unit's code runs on the slice unchanged)."""
    views = Flat(table).views(np.arange(size(table)))
    parts = [view[tuple(slice(*r) for r in _ranges(p, cut))].ravel() for p, view in zip(table, views, strict=True)]
    return np.concatenate(parts)


def first_holders(table: Table, j: int, e: int, over_ep: bool = False) -> np.ndarray:
    """Per element of the whole unit, whether tensor rank j (of ep rank e) is its first holder: a piece
    replicated over tp is tp rank 0's, one replicated over ep ep rank 0's (unless FSDP shards the dense weights
    over ep, `over_ep`: then each ep rank's shard is its own); an element of a split range has one holder (the
    ranks' ranges of a split are disjoint: the specs' check_tensor refuses more tp ranks than heads, kv heads or
    vocabulary rows)."""
    mine = np.ones(size(table), dtype=bool)
    for p, (start, stop, _) in zip(table, Flat(table).runs, strict=True):
        if (j and not p.over_tp) or (e and not over_ep and not p.over_ep):
            mine[start:stop] = False
    return mine


class Laid:
    """A unit whose parameters are its share's table laid out flat (`flat`): its size and views from it."""

    flat: Flat

    @property
    def size(self) -> int:
        return self.flat.size

    def views(self, flat: np.ndarray) -> tuple[np.ndarray, ...]:
        return self.flat.views(flat)
