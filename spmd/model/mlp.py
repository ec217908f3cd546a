"""The MLP block, written once: Y = X + relu((X g) W1) W2, with the tensor axis at its conjugate points.

Under TP W1 holds this rank's ffn columns and W2 its rows, so relu(Z W1) W2 is a partial sum (leave
all-reduces it); g is replicated. Every array is taken from the rank's arena by kind: per layer it keeps its
pre-activation `a` (activations); its scratch is shared by all layers (buffers).
"""

from __future__ import annotations

import numpy as np

from spmd.model import kernels
from spmd.model.blocks import BlockDefaults, Buffers, Rows, Share
from spmd.model.params import Flat, Laid, Table
from spmd.model.weight_grads import IMMEDIATE


class MLPBlock(Laid, BlockDefaults):
    saved_rows = {"a": "matmul"}
    wg, defers = IMMEDIATE, True  # its weight gradients can wait (zero-bubble pipelines: weight_grads.py)

    def __init__(self, table: Table, hidden: int, share: Share, seq: int, sp: bool):
        self.flat, self.h, self.share, self.sp = Flat(table), hidden, share, sp  # table: its share's (W1, W2, g)

    def saved_shapes(self, rows: Rows) -> dict[str, tuple]:
        return {"a": (rows.matmul, self.share.ffn)}

    def stash_sizes(self, rows: Rows) -> tuple[int, int]:
        """Elements a deferred weight gradient keeps: relu(A) and dY for W2, X g and dZ for W1; the gain's."""
        h, f, m = self.h, self.share.ffn, rows.matmul
        return 2 * m * (h + f), h

    def scratch_shapes(self, rows: Rows) -> dict[str, tuple]:
        """Local rows: xl (X g, then dX g), tl (a temporary); matmul rows: dxf (the input-gradient partial),
        z and dz (ffn wide); under SP also xf, part and dyf (gathered input, partial output, gathered dy)."""
        h, f = self.h, self.share.ffn
        shapes = {
            "xl": (rows.local, h),
            "tl": (rows.local, h),
            "dxf": (rows.matmul, h),
            "z": (rows.matmul, f),
            "dz": (rows.matmul, f),
        }
        if self.sp:
            shapes.update(xf=(rows.matmul, h), part=(rows.matmul, h), dyf=(rows.matmul, h))
        return shapes

    scratch_rows = {
        "xl": "local",
        "tl": "local",
        "dxf": "matmul",
        "z": "matmul",
        "dz": "matmul",
        "xf": "matmul",
        "part": "matmul",
        "dyf": "matmul",
    }

    def prepare(self, s: Buffers) -> None:
        """Nothing in the MLP's scratch is constant."""

    def feed(self, s: Buffers) -> None:
        """Nothing here depends on where the micro-batch's rows sit in their sequences."""

    def forward(self, tp, w: np.ndarray, x: np.ndarray, y: np.ndarray, saved: Buffers, s: Buffers) -> None:
        w1, w2, g = self.views(w)
        mlp_forward(tp, w1, w2, g, x, y, saved.a, s)

    def backward(self, tp, w, grad, x, dy, saved: Buffers, s: Buffers) -> None:
        """dy (the output's gradient) becomes the input's, in place; the layer's gradient goes into `grad`."""
        w1, w2, g = self.views(w)
        dw1, dw2, dg = self.views(grad)
        mlp_backward(tp, w1, w2, g, dw1, dw2, dg, x, dy, saved.a, s, self.wg)


def mlp_forward(tp, w1, w2, g, x, y, a, s: Buffers) -> None:
    """y = x + relu((x g) w1) w2, keeping the pre-activation in `a`."""
    kernels.scale(x, g, s.xl)
    xf = tp.enter(s.xl, s.xf)
    partial = tp.partial_target(y, s.part)
    kernels.forward(xf, w1, w2, a, s.z, partial)
    tp.leave(partial, y)
    np.add(y, x, out=y)


def mlp_backward(tp, w1, w2, g, dw1, dw2, dg, x, dy, a, s: Buffers, wg) -> None:
    dyf = tp.leave_grad(dy, s.dyf)
    kernels.scale(x, g, s.xl)
    xf = tp.enter(s.xl, s.xf)  # X g again: recomputed, not kept (gathered again under SP)
    kernels.backward(dyf, xf, a, w1, w2, dw1, dw2, _Scratch(s.z, s.dz, s.dxf), wg)
    dxn = tp.enter_grad(s.dxf, s.xl)
    dg = wg.value(dg)
    kernels.gain_grad(x, dxn, dg, s.tl)
    tp.replicated_grad(dg)
    kernels.input_grad(dy, dxn, g, s.tl)


class _Scratch:
    """The names kernels.backward writes to."""

    def __init__(self, z, dz, dxn):
        self.z, self.dz, self.dxn = z, dz, dxn
