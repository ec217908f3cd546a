"""The pre-norm transformer block, written once: H = X + Attn(X g1), Y = H + MLP(H) (the MLP block's math).

Causal multi-head self-attention with its backward written out. Under TP a rank holds its heads: the
columns of Wq, Wk, Wv (column-parallel) and the rows of Wo (row-parallel), so O Wo is a partial sum that
leave all-reduces, as W2's is in the MLP. The attention core (spmd.model.attention) is given: whole
sequences on this rank, or split over the context-parallel axis (ring, Ulysses). Per layer it keeps
(activations) H, O, the MLP's pre-activation and what the core keeps (Q, K, V, P, ...); scratch (buffers)
is shared by all layers.
"""

from __future__ import annotations

import numpy as np

from spmd.model import kernels
from spmd.model.attention import AttentionCore
from spmd.model.blocks import BlockDefaults, Buffers, Rows, Share
from spmd.model.mlp import MLPBlock, mlp_backward, mlp_forward
from spmd.model.params import Flat, Laid, Table
from spmd.model.weight_grads import IMMEDIATE
from spmd.stopwatch import matmul, part


class TransformerBlock(Laid, BlockDefaults):
    wg, defers = IMMEDIATE, True  # its weight gradients can wait (zero-bubble pipelines: weight_grads.py)

    def __init__(self, table: Table, hidden: int, share: Share, seq: int, sp: bool, core: AttentionCore):
        """`table`: its share's (g1, Wq, Wk, Wv, Wo, W1, W2, g2), the last three the MLP layer's."""
        self.flat, self.h, self.share, self.seq, self.sp, self.core = Flat(table), hidden, share, seq, sp, core
        self.mlp = MLPBlock(table[-3:], hidden, share, seq, sp)
        self.saved_rows = {"hid": "local", "o": "matmul", "a": "matmul", **core.saved_rows}
        self.scratch_rows = {
            **MLPBlock.scratch_rows,
            "tm": "matmul",
            "dq": "matmul",
            "dk": "matmul",
            "dv": "matmul",
            "do": "matmul",
            **core.scratch_rows,
        }

    def saved_shapes(self, rows: Rows) -> dict[str, tuple]:
        w = self.share.attention
        return {
            "hid": (rows.local, self.h),
            "o": (rows.matmul, w),
            "a": (rows.matmul, self.share.ffn),
            **self.core.saved_shapes(rows),
        }

    def stash_sizes(self, rows: Rows) -> tuple[int, int]:
        """Elements a deferred weight gradient keeps: the MLP's, O and dY for Wo, X g1 with dQ, dK, dV; g1's."""
        products, values = self.mlp.stash_sizes(rows)
        m, h, w = rows.matmul, self.h, self.share.attention
        return products + m * (w + h) + m * (h + 3 * w), values + h

    def scratch_shapes(self, rows: Rows) -> dict[str, tuple]:
        """The MLP's, plus tm (matmul rows x h), dq dk dv do (x attention width), and the core's."""
        w = self.share.attention
        return {
            **self.mlp.scratch_shapes(rows),
            "tm": (rows.matmul, self.h),
            "dq": (rows.matmul, w),
            "dk": (rows.matmul, w),
            "dv": (rows.matmul, w),
            "do": (rows.matmul, w),
            **self.core.scratch_shapes(rows),
        }

    def prepare(self, s: Buffers) -> None:
        self.core.prepare(s)

    def feed(self, s: Buffers) -> None:
        """Nothing here depends on where the micro-batch's rows sit in their sequences."""

    def forward(self, tp, w, x, y, saved: Buffers, s: Buffers) -> None:
        g1, wq, wk, wv, wo, w1, w2, g2 = self.views(w)
        kernels.scale(x, g1, s.xl)
        zf = tp.enter(s.xl, s.xf)
        for proj, out in zip((wq, wk, wv), self.core.projections(saved, s), strict=True):
            matmul(zf, proj, out=out)
        with part("attention"):
            self.core.forward(saved, s)
        partial = tp.partial_target(saved.hid, s.part)
        matmul(saved.o, wo, out=partial)
        tp.leave(partial, saved.hid)
        np.add(saved.hid, x, out=saved.hid)
        mlp_forward(tp, w1, w2, g2, saved.hid, y, saved.a, s)

    def backward(self, tp, w, grad, x, dy, saved: Buffers, s: Buffers) -> None:
        g1, wq, wk, wv, wo, w1, w2, g2 = self.views(w)
        dg1, dwq, dwk, dwv, dwo, dw1, dw2, dg2 = self.views(grad)
        mlp_backward(tp, w1, w2, g2, dw1, dw2, dg2, saved.hid, dy, saved.a, s, self.wg)  # dy: now H's gradient
        dyf = tp.leave_grad(dy, s.dyf)
        self.wg.products(saved.o, (dyf, dwo))
        matmul(dyf, wo.T, out=s.do)
        with part("attention"):
            self.core.backward(saved, s)
        kernels.scale(x, g1, s.xl)
        zf = tp.enter(s.xl, s.xf)  # X g1 again, not kept
        self.wg.products(zf, (s.dq, dwq), (s.dk, dwk), (s.dv, dwv))
        matmul(s.dq, wq.T, out=s.dxf)
        for d, proj in ((s.dk, wk), (s.dv, wv)):
            matmul(d, proj.T, out=s.tm)
            np.add(s.dxf, s.tm, out=s.dxf)
        dzn = tp.enter_grad(s.dxf, s.xl)
        dg1 = self.wg.value(dg1)
        kernels.gain_grad(x, dzn, dg1, s.tl)
        tp.replicated_grad(dg1)
        kernels.input_grad(dy, dzn, g1, s.tl)
