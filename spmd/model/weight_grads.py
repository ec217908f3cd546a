"""The weight-gradient half of a block's backward, done at once or deferred (zero-bubble pipelines).

A block's backward computes its input gradient (what the previous stage waits for) and its weight gradients
(which nothing waits for): products out = a^T d, and small values (a norm gain's gradient). The block hands
every write to its unit's gradient to a WeightGrads. Done at once (the whole backward, B) they are the same
calls the block would make. Deferred (the input-gradient half, I), the products' operands are copied into a
stash and a value is computed into the stash instead of the gradient; `replay` (the weight-gradient half, W)
then makes the same calls from the stash into the unit's gradient, wherever it is by then: the same bits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from spmd.stopwatch import matmul


@dataclass
class Deferred:
    """One write to a unit's gradient, as offsets into its flat gradient: a product (a, ds) or a value."""

    offsets: list[tuple[int, tuple[int, ...]]]  # where each output goes: (offset, shape)
    a: np.ndarray | None  # a product's left operand (stash view); None for a value
    ds: list[np.ndarray]  # its right operands, or the value itself (stash views)


class WeightGrads:
    """Where a block's weight gradients go. Immediate unless `defer` was called for the current backward."""

    def __init__(self) -> None:
        self.stash: tuple[np.ndarray, np.ndarray] | None = None  # (products' operands, values) while deferring
        self.used = [0, 0]
        self.base: np.ndarray | None = None
        self.records: list[Deferred] = []

    def defer(self, stash: tuple[np.ndarray, np.ndarray], base: np.ndarray, used: tuple[int, int] = (0, 0)) -> None:
        """Defer the writes of the next backward into `base` (a unit's flat gradient buffer, not written),
        keeping what they need in `stash` from `used` elements on."""
        self.stash, self.base, self.used, self.records = stash, base, list(used), []

    def finish(self) -> tuple[list[Deferred], tuple[int, int]]:
        """The deferred writes of the backward just run, and the stash elements used so far; back to immediate."""
        records, used = self.records, (self.used[0], self.used[1])
        self.stash, self.base, self.records = None, None, []
        return records, used

    def products(self, a: np.ndarray, *pairs: tuple[np.ndarray, np.ndarray]) -> None:
        """out = a^T d for each (d, out)."""
        if self.stash is None:
            for d, out in pairs:
                matmul(a.T, d, out=out)
            return
        self.records.append(
            Deferred([self._offset(out) for _, out in pairs], self._keep(a, 0), [self._keep(d, 0) for d, _ in pairs])
        )

    def value(self, out: np.ndarray) -> np.ndarray:
        """Where to compute the value that belongs in `out` (a gain's gradient): `out` itself, or a stash view
        copied into the gradient by replay."""
        if self.stash is None:
            return out
        view = self._take(out.shape, out.dtype, 1)
        self.records.append(Deferred([self._offset(out)], None, [view]))
        return view

    def _offset(self, out: np.ndarray) -> tuple[int, tuple[int, ...]]:
        assert self.base is not None and out.flags.c_contiguous
        at = (out.__array_interface__["data"][0] - self.base.__array_interface__["data"][0]) // out.itemsize
        assert at >= 0 and at + out.size <= self.base.size, "a weight gradient outside its unit's gradient"
        return at, out.shape

    def _take(self, shape: tuple[int, ...], dtype: np.dtype, which: int) -> np.ndarray:
        assert self.stash is not None
        store = self.stash[which]
        if store.dtype != dtype:
            raise TypeError(f"a weight-gradient operand of {dtype} for a stash of {store.dtype}")
        n = math.prod(shape)
        lo = self.used[which]
        if lo + n > store.size:
            raise RuntimeError(f"the weight-gradient stash holds {store.size} elements, {lo + n} needed")
        self.used[which] = lo + n
        return store[lo : lo + n].reshape(shape)

    def _keep(self, array: np.ndarray, which: int) -> np.ndarray:
        view = self._take(array.shape, array.dtype, which)
        np.copyto(view, array)
        return view


def replay(records: list[Deferred], grad: np.ndarray) -> None:
    """The deferred writes, into `grad` (the unit's flat gradient buffer now)."""
    for record in records:
        outs = [grad[at : at + math.prod(shape)].reshape(shape) for at, shape in record.offsets]
        if record.a is None:
            np.copyto(outs[0], record.ds[0])
            continue
        for d, out in zip(record.ds, outs, strict=True):
            matmul(record.a.T, d, out=out)


IMMEDIATE = WeightGrads()  # every block's until an engine that defers gives it its own
