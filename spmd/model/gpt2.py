"""The GPT-2-style language model: learned positions, LayerNorm with a bias, a GELU MLP, tied embeddings.

Units: 0 the embedding [E (V, h), P (seq, h)] (tokens, then positions); 1..L the blocks; L+1 the final
LayerNorm [g (h), b (h)]; L+2 the head W (V, h), logits = x W^T. A tied head has the embedding's layout (its P
rows unused, their gradient 0), so the engine's tie sums two vectors of one layout. A block is
    [g1, c1, Wq, bq, Wk, bk, Wv, bv, Wo, bo, g2, c2, W1, b1, W2, b2]
H = X + Attn(LN(X; g1, c1)) Wo + bo, Y = H + gelu(LN(H; g2, c2) W1 + b1) W2 + b2, GELU's tanh approximation
(GPT-2's). Under TP (Megatron's splits) rank j holds its heads' columns of Wq, Wk, Wv with those of bq, bk, bv,
its rows of Wo, its ffn columns of W1 and b1 and rows of W2, and vocabulary rows of E and W; the gains and the
biases of the norms and of the row-split Wo and W2 whole, added once after the sum over tp; P whole, added by
tp rank 0 before the embedding's sum. Initialization (GPT-2's): gains 1, biases 0, matrices and tables
N(0, 0.02), Wo and W2 N(0, 0.02 / sqrt(2 L)).
"""

from __future__ import annotations

import numpy as np

from spmd.model import lm_kernels as lm
from spmd.model.attention import AttentionCore
from spmd.model.blocks import BlockDefaults, Buffers, Rows, Share
from spmd.model.llama import MOE_FIELDS, STD, initialize_block, unit_kinds
from spmd.model.params import Flat, Laid, Piece, Table
from spmd.model.vocab import Embedding, FinalNorm, Head
from spmd.model.weight_grads import IMMEDIATE
from spmd.stopwatch import matmul, part


def table(net, kind: str) -> Table:
    """A unit's parameter table, whole: each piece's name, shape and splits in the unit's flat order (a tied head
    has the embedding's, its position rows unused)."""
    h, f, positions = net.hidden, net.ffn, (Piece("positions", (net.seq, net.hidden)),)
    if kind == "embed":
        return (Piece("embedding", (net.vocab, h), ("vocab", None)), *positions)
    if kind == "head":
        return (Piece("lm_head", (net.vocab, h), ("vocab", None)), *(positions if net.tie_embeddings else ()))
    if kind == "norm":
        return (Piece("final_norm", (h,)), Piece("final_norm_bias", (h,)))
    columns = [
        (Piece(w, (h, h), (None, "heads")), Piece(b, (h,), ("heads",)))
        for w, b in (("wq", "bq"), ("wk", "bk"), ("wv", "bv"))
    ]
    return (
        Piece("g1", (h,)),
        Piece("c1", (h,)),
        *(piece for pair in columns for piece in pair),
        Piece("wo", (h, h), ("heads", None)),
        Piece("bo", (h,)),
        Piece("g2", (h,)),
        Piece("c2", (h,)),
        Piece("w1", (h, f), (None, "ffn")),
        Piece("b1", (f,), ("ffn",)),
        Piece("w2", (f, h), ("ffn", None)),
        Piece("b2", (h,)),
    )


# the parameter table's rows (python -m spmd.plan), in order: each piece's label by its name
LABELS = {
    "embedding": "embedding (V x h)",
    "positions": "positions (seq x h)",
    **dict.fromkeys(("wq", "wk", "wv"), "attention Wq, Wk, Wv (h x h)"),
    **dict.fromkeys(("bq", "bk", "bv"), "attention biases (3 h)"),
    "wo": "attention Wo (h x h)",
    "bo": "attention Wo's bias (h)",
    "w1": "MLP W1 (h x f)",
    "b1": "MLP W1's bias (f)",
    "w2": "MLP W2 (f x h)",
    "b2": "MLP W2's bias (h)",
    **dict.fromkeys(("g1", "c1", "g2", "c2"), "norms (2 LayerNorm of 2 h)"),
    **dict.fromkeys(("final_norm", "final_norm_bias"), "final norm (LayerNorm of 2 h)"),
    "lm_head": "LM head (h x V)",
}


def labels(net) -> list[str]:
    """The parameter table's rows in order."""
    return list(dict.fromkeys(label(net, name) for name in LABELS))


def label(net, name: str) -> str:
    """A piece's row in the parameter table."""
    return "LM head (tied: the embedding)" if name == "lm_head" and net.tie_embeddings else LABELS[name]


def initial_unit(net, unit: int) -> np.ndarray:
    """Unit `unit`'s flat parameters at step 0, the same on every rank; a tied head starts as the embedding."""
    kind = unit_kinds(net)[unit]
    if kind == "head" and net.tie_embeddings:
        return initial_unit(net, 0)
    rng = np.random.default_rng((net.seed, 7, unit))
    layout = Flat(table(net, kind))
    flat = np.zeros(layout.size, dtype=net.dtype)
    if kind == "norm":
        flat[: net.hidden] = 1
    elif kind in ("embed", "head"):
        flat[...] = STD * rng.standard_normal(flat.size)
    else:
        initialize_block(layout.named(flat), rng, net.layers)
    return flat


def check_gpt2(net) -> None:
    """Every reason GPT-2's sizes cannot work, naming the flag."""
    if net.vocab < 2:
        raise ValueError(f"--vocab must be >= 2 tokens, got {net.vocab}")
    if net.hidden % net.heads:
        raise ValueError(f"--hidden {net.hidden} must be a multiple of --heads {net.heads} (head size h/a)")
    if net.integers:
        raise ValueError("--integers is for the MLP: softmax's exp makes no integer exact")
    if not net.norm_eps > 0:
        raise ValueError(f"--norm-eps must be > 0, got {net.norm_eps}")
    llama_only = {"kv_heads": 0, "rope_base": 10000.0, "experts": 0, **MOE_FIELDS}
    given = [name for name, default in llama_only.items() if getattr(net, name) != default]
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise ValueError(f"{flags}: the Llama's (--model llama); GPT-2 has all heads, learned positions, one MLP")


# ---------------------------------------------------------------- LayerNorm


def layer_norm(x, g, b, eps: float, mu, r, out, tmp) -> None:
    """out = g (x - mu) r + b per row, mu the row's mean and r = 1/sqrt(its variance + eps) kept."""
    np.mean(x, axis=1, out=mu)
    np.subtract(x, mu.astype(x.dtype, copy=False)[:, None], out=tmp)
    np.multiply(tmp, tmp, out=out)
    np.mean(out, axis=1, out=r)
    np.add(r, eps, out=r)
    np.sqrt(r, out=r)
    np.reciprocal(r, out=r)
    normed(x, g, b, mu, r, out, tmp)


def normed(x, g, b, mu, r, out, tmp) -> None:
    """The forward again from its kept row statistics (for a backward that needs the output)."""
    np.subtract(x, mu.astype(x.dtype, copy=False)[:, None], out=tmp)
    np.multiply(tmp, r.astype(x.dtype, copy=False)[:, None], out=tmp)
    np.multiply(tmp, g, out=out)
    np.add(out, b, out=out)


def layer_norm_backward(x, g, mu, r, dy, dx, dg, db, c, tmp, tmp2) -> None:
    """dx = r (dn - mean(dn) - xhat mean(dn xhat)), dn = dy g; dg = sum of dy xhat, db = sum of dy (over rows)."""
    rr = r.astype(x.dtype, copy=False)[:, None]
    np.subtract(x, mu.astype(x.dtype, copy=False)[:, None], out=tmp)
    np.multiply(tmp, rr, out=tmp)  # xhat
    np.sum(dy, axis=0, out=db)
    np.multiply(dy, tmp, out=tmp2)
    np.sum(tmp2, axis=0, out=dg)
    np.multiply(dy, g, out=tmp2)  # dn
    np.multiply(tmp2, tmp, out=dx)
    np.mean(dx, axis=1, out=c)
    np.multiply(tmp, c.astype(x.dtype, copy=False)[:, None], out=dx)
    np.subtract(tmp2, dx, out=tmp2)
    np.mean(tmp2, axis=1, out=c)
    np.subtract(tmp2, c.astype(x.dtype, copy=False)[:, None], out=tmp2)
    np.multiply(tmp2, rr, out=dx)


# ---------------------------------------------------------------- the units


class PositionalEmbedding(Embedding):
    """The vocab-parallel token lookup plus P[position], added by tp rank 0 (`lead`) into the partial sum."""

    dtypes = {**Embedding.dtypes, "pos": "index"}
    scratch_rows = {**Embedding.scratch_rows, "pos": "matmul"}

    def __init__(self, table: Table, hidden: int, vocab: tuple[int, int], sp: bool, lead: bool):
        super().__init__(table, hidden, vocab, sp)
        self.lead = lead

    def scratch_shapes(self, rows: Rows) -> dict[str, tuple]:
        return {**super().scratch_shapes(rows), "pos": (rows.matmul,)}

    def forward(self, tp, w, x, y, saved: Buffers, s: Buffers) -> None:
        table, positions = self.views(w)
        partial = tp.partial_target(y, s.part)
        np.take(table, s.local, axis=0, out=partial, mode="clip")
        partial *= s.hit[:, None].astype(partial.dtype, copy=False)
        if self.lead:
            partial += positions[s.pos]
        tp.leave(partial, y)

    def backward(self, tp, w, grad, x, dy, saved: Buffers, s: Buffers) -> None:
        """The rows' gradient (every row's, on every tp rank) into the owned tokens' rows and into P: P's is
        the same on each tp rank, no collective."""
        dyf = tp.leave_grad(dy, s.dyf)
        grad[...] = 0
        table, positions = self.views(grad)
        owned = s.hit.astype(bool)
        np.add.at(table, s.local[owned], dyf[owned])
        np.add.at(positions, s.pos, dyf)


class TiedHead(Head):
    """The head on the embedding's layout (its table's first piece the head's); the P rows get a zero gradient."""

    defers = False  # the P rows' zeros are written in the backward itself

    def backward(self, tp, w, grad, x, dy, saved: Buffers, s: Buffers) -> None:
        self.views(grad)[1][...] = 0
        super().backward(tp, w, grad, x, dy, saved, s)


class FinalLayerNorm(FinalNorm):
    """The final RMSNorm's unit with LayerNorm's mean and bias: [g (h), b (h)], both replicated over tp."""

    saved_rows = {"mu": "local", "r": "local"}
    dtypes = {"mu": "state", "r": "state", "c": "state"}

    def saved_shapes(self, rows: Rows) -> dict[str, tuple]:
        return {"mu": (rows.local,), "r": (rows.local,)}

    def forward(self, tp, w, x, y, saved: Buffers, s: Buffers) -> None:
        g, b = self.views(w)
        layer_norm(x, g, b, self.eps, saved.mu, saved.r, y, s.tl)

    def backward(self, tp, w, grad, x, dy, saved: Buffers, s: Buffers) -> None:
        (g, _), (dg, db) = self.views(w), self.views(grad)
        layer_norm_backward(x, g, saved.mu, saved.r, dy, s.dxl, dg, db, s.c, s.tl, s.tl2)
        tp.replicated_grad(dg)
        tp.replicated_grad(db)
        np.copyto(dy, s.dxl)


class GPT2Block(Laid, BlockDefaults):
    """Written once for every layout: the attention core is given (whole sequences, ring or Ulysses over cp).
    Kept per layer: H, both norms' row statistics, O, the MLP's pre-activation A, the core's."""

    wg, defers = IMMEDIATE, True  # its weight gradients can wait (zero-bubble pipelines: weight_grads.py)
    saved_rows = {"hid": "local", "mu1": "local", "r1": "local", "mu2": "local", "r2": "local", "o": "matmul"}
    local_scratch = ("xl", "tl", "tl2", "dxl", "c")
    matmul_scratch = ("xf", "part", "dyf", "dxf", "tm", "dq", "dk", "dv", "do", "ga", "da", "gt")

    def __init__(self, table: Table, hidden: int, share: Share, sp: bool, core: AttentionCore, eps: float):
        self.flat, self.h, self.share, self.sp, self.core, self.eps = Flat(table), hidden, share, sp, core, eps
        self.dtypes = dict.fromkeys(("mu1", "r1", "mu2", "r2", "c"), "state")
        self.saved_rows = {**GPT2Block.saved_rows, "a": "matmul", **core.saved_rows}
        self.scratch_rows = {
            **dict.fromkeys(self.local_scratch, "local"),
            **dict.fromkeys(self.matmul_scratch, "matmul"),
            **core.scratch_rows,
        }

    def saved_shapes(self, rows: Rows) -> dict[str, tuple]:
        lo = (rows.local,)
        stats = dict.fromkeys(("mu1", "r1", "mu2", "r2"), lo)
        return {
            "hid": (rows.local, self.h),
            **stats,
            "o": (rows.matmul, self.share.attention),
            "a": (rows.matmul, self.share.ffn),
            **self.core.saved_shapes(rows),
        }

    def stash_sizes(self, rows: Rows) -> tuple[int, int]:
        """Elements a deferred weight gradient keeps: GELU(A) and dY for W2, LN2 with dA for W1, O and dY for Wo,
        LN1 with dQ, dK, dV; the biases' and the norms' vectors."""
        m, h, w, f = rows.matmul, self.h, self.share.attention, self.share.ffn
        return m * ((f + h) + (h + f) + (w + h) + (h + 3 * w)), 6 * h + 3 * w + f

    def scratch_shapes(self, rows: Rows) -> dict[str, tuple]:
        """Local rows: xl (a norm's output, then its input gradient), tl tl2 dxl (temporaries), c (a row
        statistic); matmul rows: dxf tm (h wide), dq dk dv do (attention), ga da gt
        (the MLP's GELU, its gradient, a temporary), the core's; under SP xf, part, dyf (gathered rows)."""
        h, w, f, m, lo = self.h, self.share.attention, self.share.ffn, rows.matmul, rows.local
        shapes: dict[str, tuple] = {
            **dict.fromkeys(("xl", "tl", "tl2", "dxl"), (lo, h)),
            "c": (lo,),
            "dxf": (m, h),
            "tm": (m, h),
            **dict.fromkeys(("dq", "dk", "dv", "do"), (m, w)),
            **dict.fromkeys(("ga", "da", "gt"), (m, f)),
            **self.core.scratch_shapes(rows),
        }
        if self.sp:
            shapes.update(xf=(m, h), part=(m, h), dyf=(m, h))
        return shapes

    def prepare(self, s: Buffers) -> None:
        self.core.prepare(s)

    def feed(self, s: Buffers) -> None:
        """Nothing here depends on where the rows sit: the positions were added by the embedding."""

    def _leave(self, tp, partial, out, bias, residual) -> None:
        """out = the sum over tp of partial, + bias once (after the sum), + residual."""
        tp.leave(partial, out)
        np.add(out, bias, out=out)
        np.add(out, residual, out=out)

    def forward(self, tp, w, x, y, saved: Buffers, s: Buffers) -> None:
        g1, c1, wq, bq, wk, bk, wv, bv, wo, bo, g2, c2, w1, b1, w2, b2 = self.views(w)
        layer_norm(x, g1, c1, self.eps, saved.mu1, saved.r1, s.xl, s.tl)
        zf = tp.enter(s.xl, s.xf)
        for proj, bias, out in zip((wq, wk, wv), (bq, bk, bv), self.core.projections(saved, s), strict=True):
            matmul(zf, proj, out=out)
            np.add(out, bias, out=out)
        with part("attention"):
            self.core.forward(saved, s)
        partial = tp.partial_target(saved.hid, s.part)
        matmul(saved.o, wo, out=partial)
        self._leave(tp, partial, saved.hid, bo, x)
        layer_norm(saved.hid, g2, c2, self.eps, saved.mu2, saved.r2, s.xl, s.tl)
        xf = tp.enter(s.xl, s.xf)
        matmul(xf, w1, out=saved.a)
        np.add(saved.a, b1, out=saved.a)
        lm.gelu(saved.a, s.ga)
        partial = tp.partial_target(y, s.part)
        matmul(s.ga, w2, out=partial)
        self._leave(tp, partial, y, b2, saved.hid)

    def backward(self, tp, w, grad, x, dy, saved: Buffers, s: Buffers) -> None:
        """dy (the output's gradient) becomes the input's, in place; the block's gradient goes into `grad`."""
        g1, c1, wq, bq, wk, bk, wv, bv, wo, bo, g2, c2, w1, b1, w2, b2 = self.views(w)
        dg1, dc1, dwq, dbq, dwk, dbk, dwv, dbv, dwo, dbo, dg2, dc2, dw1, db1, dw2, db2 = self.views(grad)
        self._bias_grad(tp, dy, db2)
        dyf = tp.leave_grad(dy, s.dyf)
        lm.gelu(saved.a, s.ga)
        self.wg.products(s.ga, (dyf, dw2))
        matmul(dyf, w2.T, out=s.da)
        lm.gelu_grad(saved.a, s.ga, s.gt)
        np.multiply(s.da, s.ga, out=s.da)  # dA
        np.sum(s.da, axis=0, out=self.wg.value(db1))  # a column-split bias: every row of its channels is here
        normed(saved.hid, g2, c2, saved.mu2, saved.r2, s.xl, s.tl)
        xf = tp.enter(s.xl, s.xf)  # LN2 again: recomputed, not kept
        self.wg.products(xf, (s.da, dw1))
        matmul(s.da, w1.T, out=s.dxf)
        self._norm_backward(tp, saved.hid, g2, saved.mu2, saved.r2, dg2, dc2, dy, s)
        # attention: dy is now the gradient of the block's input through the residual, and of O Wo + bo
        self._bias_grad(tp, dy, dbo)
        dyf = tp.leave_grad(dy, s.dyf)
        self.wg.products(saved.o, (dyf, dwo))
        matmul(dyf, wo.T, out=s.do)
        with part("attention"):
            self.core.backward(saved, s)
        for d, db in ((s.dq, dbq), (s.dk, dbk), (s.dv, dbv)):
            np.sum(d, axis=0, out=self.wg.value(db))
        normed(x, g1, c1, saved.mu1, saved.r1, s.xl, s.tl)
        zf = tp.enter(s.xl, s.xf)  # LN1 again
        self.wg.products(zf, (s.dq, dwq), (s.dk, dwk), (s.dv, dwv))
        matmul(s.dq, wq.T, out=s.dxf)
        for d, proj in ((s.dk, wk), (s.dv, wv)):
            matmul(d, proj.T, out=s.tm)
            np.add(s.dxf, s.tm, out=s.dxf)
        self._norm_backward(tp, x, g1, saved.mu1, saved.r1, dg1, dc1, dy, s)

    def _bias_grad(self, tp, dy, db) -> None:
        """A bias added after the sum over tp (replicated): its gradient is the sum of this rank's rows of dy,
        summed over tp under SP."""
        db = self.wg.value(db)
        np.sum(dy, axis=0, out=db)
        tp.replicated_grad(db)

    def _norm_backward(self, tp, x, g, mu, r, dg, dc, dy, s: Buffers) -> None:
        """From s.dxf (the norm output's gradient, partial over tp on the matmul rows): dy += the norm input's
        gradient; dg, dc the gain's and bias's (summed over tp under SP)."""
        dn = tp.enter_grad(s.dxf, s.xl)
        dg, dc = self.wg.value(dg), self.wg.value(dc)
        layer_norm_backward(x, g, mu, r, dn, s.dxl, dg, dc, s.c, s.tl, s.tl2)
        tp.replicated_grad(dg)
        tp.replicated_grad(dc)
        np.add(dy, s.dxl, out=dy)
