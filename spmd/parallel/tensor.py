"""The tensor axis at Megatron's conjugate points, as a block calls it.

A block enters the tensor-parallel region before its column-parallel matmuls and leaves it after its
row-parallel one. Plain TP (Megatron's f and g): enter is the identity, leave an all-reduce of the partial
output; in backward, leave's conjugate is the identity and enter's an all-reduce of the input gradient.
Sequence parallel (SP): between the regions each rank holds only its rows, so enter all-gathers rows and
leave reduce-scatters them (TP's all-reduce, split in two); backward all-gathers the output gradient,
gathers the entered input again (recomputed, not kept) and reduce-scatters the input gradient; a
replicated weight used outside the region (a norm's gain) saw only this rank's rows: all-reduce its gradient.
Without a tensor axis every point is the identity.
"""

from __future__ import annotations

import numpy as np

from spmd.collectives import Workspace, all_gather, all_reduce, reduce_scatter
from spmd.layout import block_sizes
from spmd.transport.group import Group


class TensorParallel:
    """One rank's tensor axis: `group` (None or size 1: no tensor parallelism), `sp`: sequence parallel."""

    def __init__(self, group: Group | None, sp: bool, workspace: Workspace):
        self.group = group if group is not None and group.size > 1 else None
        self.sp = sp and self.group is not None
        self.workspace = workspace
        self.counts: list[int] = []  # rows of the current micro-batch on each tp rank (SP)
        self.tick = _nothing  # called at every point: the engine moves its background collectives on there

    def bind_rows(self, rows: int) -> None:
        """The micro-batch's rows on this data rank, split over the tensor axis under SP."""
        if self.sp and self.group is not None:
            self.counts = block_sizes(rows, self.group.size)

    def enter(self, local: np.ndarray, full: np.ndarray | None) -> np.ndarray:
        """Forward into the region: `local` (this rank's rows) as the rows the matmuls see."""
        self.tick()
        if self.sp and self.group is not None:
            return all_gather(self.group, local, self.counts, out=full)
        return local

    def partial_target(self, local_out: np.ndarray, full: np.ndarray | None) -> np.ndarray:
        """Where the row-parallel matmul writes its partial output: the output itself, or all rows under SP."""
        return full if self.sp and full is not None else local_out

    def leave(self, partial: np.ndarray, local_out: np.ndarray) -> np.ndarray:
        """Forward out of the region: the sum over tp ranks of `partial`, this rank's rows, in local_out."""
        self.tick()
        if self.group is None:
            return partial
        if self.sp:
            return reduce_scatter(self.group, partial, workspace=self.workspace, out=local_out)
        return all_reduce(self.group, partial, self.workspace, out=partial)

    def leave_grad(self, local: np.ndarray, full: np.ndarray | None) -> np.ndarray:
        """Backward of leave: the output gradient on the rows the matmuls saw."""
        return self.enter(local, full)

    def enter_grad(self, partial: np.ndarray, local_out: np.ndarray) -> np.ndarray:
        """Backward of enter: the input gradient (partial on each tp rank) summed, this rank's rows."""
        return self.leave(partial, local_out)

    def sum_partial(self, values: np.ndarray) -> None:
        """Numbers each tp rank computed from its share of the channels (a mixture of experts' gate gradients),
        summed over tp in place."""
        self.tick()
        if self.group is not None:
            all_reduce(self.group, values, out=values)  # k numbers a row: its own scratch, as replicated_grad

    def replicated_grad(self, grad: np.ndarray) -> None:
        """A replicated weight's gradient, from this rank's rows only under SP: summed over tp, in place."""
        if self.sp and self.group is not None:
            all_reduce(self.group, grad, out=grad)  # h/t elements: its own scratch, as the loss (the
            # gradient workspace may be busy with a layer's reduction in the background)


def _nothing() -> None:
    """No background work."""
