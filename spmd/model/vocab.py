"""The language model's ends, split over the vocabulary: the token embedding, the final RMSNorm, the LM head
with its cross-entropy (Megatron's vocab-parallel layers, written for uneven shards).

Embedding: tensor rank j holds vocabulary rows [v0, v1); it looks up the ids it owns, zeroes the others, and
leave sums the rows over tp (reduce-scatters them to sequence shards under SP). Backward: dy's rows (gathered
under SP) added into the owned rows (np.add.at: deterministic), no other collective.
Head: logits of the rank's vocabulary columns, z = X W^T (W stored (V, h) as the embedding, so a tied head is
the embedding's layout). Cross-entropy over sharded logits: an all-reduce MAX of each row's maximum m, then one
all-reduce SUM of [sum_v exp(z - m), z_target] (only the target's owner has it); loss = log s - (z_target - m).
Backward needs no collective: dz = (softmax - onehot) / N, N the step's target tokens over every micro-batch
and data rank; the input gradient is a column-parallel partial sum, reduced by enter's conjugate.
The logits (and their softmax, written over them) are kept in the state dtype: fp32 under mixed precision.
"""

from __future__ import annotations

import numpy as np

from spmd.collectives import all_reduce
from spmd.layout import block_range
from spmd.model import kernels
from spmd.model import lm_kernels as lm
from spmd.model.blocks import BlockDefaults, Buffers, Rows
from spmd.model.params import Flat, Laid, Table
from spmd.model.weight_grads import IMMEDIATE
from spmd.stopwatch import matmul


def owned_rows(ids, v0: int, v1: int, local, hit) -> None:
    """hit = 1 where an id is in this shard's vocabulary [v0, v1), else 0; local = its row there (0 if not)."""
    np.subtract(ids, v0, out=local)
    np.greater_equal(ids, v0, out=hit)
    np.multiply(hit, ids < v1, out=hit)
    np.multiply(local, hit, out=local)  # rows not owned look up row 0, then are zeroed


class Embedding(Laid, BlockDefaults):
    saved_rows: dict[str, str] = {}
    dtypes = {"ids": "index", "local": "index", "hit": "index"}
    scratch_rows = {"ids": "matmul", "part": "matmul", "dyf": "matmul", "hit": "matmul", "local": "matmul"}

    def __init__(self, table: Table, hidden: int, vocab: tuple[int, int], sp: bool):
        self.flat, self.h, (self.v0, self.v1), self.sp = Flat(table), hidden, vocab, sp

    def saved_shapes(self, rows: Rows) -> dict[str, tuple]:
        return {}

    def scratch_shapes(self, rows: Rows) -> dict[str, tuple]:
        """ids (matmul rows: the micro-batch's tokens), local (their row in this shard), hit (owned: 1, else 0);
        under SP part and dyf (the summed rows before the scatter, dy gathered)."""
        m = rows.matmul
        shapes: dict[str, tuple] = {"ids": (m,), "local": (m,), "hit": (m,)}
        if self.sp:
            shapes.update(part=(m, self.h), dyf=(m, self.h))
        return shapes

    def prepare(self, s: Buffers) -> None:
        """Nothing constant."""

    def feed(self, s: Buffers) -> None:
        """Which of the micro-batch's ids this shard owns, and their rows in it."""
        owned_rows(s.ids, self.v0, self.v1, s.local, s.hit)

    def forward(self, tp, w, x, y, saved: Buffers, s: Buffers) -> None:
        """y = the embeddings of the micro-batch's ids (x, the activations before the model, is not read)."""
        (table,) = self.views(w)
        partial = tp.partial_target(y, s.part)
        np.take(table, s.local, axis=0, out=partial, mode="clip")
        partial *= s.hit[:, None].astype(partial.dtype, copy=False)
        tp.leave(partial, y)

    def backward(self, tp, w, grad, x, dy, saved: Buffers, s: Buffers) -> None:
        dyf = tp.leave_grad(dy, s.dyf)
        (table,) = self.views(grad)
        table[...] = 0
        owned = s.hit.astype(bool)
        np.add.at(table, s.local[owned], dyf[owned])


class FinalNorm(Laid, BlockDefaults):
    saved_rows = {"r": "local"}
    dtypes = {"r": "state", "c": "state"}
    scratch_rows = {"tl": "local", "tl2": "local", "dxl": "local", "c": "local"}

    def __init__(self, table: Table, hidden: int, eps: float):
        self.flat, self.h, self.eps = Flat(table), hidden, eps

    def saved_shapes(self, rows: Rows) -> dict[str, tuple]:
        return {"r": (rows.local,)}

    def scratch_shapes(self, rows: Rows) -> dict[str, tuple]:
        lo, h = rows.local, self.h
        return {"tl": (lo, h), "tl2": (lo, h), "dxl": (lo, h), "c": (lo,)}

    def prepare(self, s: Buffers) -> None:
        """Nothing constant."""

    def feed(self, s: Buffers) -> None:
        """Nothing depends on the rows' positions."""

    def forward(self, tp, w, x, y, saved: Buffers, s: Buffers) -> None:
        lm.rms_norm(x, w, self.eps, saved.r, y, s.tl)

    def backward(self, tp, w, grad, x, dy, saved: Buffers, s: Buffers) -> None:
        lm.rms_norm_backward(x, w, saved.r, dy, s.dxl, grad, s.c, s.tl, s.tl2)
        tp.replicated_grad(grad)
        np.copyto(dy, s.dxl)


class Head(Laid, BlockDefaults):
    """The LM head and the loss. forward returns the loss of this rank's rows between the regions (its SP
    block of the matmul rows, or all of them), as a sum already divided by `tokens`."""

    saved_rows = {"p": "matmul"}
    wg, defers = IMMEDIATE, True  # its weight gradient can wait (zero-bubble pipelines: weight_grads.py)
    dtypes = {"targets": "index", "tlocal": "index", "thit": "index", "p": "state", "rowmax": "state", "st": "state"}
    scratch_rows = {
        "targets": "matmul",
        "xf": "matmul",
        "dxf": "matmul",
        "rowmax": "matmul",
        "st": "matmul",
        "tlocal": "matmul",
        "thit": "matmul",
    }

    def __init__(self, table: Table, hidden: int, vocab: tuple[int, int], sp: bool, tokens: int, stat_dtype):
        self.flat, self.h, (self.v0, self.v1), self.sp, self.tokens = Flat(table), hidden, vocab, sp, tokens
        self.stat_dtype = stat_dtype

    def saved_shapes(self, rows: Rows) -> dict[str, tuple]:
        return {"p": (rows.matmul, self.v1 - self.v0)}

    def stash_sizes(self, rows: Rows) -> tuple[int, int]:
        """Elements its deferred weight gradient keeps: dZ (the vocabulary shard wide) and the input."""
        return rows.matmul * (self.v1 - self.v0 + self.h), 0

    def scratch_shapes(self, rows: Rows) -> dict[str, tuple]:
        """targets (the matmul rows' next tokens), tlocal and thit (the target's column here, owned or not),
        rowmax (each row's maximum), st ([sum of exponentials, target logit] per row), dxf (the input gradient's
        partial); under SP xf (the gathered input)."""
        m = rows.matmul
        shapes: dict[str, tuple] = {
            "targets": (m,),
            "tlocal": (m,),
            "thit": (m,),
            "rowmax": (m,),
            "st": (m, 2),
            "dxf": (m, self.h),
        }
        if self.sp:
            shapes["xf"] = (m, self.h)
        return shapes

    def prepare(self, s: Buffers) -> None:
        """Nothing constant."""

    def feed(self, s: Buffers) -> None:
        """Which of the micro-batch's targets this shard owns, and their columns in it."""
        owned_rows(s.targets, self.v0, self.v1, s.tlocal, s.thit)

    def forward(self, tp, w, x, y, saved: Buffers, s: Buffers) -> float:
        """The loss of this rank's rows; the softmax kept in saved.p (y, after the model, is not written)."""
        table = self.views(w)[0]
        xf = tp.enter(x, s.xf)
        z = saved.p
        matmul(xf, table.T, out=z)
        rows = np.arange(z.shape[0])
        # the row maxima (fmax's loop is a third faster than max's; a NaN still reaches the loss through exp)
        np.fmax.reduce(z, axis=1, out=s.rowmax) if z.shape[1] else s.rowmax.fill(-np.inf)
        if tp.group is not None:
            all_reduce(tp.group, s.rowmax, out=s.rowmax, op=np.maximum)
        np.subtract(z, s.rowmax[:, None], out=z)
        s.st[:, 1] = z[rows, s.tlocal] * s.thit  # the target's logit, minus the row maximum, from its owner
        np.exp(z, out=z)
        kernels.row_sums(z, s.st[:, 0])
        if tp.group is not None:
            all_reduce(tp.group, s.st, out=s.st)
        np.divide(z, s.st[:, :1], out=z)  # the softmax
        losses = np.log(s.st[:, 0]) - s.st[:, 1]
        lo, hi = (
            block_range(z.shape[0], tp.group.size, tp.group.rank) if tp.sp and tp.group is not None else (0, z.shape[0])
        )
        return float(np.sum(losses[lo:hi], dtype=np.float64)) / self.tokens

    def backward(self, tp, w, grad, x, dy, saved: Buffers, s: Buffers) -> None:
        """dy (not read: the loss is the end) becomes the input's gradient; the head's into `grad`."""
        table, dtable = self.views(w)[0], self.views(grad)[0]
        z = saved.p
        rows = np.arange(z.shape[0])
        z[rows, s.tlocal] -= s.thit  # softmax - onehot, the 1 on the target's owner only
        np.multiply(z, 1 / self.tokens, out=z)
        xf = tp.enter(x, s.xf)  # gathered again under SP
        dz = z.astype(table.dtype, copy=False)
        self.wg.products(dz, (xf, dtable))
        matmul(dz, table, out=s.dxf)
        summed = tp.enter_grad(s.dxf, dy)
        if summed is not dy:
            np.copyto(dy, summed)
