"""A mixture of experts in the Llama block's place of its SwiGLU FFN (Grok-1's layer; Mixtral's, DeepSeek's).

Router: scores = softmax(N Wr) (or --router sigmoid), in the state dtype (fp32 under mixed precision); each row
chooses the top_k experts by score, a tie going to the lower expert index (a stable sort, so every rank and the
reference choose alike); its gates are those scores, not renormalized (Grok-1's; --renormalize divides them by
their sum). Experts: SwiGLU FFNs, W2_e (silu(x W1_e) * (x W3_e)), or with --expert-activation gelu Grok-1's gated
GELU (gelu in silu's place); a row's output is the gate-weighted sum of its chosen experts' outputs.
Dispatch: the rows' (row, choice) pairs sorted by expert (stable: row order inside an expert), so each expert's rows
are one contiguous block of a rows x top_k buffer: the memory is fixed, wherever the tokens go.
Capacity (--capacity-factor CF > 0): in each sequence an expert takes at most C = ceil(seq k / E CF) pairs, those of
the earliest rows; a dropped pair adds nothing (its gate is zeroed; the residual carries the row). A sequence is the
group, so which pairs drop does not depend on the mesh or the micro-batches. Under cp a rank holds chunks of each
sequence: the cp axis (SequenceAxis) gathers every chunk's counts per expert, so the capacity counts the pairs of
the sequence's earlier chunks too and the balancing fractions are the whole sequence's.
Balancing (--aux-loss alpha, Switch/GShard's): per sequence alpha E sum_i f_i P_i, f_i the fraction of the
sequence's pairs routed to expert i (before capacity), P_i its mean score over the sequence's rows; the model's loss
adds its mean over the step's sequences (alpha at perfectly uniform routing). Only its gradient reaches the
parameters; the printed loss stays the cross-entropy.
Over ep (expert parallelism) a rank holds E / ep experts, and the ep axis (spmd.parallel.expert) takes every
pair to its expert's rank and back: the dispatch sends the pairs' rows and gates, the combine here adds the
outputs sent back to their rows as above; backward sends the output gradients the same way, and the rows' input
gradients and the gates' gradients back. The received rows, their gates and the counts are kept for backward; the
buffers hold, dropless, every pair of the ep group (any rank's experts may take them all), or with a capacity only
the kept pairs, at most C of each sequence for each expert.
Under TP a rank holds the same ffn channels of every expert, and the router whole: it sees the same rows on every
tp rank (gathered under SP), so every rank routes alike. A gate's gradient (the row's output gradient dotted with
the expert's output, partial over the channels) is all-reduced over tp, k numbers a row; the router's gradient is
then whole on every rank, and its part of the input gradient is added on tp rank 0 only (the input gradient is a
partial sum over tp).
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Protocol

import numpy as np

from spmd.collectives import all_reduce
from spmd.collectives.tags import Tag
from spmd.model import lm_kernels as lm
from spmd.model.blocks import Buffers, Rows
from spmd.stopwatch import matmul


class ExpertAxis(Protocol):
    """What a mixture of experts calls of the ep axis (spmd.parallel.expert.ExpertParallel: there for its
    route and all-to-alls; the model does not import the parallel axes)."""

    size: int
    exchanged: np.ndarray

    def held(self, experts: int) -> int: ...
    def exchange_counts(self, tp, bounds: np.ndarray, rc: np.ndarray) -> None: ...
    def route(self, bounds: np.ndarray, rc: np.ndarray, backward: bool): ...
    def send(self, tp, route, home: np.ndarray, received: np.ndarray, out: np.ndarray, tag: int) -> None: ...
    def back(self, tp, route, values: np.ndarray, by_source: np.ndarray, home: np.ndarray, tag: int) -> None: ...


class SequenceAxis(Protocol):
    """What a mixture of experts calls of the cp axis (spmd.parallel.routing_counts.WholeSequences)."""

    size: int
    sizes: list[int]  # this rank's chunks of a sequence, in the order it holds them

    def whole(self, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...


def capacity(seq: int, top_k: int, experts: int, factor: float) -> int:
    """The pairs an expert takes from one sequence: ceil(seq k CF / E), in exact arithmetic on CF as written
    (2.2 is 11/5: seq 25, k 2, E 2 take 55, not the 56 of floating point); 0 when dropless (no limit)."""
    return math.ceil(seq * top_k * Fraction(repr(factor)) / experts) if factor > 0 else 0


def choose(scores: np.ndarray, top_k: int) -> np.ndarray:
    """Each row's top_k experts by score, the highest first, a tie going to the lower expert index."""
    return np.argsort(-scores, axis=1, kind="stable")[:, :top_k]


def kept(experts_sorted: np.ndarray, sequence_sorted: np.ndarray, limit: int, earlier=None) -> np.ndarray:
    """Of pairs sorted by (expert, row), whether each is within its expert's first `limit` of its sequence (under
    cp: of its sequence's chunk here, after `earlier` pairs of the sequence's earlier chunks, per pair)."""
    if not limit:
        return np.ones(experts_sorted.size, dtype=bool)
    key = experts_sorted * (int(sequence_sorted.max(initial=0)) + 1) + sequence_sorted
    first = np.r_[0, np.flatnonzero(np.diff(key)) + 1]  # where each (expert, sequence) run starts
    starts = np.repeat(first, np.diff(np.r_[first, key.size]))
    return np.arange(key.size) - starts + (0 if earlier is None else earlier) < limit


class MoEFFN:
    """The experts' half of a Llama block: from the entered normed rows xf to the partial output (see above)."""

    def __init__(
        self, net, hidden: int, ffn: int, lead: bool, ep: ExpertAxis | None = None, cp: SequenceAxis | None = None
    ):
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
        self.axis = ep if ep is not None and ep.size > 1 else None  # None: every expert on this rank
        # under cp, with a capacity or the balancing loss: the whole sequences' counts (None: sequences held whole)
        self.split = cp if cp is not None and cp.size > 1 and (self.alpha or self.limit) else None
        self.chunk_sizes = [net.seq] if self.split is None else self.split.sizes
        # the experts' gate: SwiGLU's silu, or Grok-1's gelu
        gelu = net.expert_activation == "gelu"
        self.act = lm.gelu if gelu else lm.silu
        self.act_parts, self.act_grad_after = (
            (lm.gelu_parts, lm.gelu_grad_after) if gelu else (lm.silu_parts, lm.silu_grad_after)
        )
        self.held = self.e if self.axis is None else self.axis.held(self.e)
        # pairs sent to other ep ranks and received from them (the axis counts them; engine.exchanged reads them)
        self.exchanged = np.zeros(4, dtype=np.int64) if self.axis is None else self.axis.exchanged
        self.dtypes = {
            "probs": "state",
            "gate": "state",
            "keep": "state",
            "frac": "state",
            "order": "index",
            "inv": "index",
            "bounds": "index",
            "dwt": "state",
            "ds": "state",
            "dl": "state",
            "we": "state",
            "dwe": "state",
            "dws": "state",
            "rc": "index",
        }
        self.saved_rows = {
            "probs": "matmul",
            "gate": "matmul",
            "keep": "matmul",
            "order": "matmul",
            "inv": "matmul",
            "z1": "pairs",
            "u": "pairs",
            "frac": "sequences",
        }
        self.scratch_rows = {
            **dict.fromkeys(("xs", "dys", "dwt", "ds", "dl"), "matmul"),
            **dict.fromkeys(("esz", "emm", "edm", "edu", "esg"), "pairs"),
        }
        if self.axis is not None:
            self.saved_rows.update(xe="pairs", we="pairs")  # rc: (ep, held), whatever the rows
            self.scratch_rows.update(ye="pairs", dye="pairs", dwe="pairs", dws="matmul")

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
        m, k, e, f, p = rows.matmul, self.k, self.e, self.f, rows.pairs
        shapes = {
            "probs": (m, e),
            "gate": (m, k),
            "keep": (m, k),
            "order": (m, k),
            "inv": (m, k),
            "bounds": (e + 1,),
            "z1": (p, f),
            "u": (p, f),
            "frac": (rows.sequences if self.alpha else 0, e),
        }  # the balancing loss's f, per sequence
        if self.axis is not None:  # the rows received, their gates, and how many from each rank for each expert here
            shapes.update(xe=(p, self.h), we=(p,), rc=(self.axis.size, self.held))
        return shapes

    def scratch_shapes(self, rows: Rows) -> dict[str, tuple]:
        """xs dys (the pairs' rows and output gradients, h wide), esz emm edm edu esg (ffn wide, the pairs computed
        here: named apart from a dense layer's), dwt (the gates' gradients), ds dl (the scores' and logits'
        gradients); over ep ye dye (the outputs, then input gradients, and output gradients of the pairs computed
        here), dwe dws (their gates' gradients, here and back home)."""
        m, k, e, f, h, p = rows.matmul, self.k, self.e, self.f, self.h, rows.pairs
        shapes = {
            "xs": (m, k, h),
            "dys": (m, k, h),
            **dict.fromkeys(("esz", "emm", "edm", "edu", "esg"), (p, f)),
            "dwt": (m, k),
            "ds": (m, e),
            "dl": (m, e),
        }
        if self.axis is not None:
            shapes.update(ye=(p, h), dye=(p, h), dwe=(p,), dws=(m, k))
        return shapes

    def stash_sizes(self, rows: Rows) -> tuple[int, int]:
        """Elements a deferred weight gradient keeps: M and dY per expert for W2, X with dU and dZ for W3 and
        W1 (the pairs' rows); and the router's gradient itself (made in the I: its operands are in two dtypes
        under mixed precision, and it is small)."""
        p, h, f, e = rows.pairs, self.h, self.f, self.e
        return p * ((f + h) + (h + 2 * f)), h * e

    def _segments(self, bounds) -> list[tuple[slice, int]]:
        """(rows, expert) of each expert's pairs in a buffer sorted by expert (one rank)."""
        return [(slice(int(bounds[i]), int(bounds[i + 1])), i) for i in range(self.e)]

    def _kept_at(self, saved: Buffers) -> np.ndarray | None:
        """Over ep with a capacity: where the kept pairs are in the expert-sorted buffer (only they are sent, so
        the buffers are sized by the capacity); None when every pair goes (dropless)."""
        if not self.limit:
            return None
        return np.flatnonzero(saved.keep.reshape(-1)[saved.order.reshape(-1)])

    def _sent_bounds(self, saved: Buffers, kept_at: np.ndarray | None) -> np.ndarray:
        """Where each expert's pairs start in what is sent (the expert-sorted buffer, or its kept pairs)."""
        if kept_at is None:
            return saved.bounds
        experts = np.repeat(np.arange(self.e), np.diff(saved.bounds))[kept_at]
        return np.r_[0, np.cumsum(np.bincount(experts, minlength=self.e))]

    def _weights(self, saved: Buffers) -> np.ndarray:
        """Each pair's weight in the combine: its gate (renormalized over the row's choices if asked), 0 if
        dropped."""
        gate = saved.gate / saved.gate.sum(axis=1, keepdims=True) if self.renormalize else saved.gate
        return gate * saved.keep

    def forward(self, tp, weights, xf, partial, saved: Buffers, s: Buffers) -> None:
        wr, *experts = weights
        m, k = xf.shape[0], self.k
        self._route(wr, xf, saved, s)
        order = saved.order.reshape(-1)
        xs = s.xs.reshape(m * k, -1)
        np.take(xf, order // k, axis=0, out=xs)
        weight = self._weights(saved).reshape(-1)[order]  # each pair's, in the sorted order
        if self.axis is None:  # the experts' outputs, weighted, into xs (no longer needed by then)
            self._experts_forward(experts, xs, weight, saved, s, self._segments(saved.bounds), xs)
        else:
            self._forward_over_ep(self.axis, tp, experts, xs, weight, saved, s)
        self._combine(xs, saved.inv, partial, s.tm)

    def _forward_over_ep(self, ep: ExpertAxis, tp, experts, xs, weight, saved: Buffers, s: Buffers) -> None:
        """The pairs to their experts' ranks (received by source in ye and dwe, kept in expert order in xe and we),
        computed there, and their outputs back into xs (by source in dye on the way). With a capacity only the kept
        pairs go, gathered in dys; a dropped pair's output is 0."""
        kept_at = self._kept_at(saved)
        m = xs.shape[0]
        send = xs if kept_at is None else np.take(xs, kept_at, axis=0, out=s.dys.reshape(m, -1)[: kept_at.size])
        gates = weight if kept_at is None else weight[kept_at]
        bounds = self._sent_bounds(saved, kept_at)
        ep.exchange_counts(tp, bounds, saved.rc)
        route = ep.route(bounds, saved.rc, backward=False)
        ep.send(tp, route, send, s.ye, saved.xe, Tag.EXPERT_ROWS)
        ep.send(tp, route, gates, s.dwe, saved.we, Tag.EXPERT_GATES)
        self._experts_forward(experts, saved.xe, saved.we, saved, s, route.segments, s.ye)
        ep.back(tp, route, s.ye, s.dye, send, Tag.EXPERT_ROWS)
        if kept_at is not None:
            xs.fill(0)
            xs[kept_at] = send

    def _experts_forward(self, weights, xe, we, saved: Buffers, s: Buffers, segments, ye) -> None:
        """ye = each pair's expert's gated output of its row xe (SwiGLU, or Grok-1's gated GELU), times its weight
        we (ye may be xe)."""
        w1, w3, w2 = weights
        r = segments[-1][0].stop if segments else 0
        z1, u, mm = saved.z1[:r], saved.u[:r], s.emm[:r]
        for rows, e in segments:
            matmul(xe[rows], w1[e], out=z1[rows])
            matmul(xe[rows], w3[e], out=u[rows])
        self.act(z1, mm)
        np.multiply(mm, u, out=mm)
        np.multiply(mm, we[:r, None], out=mm)
        for rows, e in segments:
            matmul(mm[rows], w2[e], out=ye[rows])

    def _route(self, wr, xf, saved: Buffers, s: Buffers) -> None:
        """Scores, choices, gates, the pairs' order by expert, capacity, and the balancing fractions."""
        m, k, e = xf.shape[0], self.k, self.e
        state = s.dl.dtype  # the logits in fp32 under mixed precision: a bf16 logit can flip a top-k
        matmul(xf.astype(state, copy=False), wr.astype(state, copy=False), out=s.dl)
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
        if not (self.limit or self.alpha):
            saved.keep.fill(1)
            return
        chunk = self._chunk_of_pairs(m)  # each pair's (sequence, chunk held), in row order
        counts = np.bincount(chunk * e + flat, minlength=m // sum(self.chunk_sizes) * len(self.chunk_sizes) * e)
        counts = counts.reshape(-1, len(self.chunk_sizes), e)
        if self.split is None:
            earlier, whole = np.zeros_like(counts), counts[:, 0]
        else:
            earlier, whole = self.split.whole(counts)
        before = earlier.reshape(-1)[chunk[order] * e + flat[order]]
        saved.keep.reshape(-1)[order] = kept(flat[order], chunk[order], self.limit, before)
        if self.alpha:
            np.multiply(whole, 1 / (self.seq * k), out=saved.frac)

    def _chunk_of_pairs(self, m: int) -> np.ndarray:
        """Each of m rows' pairs' (sequence, chunk held) as one index: its sequence times the chunks held, plus its
        chunk (the rows are each sequence's chunks here, in order; one chunk, the sequence, without cp)."""
        sizes = self.chunk_sizes
        held = np.repeat(np.arange(len(sizes)), sizes)  # per position among a sequence's rows here
        rows = np.arange(m * self.k) // self.k
        return rows // sum(sizes) * len(sizes) + held[rows % sum(sizes)]

    def _combine(self, pairs, inv, out, tmp) -> None:
        """out = for each row the sum of its k pairs' rows (in choice order)."""
        np.take(pairs, inv[:, 0], axis=0, out=out)
        for j in range(1, self.k):
            np.take(pairs, inv[:, j], axis=0, out=tmp)
            np.add(out, tmp, out=out)

    def backward(self, tp, wg, weights, grads, xf, dyf, saved: Buffers, s: Buffers) -> None:
        """From dyf (the output's gradient on the matmul rows): s.dxf the input's (partial over tp), the experts'
        and the router's gradients into grads."""
        wr, *experts = weights
        dwr, *dexperts = grads
        m, k = xf.shape[0], self.k
        if self.lead:  # counted in backward: it runs once a micro-batch, forward again under recomputation
            self.routed[:-1] += np.diff(saved.bounds)
            self.routed[-1] += m * k - int(np.count_nonzero(saved.keep))
        if self.gamma:
            self.loads[self.unit] = self.loads.get(self.unit, 0) + np.diff(saved.bounds)
        order = saved.order.reshape(-1)
        tokens = order // k
        xs, dys = s.xs.reshape(m * k, -1), s.dys.reshape(m * k, -1)
        np.take(dyf, tokens, axis=0, out=dys)
        if self.axis is None:  # the pairs' rows again (recomputed, not kept); their input gradients into dys
            np.take(xf, tokens, axis=0, out=xs)
            weight = self._weights(saved).reshape(-1)[order]
            dwe = self._experts_backward(
                wg, experts, dexperts, xs, weight, dys, saved, s, self._segments(saved.bounds), dys, xs, None
            )
        else:
            dwe = self._backward_over_ep(self.axis, tp, wg, experts, dexperts, xs, dys, saved, s)
        # each pair's weight's gradient, in row order, partial over the channels (summed over tp)
        s.dwt.reshape(-1)[...] = dwe[saved.inv.reshape(-1)]
        tp.sum_partial(s.dwt)
        self._combine(dys, saved.inv, s.dxf, s.tm)
        self._router_backward(tp, wg, wr, dwr, xf, saved, s)

    def _backward_over_ep(self, ep: ExpertAxis, tp, wg, experts, dexperts, xs, dys, saved: Buffers, s: Buffers):
        """The output gradients dys to the experts' ranks (by source in ye, in expert order in dye); the input
        gradients (in ye, by source in dye) back into dys, and the gates' gradients back into dws, returned. With a
        capacity only the kept pairs', gathered in xs; a dropped pair's are 0."""
        kept_at = self._kept_at(saved)
        send = dys if kept_at is None else np.take(dys, kept_at, axis=0, out=xs[: kept_at.size])
        route = ep.route(self._sent_bounds(saved, kept_at), saved.rc, backward=True)
        ep.send(tp, route, send, s.ye, s.dye, Tag.EXPERT_ROWS)
        gates = self._experts_backward(
            wg, experts, dexperts, saved.xe, saved.we, s.dye, saved, s, route.segments, s.ye, s.dye, s.dwe
        )
        ep.back(tp, route, s.ye, s.dye, send, Tag.EXPERT_ROWS)
        dwe = s.dws.reshape(-1)
        back = dwe if kept_at is None else np.empty(kept_at.size, dtype=dwe.dtype)
        ep.back(tp, route, gates, np.empty_like(gates), back, Tag.EXPERT_GATES)
        if kept_at is not None:
            dys.fill(0)
            dys[kept_at] = send
            dwe.fill(0)
            dwe[kept_at] = back
        return dwe

    def _experts_backward(self, wg, weights, grads, xe, we, dye, saved: Buffers, s: Buffers, segments, dxe, tmp, dwe):
        """The pairs computed here, from their output gradients dye: their input gradients into dxe (tmp: a
        scratch as wide, may be xe or dye), the experts' weight gradients, and (returned, into dwe if given)
        each pair's weight's gradient, partial over the ffn channels."""
        w1, w3, w2 = weights
        dw1, dw3, dw2 = grads
        r = segments[-1][0].stop if segments else 0
        z1, u, sz, mm, dm, du, sg = (a[:r] for a in (saved.z1, saved.u, s.esz, s.emm, s.edm, s.edu, s.esg))
        for rows, e in segments:
            matmul(dye[rows], w2[e].T, out=dm[rows])  # d of each pair's weighted product, before its weight
        self.act_parts(z1, sz, sg)
        np.multiply(sz, u, out=mm)  # the SwiGLU products M
        gates = np.sum(np.multiply(dm, mm, out=du), axis=1, dtype=s.dwt.dtype, out=None if dwe is None else dwe[:r])
        weight = we[:r, None]
        np.multiply(mm, weight, out=mm)
        for rows, e in segments:
            wg.products(mm[rows], (dye[rows], dw2[e]))
        np.multiply(dm, weight, out=dm)
        np.multiply(dm, sz, out=du)  # dU = dM act(Z1)
        self.act_grad_after(z1, sg, sz)
        np.multiply(dm, u, out=dm)
        np.multiply(dm, sz, out=dm)  # dZ1 = dM U act'(Z1)
        for rows, e in segments:
            wg.products(xe[rows], (du[rows], dw3[e]), (dm[rows], dw1[e]))
        for rows, e in segments:  # each pair's input gradient
            matmul(dm[rows], w1[e].T, out=dxe[rows])
            matmul(du[rows], w3[e].T, out=tmp[rows])
        np.add(dxe[:r], tmp[:r], out=dxe[:r])
        return gates

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
            ds += scale * np.repeat(saved.frac, sum(self.chunk_sizes), axis=0)  # a sequence's rows here
        if self.router == "softmax":
            ds -= np.sum(ds * probs, axis=1, keepdims=True)
            ds *= probs
        else:
            ds *= probs * (1 - probs)
        np.copyto(s.dl, ds)
        matmul(xf.T, s.dl, out=wg.value(dwr))  # (as the whole backward's product: same operands, same call)
        if self.lead:
            matmul(s.dl, wr.T, out=s.tm)
            np.add(s.dxf, s.tm, out=s.dxf)


def choose_of(saved: Buffers) -> np.ndarray:
    """The choices kept in forward, read back from the pairs' order: pair j of row t went to expert e."""
    experts = np.repeat(np.arange(len(saved.bounds) - 1), np.diff(saved.bounds))
    return experts[saved.inv]
