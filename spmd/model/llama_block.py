"""The Llama decoder block, written once: H = X + Attn(RMSNorm(X; g1)), Y = H + SwiGLU(RMSNorm(H; g2)).

Attention: Q = N Wq, K = N Wk, V = N Wv, RoPE on Q and K at each row's position in its sequence (the engine
gives every rank its rows' global positions: zigzag cp chunks and Ulysses alike are turned before attention
crosses the cp axis), grouped-query: each of the rank's kv heads is repeated for its a/kv query heads before
the core (spmd.model.attention, or a cp core) and their gradients summed back; O Wo. SwiGLU:
W2 (silu(N W1) * (N W3)). Under TP a rank holds its kv heads with their query groups (columns of Wq, Wk, Wv,
rows of Wo) and its ffn channels (columns of W1 and W3, rows of W2): O Wo and the SwiGLU output are partial
sums that leave reduces, as in the MLP; the gains are replicated (their gradients summed over tp under SP).
The FFN half is an object (SwiGLU here, or spmd.model.moe's mixture of experts) from the entered normed rows to
the partial output, and back.
Kept per layer (activations): H, both norms' row statistics, O, the core's and the FFN's (W1's and W3's outputs).
"""

from __future__ import annotations

import numpy as np

from spmd.model import lm_kernels as lm
from spmd.model.attention import AttentionCore
from spmd.model.blocks import BlockDefaults, Buffers, Rows, Share
from spmd.model.params import Flat, Laid, Table
from spmd.model.weight_grads import IMMEDIATE
from spmd.stopwatch import matmul, part


class SwiGLU:
    """The dense FFN half: partial = W2 (silu(xf W1) * (xf W3)) on this rank's ffn channels."""

    dtypes: dict[str, str] = {}
    e = 0  # no experts
    saved_rows = {"z1": "matmul", "u": "matmul"}
    scratch_rows = dict.fromkeys(("sz", "sg", "dm", "du"), "matmul")

    def __init__(self, hidden: int, ffn: int):
        self.h, self.f = hidden, ffn

    def saved_shapes(self, rows: Rows) -> dict[str, tuple]:
        return {"z1": (rows.matmul, self.f), "u": (rows.matmul, self.f)}

    def scratch_shapes(self, rows: Rows) -> dict[str, tuple]:
        return dict.fromkeys(("sz", "sg", "dm", "du"), (rows.matmul, self.f))

    def stash_sizes(self, rows: Rows) -> tuple[int, int]:
        """Elements a deferred weight gradient keeps: M and dY for W2; N2 with dU, dZ1 for W3, W1."""
        return rows.matmul * ((self.f + self.h) + (self.h + 2 * self.f)), 0

    def forward(self, tp, weights, xf, partial, saved: Buffers, s: Buffers) -> None:
        w1, w3, w2 = weights
        matmul(xf, w1, out=saved.z1)
        matmul(xf, w3, out=saved.u)
        lm.silu(saved.z1, s.sz)
        np.multiply(s.sz, saved.u, out=s.sz)
        matmul(s.sz, w2, out=partial)

    def backward(self, tp, wg, weights, grads, xf, dyf, saved: Buffers, s: Buffers) -> None:
        """s.dxf = the input's gradient (partial over tp) from dyf; the weights' into grads."""
        w1, w3, w2 = weights
        dw1, dw3, dw2 = grads
        lm.silu_parts(saved.z1, s.sz, s.sg)
        np.multiply(s.sz, saved.u, out=s.du)  # the SwiGLU product M
        wg.products(s.du, (dyf, dw2))
        matmul(dyf, w2.T, out=s.dm)  # dM
        np.multiply(s.dm, s.sz, out=s.du)  # dU = dM silu(Z1)
        lm.silu_grad_after(saved.z1, s.sg, s.sz)
        np.multiply(s.dm, saved.u, out=s.dm)
        np.multiply(s.dm, s.sz, out=s.dm)  # dZ1 = dM U silu'(Z1)
        wg.products(xf, (s.du, dw3), (s.dm, dw1))
        matmul(s.dm, w1.T, out=s.dxf)
        matmul(s.du, w3.T, out=s.tm)
        np.add(s.dxf, s.tm, out=s.dxf)


class LlamaBlock(Laid, BlockDefaults):
    wg, defers = IMMEDIATE, True  # its weight gradients can wait (zero-bubble pipelines: weight_grads.py)

    def __init__(
        self,
        table: Table,
        hidden: int,
        share: Share,
        sp: bool,
        core: AttentionCore,
        rope_base: float,
        eps: float,
        stat_dtype,
        ffn=None,
    ):
        self.h, self.share, self.sp, self.core, self.eps = hidden, share, sp, core, eps
        self.ffn = ffn or SwiGLU(hidden, share.ffn)
        self.flat = Flat(table)  # its share's pieces: (g1, Wq, Wk, Wv, Wo, g2, [Wr,] W1, W3, W2)
        self.moe_layer = ffn if self.ffn.e else None  # a mixture of experts' (spmd.model.moe.MoEFFN)
        self.stat_dtype = stat_dtype  # the norms' row statistics: fp32 under mixed precision
        # the norms' statistics and RoPE's angles in the state dtype (fp32 under mixed precision: a bf16 angle at
        # position 1000 would be 0.2 off)
        self.dtypes = {
            "r1": "state",
            "r2": "state",
            "c": "state",
            "pos": "index",
            "cos": "state",
            "sin": "state",
            **self.ffn.dtypes,
        }
        self.group = share.heads // max(share.kv_heads, 1) if share.kv_heads else 1
        self.half = share.head_size // 2
        self.theta = rope_base ** (-2 * np.arange(self.half) / share.head_size)
        self.saved_rows = {
            "hid": "local",
            "r1": "local",
            "r2": "local",
            "o": "matmul",
            **self.ffn.saved_rows,
            **core.saved_rows,
        }
        self.scratch_rows = {
            **dict.fromkeys(("xl", "tl", "tl2", "dxl", "c"), "local"),
            **dict.fromkeys(
                ("xf", "part", "dyf", "dxf", "tm", "dq", "dk", "dv", "do", "kc", "vc", "cos", "sin", "t1", "pos"),
                "matmul",
            ),
            **self.ffn.scratch_rows,
            **core.scratch_rows,
        }

    def saved_shapes(self, rows: Rows) -> dict[str, tuple]:
        w = self.share.attention
        return {
            "hid": (rows.local, self.h),
            "r1": (rows.local,),
            "r2": (rows.local,),
            "o": (rows.matmul, w),
            **self.ffn.saved_shapes(rows),
            **self.core.saved_shapes(rows),
        }

    def stash_sizes(self, rows: Rows) -> tuple[int, int]:
        """Elements a deferred weight gradient keeps: the FFN's; O and dY for Wo; N1 with dQ, dK, dV (kv wide)
        for Wq, Wk, Wv; the two gains'."""
        m, h, w, kv = rows.matmul, self.h, self.share.attention, self.share.kv_width
        products, values = self.ffn.stash_sizes(rows)
        return products + m * ((w + h) + (h + w + 2 * kv)), values + 2 * h

    def scratch_shapes(self, rows: Rows) -> dict[str, tuple]:
        """Local rows: xl (a norm's output, then its input gradient), tl tl2 dxl (temporaries), c (a row
        statistic); matmul rows: dxf, tm (h wide), dq dk dv do (attention), kc vc (K, V before the repeat, with
        grouped-query attention), cos sin t1 (RoPE's tables, full width, and a temporary), pos (positions), the
        FFN's; under SP xf, part, dyf."""
        h, w, m, lo = self.h, self.share.attention, rows.matmul, rows.local
        shapes: dict[str, tuple] = {
            "xl": (lo, h),
            "tl": (lo, h),
            "tl2": (lo, h),
            "dxl": (lo, h),
            "c": (lo,),
            "dxf": (m, h),
            "tm": (m, h),
            "dq": (m, w),
            "dk": (m, w),
            "dv": (m, w),
            "do": (m, w),
            "cos": (m, w),
            "sin": (m, w),
            "t1": (m, w),
            "pos": (m,),
            **self.ffn.scratch_shapes(rows),
            **self.core.scratch_shapes(rows),
        }
        if self.group > 1:
            shapes.update(kc=(m, self.share.kv_width), vc=(m, self.share.kv_width))
        if self.sp:
            shapes.update(xf=(m, h), part=(m, h), dyf=(m, h))
        return shapes

    def prepare(self, s: Buffers) -> None:
        self.core.prepare(s)

    def feed(self, s: Buffers) -> None:
        """RoPE's tables of this micro-batch's rows (s.pos: each row's position in its sequence)."""
        lm.rope_tables(s.pos, self.theta, s.cos, s.sin)

    def _repeat(self, compact, full) -> None:
        """full (rows, kv heads x group x d) = each kv head of compact repeated for its query group."""
        rows, d = compact.shape[0], self.share.head_size
        np.copyto(full.reshape(rows, -1, self.group, d), compact.reshape(rows, -1, 1, d))

    def _collapse(self, full, compact) -> None:
        """compact = full's query-group gradients summed per kv head."""
        rows, d = compact.shape[0], self.share.head_size
        np.sum(full.reshape(rows, -1, self.group, d), axis=2, out=compact.reshape(rows, -1, d))

    def forward(self, tp, w, x, y, saved: Buffers, s: Buffers) -> None:
        g1, wq, wk, wv, wo, g2, *ffn = self.views(w)
        lm.rms_norm(x, g1, self.eps, saved.r1, s.xl, s.tl)
        zf = tp.enter(s.xl, s.xf)
        q, k, v = self.core.projections(saved, s)
        kc, vc = (s.kc, s.vc) if self.group > 1 else (k, v)
        for proj, out in ((wq, q), (wk, kc), (wv, vc)):
            matmul(zf, proj, out=out)
        for u in (q, kc):
            lm.rope(u, self.half, s.cos, s.sin, s.t1)
        if self.group > 1:
            self._repeat(kc, k)
            self._repeat(vc, v)
        with part("attention"):
            self.core.forward(saved, s)
        partial = tp.partial_target(saved.hid, s.part)
        matmul(saved.o, wo, out=partial)
        tp.leave(partial, saved.hid)
        np.add(saved.hid, x, out=saved.hid)
        lm.rms_norm(saved.hid, g2, self.eps, saved.r2, s.xl, s.tl)
        xf = tp.enter(s.xl, s.xf)
        partial = tp.partial_target(y, s.part)
        self.ffn.forward(tp, ffn, xf, partial, saved, s)
        tp.leave(partial, y)
        np.add(y, saved.hid, out=y)

    def backward(self, tp, w, grad, x, dy, saved: Buffers, s: Buffers) -> None:
        """dy (the output's gradient) becomes the input's, in place; the block's gradient goes into `grad`."""
        g1, wq, wk, wv, wo, g2, *ffn = self.views(w)
        dg1, dwq, dwk, dwv, dwo, dg2, *dffn = self.views(grad)
        # the FFN: dy is also the gradient of H (the residual)
        dyf = tp.leave_grad(dy, s.dyf)
        lm.normed(saved.hid, g2, saved.r2, s.xl, s.tl)
        xf = tp.enter(s.xl, s.xf)  # N2 again: recomputed, not kept (gathered again under SP)
        self.ffn.backward(tp, self.wg, ffn, dffn, xf, dyf, saved, s)
        self._norm_backward(tp, saved.hid, g2, saved.r2, dg2, dy, s)
        # attention: dy is now the gradient of the block's input through the residual, and of O Wo's output
        dyf = tp.leave_grad(dy, s.dyf)
        self.wg.products(saved.o, (dyf, dwo))
        matmul(dyf, wo.T, out=s.do)
        with part("attention"):
            self.core.backward(saved, s)
        dkc, dvc = (s.kc, s.vc) if self.group > 1 else (s.dk, s.dv)
        if self.group > 1:
            self._collapse(s.dk, dkc)
            self._collapse(s.dv, dvc)
        for d in (s.dq, dkc):  # the gradients of the turned Q and K, turned back
            lm.rope(d, self.half, s.cos, s.sin, s.t1, inverse=True)
        lm.normed(x, g1, saved.r1, s.xl, s.tl)
        zf = tp.enter(s.xl, s.xf)  # N1 again
        self.wg.products(zf, (s.dq, dwq), (dkc, dwk), (dvc, dwv))
        matmul(s.dq, wq.T, out=s.dxf)
        for d, proj in ((dkc, wk), (dvc, wv)):
            matmul(d, proj.T, out=s.tm)
            np.add(s.dxf, s.tm, out=s.dxf)
        self._norm_backward(tp, x, g1, saved.r1, dg1, dy, s)

    def _norm_backward(self, tp, x, g, r, dg, dy, s: Buffers) -> None:
        """From s.dxf (the norm output's gradient, partial over tp on the matmul rows): dy += the norm input's
        gradient; dg the gain's (summed over tp under SP)."""
        dn = tp.enter_grad(s.dxf, s.xl)
        dg = self.wg.value(dg)
        lm.rms_norm_backward(x, g, r, dn, s.dxl, dg, s.c, s.tl, s.tl2)
        tp.replicated_grad(dg)
        np.add(dy, s.dxl, out=dy)
