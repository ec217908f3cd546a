"""The pre-norm transformer block, written once: H = X + Attn(X g1), Y = H + MLP(H) (the MLP block's math).

Causal multi-head self-attention with its backward written out. Under TP a rank holds its heads: the
columns of Wq, Wk, Wv (column-parallel) and the rows of Wo (row-parallel), so O Wo is a partial sum that
leave all-reduces, as W2's is in the MLP; the attention core runs on whole sequences, per head, locally
(attend is where context parallelism will plug in). Per layer it keeps (activations) H, Q, K, V, the
attention probabilities P and O, and the MLP's pre-activation; scratch (buffers) is shared by all layers.
"""

from __future__ import annotations

import numpy as np

from spmd.model import kernels
from spmd.model.blocks import Buffers, Rows, Share, take
from spmd.model.config import layer_size, transformer_views
from spmd.model.mlp import MLPBlock, mlp_backward, mlp_forward


class TransformerBlock:
    saved_rows = {"hid": "local", "q": "matmul", "k": "matmul", "v": "matmul", "o": "matmul", "a": "matmul",
                  "p": "sequences"}

    def __init__(self, hidden: int, share: Share, seq: int, sp: bool):
        self.h, self.share, self.seq, self.sp = hidden, share, seq, sp
        self.mlp = MLPBlock(hidden, share, seq, sp)
        self.scale = 1 / np.sqrt(share.head_size)

    @property
    def size(self) -> int:
        return layer_size("transformer", self.h, self.share.ffn, self.share.attention)

    def saved(self, arena, rows: Rows) -> Buffers:
        w, s = self.share.attention, self.seq
        return take(arena, "activations", {
            "hid": (rows.local, self.h), "q": (rows.matmul, w), "k": (rows.matmul, w), "v": (rows.matmul, w),
            "p": (rows.sequences, self.share.heads, s, s), "o": (rows.matmul, w),
            "a": (rows.matmul, self.share.ffn),
        })

    def scratch_shapes(self, rows: Rows) -> dict[str, tuple]:
        """The MLP's, plus tm (matmul rows x h), dq dk dv do (x attention width), e e2 mask (seq^2), r ones (seq)."""
        w, s = self.share.attention, self.seq
        return {**self.mlp.scratch_shapes(rows), "tm": (rows.matmul, self.h), "dq": (rows.matmul, w),
                "dk": (rows.matmul, w), "dv": (rows.matmul, w), "do": (rows.matmul, w), "e": (s, s), "e2": (s, s),
                "r": (s,), "ones": (s,), "mask": (s, s)}

    scratch_rows = {**MLPBlock.scratch_rows, "tm": "matmul", "dq": "matmul", "dk": "matmul", "dv": "matmul",
                    "do": "matmul"}

    def prepare(self, s: Buffers) -> None:
        """Fill the scratch that never changes: ones, and the causal mask (0 on and below the diagonal, -inf above)."""
        s.ones[...] = 1
        s.mask[np.triu_indices(self.seq, 1)] = -np.inf

    def forward(self, tp, w, x, y, saved: Buffers, s: Buffers) -> None:
        g1, wq, wk, wv, wo, w1, w2, g2 = transformer_views(w, self.h, self.share.ffn, self.share.attention)
        kernels.scale(x, g1, s.xl)
        zf = tp.enter(s.xl, getattr(s, "xf", None))
        for proj, out in ((wq, saved.q), (wk, saved.k), (wv, saved.v)):
            np.matmul(zf, proj, out=out)
        self.attend(saved, s)
        partial = tp.partial_target(saved.hid, getattr(s, "part", None))
        np.matmul(saved.o, wo, out=partial)
        tp.leave(partial, saved.hid)
        np.add(saved.hid, x, out=saved.hid)
        mlp_forward(tp, w1, w2, g2, saved.hid, y, saved.a, s)

    def attend(self, saved: Buffers, s: Buffers) -> None:
        """O = softmax(Q K^T / sqrt(d) + causal) V for each sequence and head (context parallelism plugs in here)."""
        n, d = self.seq, self.share.head_size
        for b in range(saved.p.shape[0]):
            rows = slice(b * n, (b + 1) * n)
            for j in range(self.share.heads):
                cols, p = slice(j * d, (j + 1) * d), saved.p[b, j]
                np.matmul(saved.q[rows, cols], saved.k[rows, cols].T, out=s.e)
                np.multiply(s.e, self.scale, out=s.e)
                np.add(s.e, s.mask, out=s.e)
                np.max(s.e, axis=1, out=s.r)
                np.einsum("i,j->ij", s.r, s.ones, out=s.e2)  # the row maxima, spread without a ufunc buffer
                np.subtract(s.e, s.e2, out=s.e)
                np.exp(s.e, out=s.e)
                np.sum(s.e, axis=1, out=s.r)
                np.reciprocal(s.r, out=s.r)
                np.einsum("ij,i->ij", s.e, s.r, out=p)
                np.matmul(p, saved.v[rows, cols], out=saved.o[rows, cols])

    def backward(self, tp, w, grad, x, dy, saved: Buffers, s: Buffers) -> None:
        h, f, wd = self.h, self.share.ffn, self.share.attention
        g1, wq, wk, wv, wo, w1, w2, g2 = transformer_views(w, h, f, wd)
        dg1, dwq, dwk, dwv, dwo, dw1, dw2, dg2 = transformer_views(grad, h, f, wd)
        mlp_backward(tp, w1, w2, g2, dw1, dw2, dg2, saved.hid, dy, saved.a, s)  # dy: now the gradient of H
        dyf = tp.leave_grad(dy, getattr(s, "dyf", None))
        np.matmul(saved.o.T, dyf, out=dwo)
        np.matmul(dyf, wo.T, out=s.do)
        self.attend_backward(saved, s)
        kernels.scale(x, g1, s.xl)
        zf = tp.enter(s.xl, getattr(s, "xf", None))  # X g1 again, not kept
        for dproj, d in ((dwq, s.dq), (dwk, s.dk), (dwv, s.dv)):
            np.matmul(zf.T, d, out=dproj)
        np.matmul(s.dq, wq.T, out=s.dxf)
        for d, proj in ((s.dk, wk), (s.dv, wv)):
            np.matmul(d, proj.T, out=s.tm)
            np.add(s.dxf, s.tm, out=s.dxf)
        dzn = tp.enter_grad(s.dxf, s.xl)
        kernels.gain_grad(x, dzn, dg1, s.tl)
        tp.replicated_grad(dg1)
        kernels.input_grad(dy, dzn, g1, s.tl)

    def attend_backward(self, saved: Buffers, s: Buffers) -> None:
        """From dO (s.do): dQ, dK, dV per sequence and head, through the softmax: dS = P (dP - rowsum(dP P))."""
        n, d = self.seq, self.share.head_size
        for b in range(saved.p.shape[0]):
            rows = slice(b * n, (b + 1) * n)
            for j in range(self.share.heads):
                cols, p = slice(j * d, (j + 1) * d), saved.p[b, j]
                do = s.do[rows, cols]
                np.matmul(do, saved.v[rows, cols].T, out=s.e)  # dP
                np.matmul(p.T, do, out=s.dv[rows, cols])
                np.multiply(s.e, p, out=s.e2)
                np.sum(s.e2, axis=1, out=s.r)
                np.einsum("i,j->ij", s.r, s.ones, out=s.e2)
                np.subtract(s.e, s.e2, out=s.e)
                np.multiply(s.e, p, out=s.e)
                np.multiply(s.e, self.scale, out=s.e)  # dS, through the 1/sqrt(d) of the scores
                np.matmul(s.e, saved.k[rows, cols], out=s.dq[rows, cols])
                np.matmul(s.e.T, saved.q[rows, cols], out=s.dk[rows, cols])
