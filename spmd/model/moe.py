"""A mixture of experts in the Llama block's place of its SwiGLU FFN (Grok-1's layer; Mixtral's, DeepSeek's).

Router: scores = softmax(N Wr) (or --router sigmoid), in the state dtype (fp32 under mixed precision); each row
chooses the top_k experts by score, a tie going to the lower expert index (a stable sort, so every rank and the
reference choose alike); its gates are those scores, not renormalized (Grok-1's; --renormalize divides them by
their sum). Experts: SwiGLU FFNs, W2_e (silu(x W1_e) * (x W3_e)); a row's output is the gate-weighted sum of its
chosen experts' outputs.
Dispatch: the rows' (row, choice) pairs sorted by expert (stable: row order inside an expert), so each expert's rows
are one contiguous block of a rows x top_k buffer: the memory is fixed, wherever the tokens go.
Capacity (--capacity-factor CF > 0): in each sequence an expert takes at most C = ceil(seq k / E CF) pairs, those of
the earliest rows; a dropped pair adds nothing (its gate is zeroed; the residual carries the row). A sequence is the
group, so which pairs drop does not depend on the mesh or the micro-batches.
Balancing (--aux-loss alpha, Switch/GShard's): per sequence alpha E sum_i f_i P_i, f_i the fraction of the
sequence's pairs routed to expert i (before capacity), P_i its mean score over the sequence's rows; the model's loss
adds its mean over the step's sequences (alpha at perfectly uniform routing). Only its gradient reaches the
parameters; the printed loss stays the cross-entropy.
Under TP a rank holds the same ffn channels of every expert, and the router whole: it sees the same rows on every
tp rank (gathered under SP), so every rank routes alike. A gate's gradient (the row's output gradient dotted with
the expert's output, partial over the channels) is all-reduced over tp, k numbers a row; the router's gradient is
then whole on every rank, and its part of the input gradient is added on tp rank 0 only (the input gradient is a
partial sum over tp).
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

from spmd.collectives import all_reduce
from spmd.model import lm_kernels as lm
from spmd.model.blocks import Buffers, Rows


def capacity(seq: int, top_k: int, experts: int, factor: float) -> int:
    """The pairs an expert takes from one sequence: ceil(seq k CF / E), in exact arithmetic on CF as written
    (2.2 is 11/5: seq 25, k 2, E 2 take 55, not the 56 of floating point); 0 when dropless (no limit)."""
    return math.ceil(seq * top_k * Fraction(repr(factor)) / experts) if factor > 0 else 0


def choose(scores: np.ndarray, top_k: int) -> np.ndarray:
    """Each row's top_k experts by score, the highest first, a tie going to the lower expert index."""
    return np.argsort(-scores, axis=1, kind="stable")[:, :top_k]


def kept(experts_sorted: np.ndarray, sequence_sorted: np.ndarray, limit: int) -> np.ndarray:
    """Of pairs sorted by (expert, row), whether each is within its expert's first `limit` of its sequence."""
    if not limit:
        return np.ones(experts_sorted.size, dtype=bool)
    key = experts_sorted * (int(sequence_sorted.max(initial=0)) + 1) + sequence_sorted
    first = np.r_[0, np.flatnonzero(np.diff(key)) + 1]  # where each (expert, sequence) run starts
    starts = np.repeat(first, np.diff(np.r_[first, key.size]))
    return np.arange(key.size) - starts < limit


class MoEFFN:
    """The experts' half of a Llama block: from the entered normed rows xf to the partial output (see above)."""

    dtypes = {"probs": "state", "gate": "state", "keep": "state", "frac": "state", "order": "index",
              "inv": "index", "bounds": "index", "dwt": "state", "ds": "state", "dl": "state"}
    saved_rows = {"probs": "matmul", "gate": "matmul", "keep": "matmul", "order": "matmul", "inv": "matmul",
                  "z1": "matmul", "u": "matmul", "frac": "sequences"}
    scratch_rows = {name: "matmul" for name in ("xs", "dys", "sz", "mm", "dm", "du", "sg", "dwt", "ds", "dl")}

    def __init__(self, net, hidden: int, ffn: int, lead: bool):
        self.h, self.f, self.e, self.k = hidden, ffn, net.experts, net.top_k
        self.seq, self.batch, self.router, self.renormalize = net.seq, net.batch, net.router, net.renormalize
        self.alpha, self.limit = net.aux_loss, capacity(net.seq, net.top_k, net.experts, net.capacity_factor)
        self.lead = lead  # tensor rank 0: adds the router's part of the input gradient, and counts the routing
        self.routed = np.zeros(self.e + 1, dtype=np.int64)  # pairs to each expert, then pairs dropped, since taken
        # --bias-balance: a bias per layer and expert added to the scores to choose (not to the gates), and the
        # pairs each layer's experts took this step (counted on every tp rank: they route the same rows)
        self.gamma, self.unit = net.bias_balance, 0  # the unit (layer) being run: the engine sets it
        self.bias: dict[int, np.ndarray] = {}
        self.loads: dict[int, np.ndarray] = {}

    def balance(self, groups) -> None:
        """After a step: each layer's loads summed over `groups` (the ranks holding other rows of the batch), then
        bias_i += gamma sign(mean load - load_i) (DeepSeek-V3), the same on every rank."""
        if not self.loads:
            return
        layers = sorted(self.loads)
        loads = np.stack([self.loads[u] for u in layers]).astype(np.float64)  # exact: counts below 2^53
        for group in groups:
            all_reduce(group, loads, out=loads)
        for u, load in zip(layers, loads, strict=True):
            self.bias[u] += self.gamma * np.sign(load.mean() - load)
        self.loads = {}

    def take_routing(self) -> np.ndarray:
        """The routing counted since the last call (pairs to each expert over this rank's layers and micro-batches,
        then the pairs capacity dropped; zeros off tp rank 0, whose tp peers route the same rows), and restart."""
        counts, self.routed = self.routed, np.zeros_like(self.routed)
        return counts

    def saved_shapes(self, rows: Rows) -> dict[str, tuple]:
        m, k, e, f = rows.matmul, self.k, self.e, self.f
        return {"probs": (m, e), "gate": (m, k), "keep": (m, k), "order": (m, k), "inv": (m, k),
                "bounds": (e + 1,), "z1": (m, k, f), "u": (m, k, f),
                "frac": (rows.sequences if self.alpha else 0, e)}  # the balancing loss's f, per sequence

    def scratch_shapes(self, rows: Rows) -> dict[str, tuple]:
        """xs dys (the pairs' rows and output gradients, h wide), sz mm dm du sg (ffn wide), dwt (the gates'
        gradients), ds dl (the scores' and logits' gradients)."""
        m, k, e, f, h = rows.matmul, self.k, self.e, self.f, self.h
        return {"xs": (m, k, h), "dys": (m, k, h), **dict.fromkeys(("sz", "mm", "dm", "du", "sg"), (m, k, f)),
                "dwt": (m, k), "ds": (m, e), "dl": (m, e)}

    def stash_sizes(self, rows: Rows) -> int:
        """Elements a deferred weight gradient keeps: M and dY per expert for W2, X with dU and dZ for W3 and
        W1 (the pairs' rows), N and the logits' gradient for the router."""
        m, k, h, f, e = rows.matmul, self.k, self.h, self.f, self.e
        return m * k * ((f + h) + (h + 2 * f)) + m * (h + e)

    def _segments(self, bounds):
        return [slice(int(bounds[i]), int(bounds[i + 1])) for i in range(self.e)]

    def _weights(self, saved: Buffers) -> np.ndarray:
        """Each pair's weight in the combine: its gate (renormalized over the row's choices if asked), 0 if
        dropped."""
        gate = saved.gate / saved.gate.sum(axis=1, keepdims=True) if self.renormalize else saved.gate
        return gate * saved.keep

    def forward(self, weights, xf, partial, saved: Buffers, s: Buffers) -> None:
        wr, w1, w3, w2 = weights
        m, k = xf.shape[0], self.k
        self._route(wr, xf, saved, s)
        order = saved.order.reshape(-1)
        xs, z1, u, mm = (a.reshape(m * k, -1) for a in (s.xs, saved.z1, saved.u, s.mm))
        np.take(xf, order // k, axis=0, out=xs)
        segments = self._segments(saved.bounds)
        for e, rows in enumerate(segments):
            np.matmul(xs[rows], w1[e], out=z1[rows])
            np.matmul(xs[rows], w3[e], out=u[rows])
        lm.silu(z1, mm)
        np.multiply(mm, u, out=mm)
        np.multiply(mm, self._weights(saved).reshape(-1)[order][:, None], out=mm)
        for e, rows in enumerate(segments):  # the experts' outputs, weighted, into xs (no longer needed)
            np.matmul(mm[rows], w2[e], out=xs[rows])
        self._combine(xs, saved.inv, partial, s.tm)

    def _route(self, wr, xf, saved: Buffers, s: Buffers) -> None:
        """Scores, choices, gates, the pairs' order by expert, capacity, and the balancing fractions."""
        m, k, e = xf.shape[0], self.k, self.e
        state = s.dl.dtype  # the logits in fp32 under mixed precision: a bf16 logit can flip a top-k
        np.matmul(xf.astype(state, copy=False), wr.astype(state, copy=False), out=s.dl)
        probs = saved.probs
        np.copyto(probs, s.dl)
        if self.router == "softmax":
            probs -= probs.max(axis=1, keepdims=True)
            np.exp(probs, out=probs)
            probs /= probs.sum(axis=1, keepdims=True)
        else:  # sigmoid, with tanh so that no exp overflows
            np.multiply(probs, 0.5, out=probs)
            np.tanh(probs, out=probs)
            probs += 1
            probs *= 0.5
        if self.gamma:
            bias = self.bias.setdefault(self.unit, np.zeros(e))
            choice = choose(probs + bias, k)  # the bias chooses; the gates stay the scores
        else:
            choice = choose(probs, k)
        saved.gate[...] = np.take_along_axis(probs, choice, axis=1)
        flat = choice.reshape(-1)
        order = saved.order.reshape(-1)
        order[...] = np.argsort(flat, kind="stable")
        saved.inv.reshape(-1)[order] = np.arange(m * k)
        counts = np.bincount(flat, minlength=e)
        saved.bounds[0] = 0
        np.cumsum(counts, out=saved.bounds[1:])
        sequence = order // k // self.seq
        saved.keep.reshape(-1)[order] = kept(flat[order], sequence, self.limit)
        if not self.alpha:
            return
        per_sequence = np.zeros((m // self.seq, e))
        np.add.at(per_sequence, (np.arange(m * k) // k // self.seq, flat), 1)
        np.multiply(per_sequence, 1 / (self.seq * k), out=saved.frac)

    def _combine(self, pairs, inv, out, tmp) -> None:
        """out = for each row the sum of its k pairs' rows (in choice order)."""
        np.take(pairs, inv[:, 0], axis=0, out=out)
        for j in range(1, self.k):
            np.take(pairs, inv[:, j], axis=0, out=tmp)
            np.add(out, tmp, out=out)

    def backward(self, tp, wg, weights, grads, xf, dyf, saved: Buffers, s: Buffers) -> None:
        """From dyf (the output's gradient on the matmul rows): s.dxf the input's (partial over tp), the experts'
        and the router's gradients into grads."""
        wr, w1, w3, w2 = weights
        dwr, dw1, dw3, dw2 = grads
        m, k = xf.shape[0], self.k
        if self.lead:  # counted in backward: it runs once a micro-batch, forward again under recomputation
            self.routed[:-1] += np.diff(saved.bounds)
            self.routed[-1] += m * k - int(np.count_nonzero(saved.keep))
        if self.gamma:
            self.loads[self.unit] = self.loads.get(self.unit, 0) + np.diff(saved.bounds)
        order = saved.order.reshape(-1)
        tokens = order // k
        xs, dys, z1, u, sz, mm, dm, du, sg = (a.reshape(m * k, -1) for a in (s.xs, s.dys, saved.z1, saved.u, s.sz,
                                                                             s.mm, s.dm, s.du, s.sg))
        segments = self._segments(saved.bounds)
        np.take(dyf, tokens, axis=0, out=dys)
        for e, rows in enumerate(segments):
            np.matmul(dys[rows], w2[e].T, out=dm[rows])  # d of each pair's weighted product, before its weight
        lm.silu(z1, sz)
        np.multiply(sz, u, out=mm)  # the SwiGLU products M
        dweight = s.dwt.reshape(-1)
        # each pair's weight's gradient, in row order, partial over the channels (summed over tp); du as scratch
        dweight[...] = np.sum(np.multiply(dm, mm, out=du), axis=1, dtype=dweight.dtype)[saved.inv.reshape(-1)]
        tp.sum_partial(s.dwt)
        weight = self._weights(saved).reshape(-1)[order][:, None]
        np.multiply(mm, weight, out=mm)
        for e, rows in enumerate(segments):
            wg.products(mm[rows], (dys[rows], dw2[e]))
        np.multiply(dm, weight, out=dm)
        np.multiply(dm, sz, out=du)  # dU = dM silu(Z1)
        lm.silu_grad(z1, sz, sg)
        np.multiply(dm, u, out=dm)
        np.multiply(dm, sz, out=dm)  # dZ1 = dM U silu'(Z1)
        np.take(xf, tokens, axis=0, out=xs)
        for e, rows in enumerate(segments):
            wg.products(xs[rows], (du[rows], dw3[e]), (dm[rows], dw1[e]))
        for e, rows in enumerate(segments):  # each pair's input gradient, into dys then xs
            np.matmul(dm[rows], w1[e].T, out=dys[rows])
            np.matmul(du[rows], w3[e].T, out=xs[rows])
        np.add(dys, xs, out=dys)
        self._combine(dys, saved.inv, s.dxf, s.tm)
        self._router_backward(tp, wg, wr, dwr, xf, saved, s)

    def _router_backward(self, tp, wg, wr, dwr, xf, saved: Buffers, s: Buffers) -> None:
        """The gates' gradients (in s.dwt) through the scores to the logits, the balancing loss's added; the
        router's gradient; its part of the input gradient on tensor rank 0."""
        dgate = s.dwt * saved.keep
        if self.renormalize:
            total = saved.gate.sum(axis=1, keepdims=True)
            dgate = (dgate - np.sum(dgate * saved.gate, axis=1, keepdims=True) / total) / total
        ds, probs = s.ds, saved.probs
        ds.fill(0)
        np.put_along_axis(ds, choose_of(saved), dgate, axis=1)
        if self.alpha:  # d(alpha E sum_i f_i P_i) / d p_ti, P_i a mean over the sequence, averaged over the step's
            scale = self.alpha * self.e / (self.seq * self.batch)
            ds += scale * np.repeat(saved.frac, self.seq, axis=0)
        if self.router == "softmax":
            ds -= np.sum(ds * probs, axis=1, keepdims=True)
            ds *= probs
        else:
            ds *= probs * (1 - probs)
        np.copyto(s.dl, ds)
        wg.products(xf, (s.dl, dwr))
        if self.lead:
            np.matmul(s.dl, wr.T, out=s.tm)
            np.add(s.dxf, s.tm, out=s.dxf)


def choose_of(saved: Buffers) -> np.ndarray:
    """The choices kept in forward, read back from the pairs' order: pair j of row t went to expert e."""
    experts = np.repeat(np.arange(len(saved.bounds) - 1), np.diff(saved.bounds))
    return experts[saved.inv]
