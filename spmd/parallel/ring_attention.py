"""Ring attention: each cp rank attends its queries to every K/V block as the blocks pass around the ring.

Forward, for cp steps: start passing the K/V block held to the next rank (receiving the previous rank's),
attend the queries to the held block with an online softmax (a running row maximum m and sum l per head;
O rescaled as m grows), then wait; O /= l at the end and log-sum-exp m + log l is kept for backward.
Backward passes the K/V blocks around again and recomputes P = exp(S - lse) block by block (nothing of
size sequence^2 is ever kept: selective recomputation has nothing left to drop). Each block's dK/dV
accumulator travels with it one step behind: a rank adds its share to the accumulator it receives and
passes it on; after cp steps every accumulator is back at its owner. The zigzag chunks (context.RingCore) make
every rank's share of the causal work equal. Per layer and micro-batch: K and V sent cp - 1 times forward
and again in backward, the dK/dV accumulators cp times.
"""

from __future__ import annotations

import numpy as np

from spmd.collectives.shift import progress, start_shift
from spmd.collectives.tags import Tag
from spmd.model import kernels
from spmd.model.blocks import Buffers, Rows
from spmd.parallel.tokens import Chunk, ring_owner, ring_pairs
from spmd.transport.clock import traced
from spmd.transport.group import Group

BLOCK_BUFFERS = ("ak", "av", "bk", "bv", "t0k", "t0v", "t1k", "t1v", "gk", "gv")  # see scratch_shapes


class RingAttention:
    saved_rows = {"q": "matmul", "k": "matmul", "v": "matmul", "lse": "matmul"}
    scratch_rows = {
        "m": "matmul",
        "l": "matmul",
        "dsum": "matmul",
        "od": "matmul",
        **{name: "sequences" for name in BLOCK_BUFFERS},
    }

    def __init__(self, group: Group | None, rank: int, heads: int, head_size: int, chunks: list[list[Chunk]]):
        self.group, self.rank, self.heads, self.d = group, rank, heads, head_size
        self.cp, self.chunks, self.width = len(chunks), chunks, heads * head_size
        self.tokens = [sum(c.size for c in held) for held in chunks]
        self.longest = max(c.size for held in chunks for c in held)
        self.scale = 1 / np.sqrt(head_size)
        self.pairs = [ring_pairs(chunks[rank], chunks[o]) for o in range(self.cp)]

    def saved_shapes(self, rows: Rows) -> dict[str, tuple]:
        w = self.width
        return {"q": (rows.matmul, w), "k": (rows.matmul, w), "v": (rows.matmul, w), "lse": (rows.matmul, self.heads)}

    def scratch_shapes(self, rows: Rows) -> dict[str, tuple]:
        """m l dsum (rows x heads), od (rows x d); ten blocks of the longest K/V block: ak av bk bv (K/V in
        flight), t0 t1 (this step's dK/dV share, two so one can be in flight), gk gv (accumulators arriving);
        per chunk pair: e e2 e3 mask (c^2), r1 r2 r3 ones (c), ta tb (c x d), c the longest chunk."""
        c, w = self.longest, self.width
        block = (rows.sequences, max(self.tokens) * w)
        return {
            "m": (rows.matmul, self.heads),
            "l": (rows.matmul, self.heads),
            "dsum": (rows.matmul, self.heads),
            "od": (rows.matmul, self.d),
            **{name: block for name in BLOCK_BUFFERS},
            "e": (c, c),
            "e2": (c, c),
            "e3": (c, c),
            "mask": (c, c),
            "r1": (c,),
            "r2": (c,),
            "r3": (c,),
            "ones": (c,),
            "ta": (c, self.d),
            "tb": (c, self.d),
        }

    def prepare(self, s: Buffers) -> None:
        s.ones[...] = 1
        s.mask[np.triu_indices(self.longest, 1)] = -np.inf

    def projections(self, saved: Buffers, s: Buffers):
        return saved.q, saved.k, saved.v

    def _block(self, buffer: np.ndarray, owner: int) -> np.ndarray:
        """`buffer` (a block buffer cut to the micro-batch's sequences) as owner's K or V block."""
        n = buffer.shape[0]
        return buffer.reshape(-1)[: n * self.tokens[owner] * self.width].reshape(n * self.tokens[owner], self.width)

    def _each(self, sequences: int, owner: int):
        """(query rows, key rows, diagonal, head, columns) of every piece of work on owner's block."""
        mine, theirs, d = self.tokens[self.rank], self.tokens[owner], self.d
        for b in range(sequences):
            for q, k, diagonal in self.pairs[owner]:
                qr = slice(b * mine + q.offset, b * mine + q.offset + q.size)
                kr = slice(b * theirs + k.offset, b * theirs + k.offset + k.size)
                for j in range(self.heads):
                    yield qr, kr, diagonal, j, slice(j * d, (j + 1) * d)

    def _scores(self, q, k, diagonal: bool, s: Buffers) -> np.ndarray:
        e = s.e[: q.shape[0], : k.shape[0]]
        np.matmul(q, k.T, out=e)
        np.multiply(e, self.scale, out=e)
        if diagonal:
            np.add(e, s.mask[: q.shape[0], : k.shape[0]], out=e)
        return e

    @staticmethod
    def _spread(column: np.ndarray, s: Buffers, out: np.ndarray) -> np.ndarray:
        return kernels.spread(column, s.ones, out)

    def _pass_on(self, step: int, owner: int, k, v, spare):
        """Start passing the held K/V block to the next rank, receiving the previous one's into a spare
        pair (none at the last step): (requests, the blocks arriving)."""
        if step == self.cp - 1:
            return [], (k, v)
        assert self.group is not None
        nk, nv = (self._block(b, (owner - 1) % self.cp) for b in spare[step % 2])
        return [*start_shift(self.group, k, nk, Tag.SHIFT), *start_shift(self.group, v, nv, Tag.SHIFT_V)], (nk, nv)

    def forward(self, saved: Buffers, s: Buffers) -> None:
        assert self.group is not None
        n = saved.q.shape[0] // self.tokens[self.rank]
        s.m.fill(-np.inf)
        s.l.fill(0)
        saved.o.fill(0)
        k, v, spare = saved.k, saved.v, ((s.ak, s.av), (s.bk, s.bv))
        for step in range(self.cp):
            owner = ring_owner(self.rank, step, self.cp)
            moving, (nk, nv) = self._pass_on(step, owner, k, v, spare)
            with traced(self.group, f"F ring step {step}: K/V of cp rank {owner}"):
                for qr, kr, diagonal, j, cols in self._each(n, owner):
                    if j == 0:
                        progress(moving)
                    self._merge(
                        saved.q[qr, cols],
                        k[kr, cols],
                        v[kr, cols],
                        saved.o[qr, cols],
                        s.m[qr, j],
                        s.l[qr, j],
                        diagonal,
                        s,
                    )
            for request in moving:
                request.wait()
            k, v = nk, nv
        np.log(s.l, out=saved.lse)
        np.add(saved.lse, s.m, out=saved.lse)
        np.reciprocal(s.l, out=s.l)
        for j in range(self.heads):
            cols = slice(j * self.d, (j + 1) * self.d)
            kernels.scale_rows(saved.o[:, cols], s.l[:, j], s.od)
            np.copyto(saved.o[:, cols], s.od)

    def _merge(self, q, k, v, o, m, sums, diagonal: bool, s: Buffers) -> None:
        """The online softmax: fold one (query chunk, key chunk) pair of one head into o, the
        row maxima m and the row sums (of exp(score - m))."""
        rows, keys = q.shape[0], k.shape[0]
        e = self._scores(q, k, diagonal, s)
        new, alpha, total = s.r1[:rows], s.r2[:rows], s.r3[:rows]
        np.max(e, axis=1, out=new)
        np.maximum(new, m, out=new)
        np.subtract(m, new, out=alpha)
        np.exp(alpha, out=alpha)  # how much the earlier blocks shrink under the new maximum (0 at first)
        np.copyto(m, new)
        np.subtract(e, self._spread(new, s, s.e2[:rows, :keys]), out=e)
        np.exp(e, out=e)
        np.multiply(sums, alpha, out=sums)
        np.sum(e, axis=1, out=total)
        np.add(sums, total, out=sums)
        kernels.scale_rows(o, alpha, s.ta[:rows])
        np.matmul(e, v, out=s.tb[:rows])
        np.add(s.ta[:rows], s.tb[:rows], out=o)

    def backward(self, saved: Buffers, s: Buffers) -> None:
        assert self.group is not None
        n = saved.q.shape[0] // self.tokens[self.rank]
        for j in range(self.heads):  # D = rowsum(dO O) per head: the softmax backward's row term
            cols = slice(j * self.d, (j + 1) * self.d)
            np.multiply(s.do[:, cols], saved.o[:, cols], out=s.od)
            np.sum(s.od, axis=1, out=s.dsum[:, j])
        s.dq.fill(0)
        k, v, spare, shares = saved.k, saved.v, ((s.ak, s.av), (s.bk, s.bv)), ((s.t0k, s.t0v), (s.t1k, s.t1v))
        passing: list = []  # last step's accumulator: being sent on, and this step's arriving
        for step in range(self.cp):
            owner = ring_owner(self.rank, step, self.cp)
            moving, (nk, nv) = self._pass_on(step, owner, k, v, spare)
            dk, dv = (self._block(b, owner) for b in shares[step % 2])  # two, so last step's may still be in flight
            dk.fill(0)
            dv.fill(0)
            with traced(self.group, f"B ring step {step}: K/V of cp rank {owner}"):
                for qr, kr, diagonal, j, cols in self._each(n, owner):
                    if j == 0:
                        progress(moving + passing)
                    self._pair_grad(
                        saved.q[qr, cols],
                        k[kr, cols],
                        v[kr, cols],
                        s.do[qr, cols],
                        saved.lse[qr, j],
                        s.dsum[qr, j],
                        s.dq[qr, cols],
                        dk[kr, cols],
                        dv[kr, cols],
                        diagonal,
                        s,
                    )
            for request in passing:
                request.wait()
            if step > 0:  # add the accumulator of this block from the ranks before
                np.add(dk, self._block(s.gk, owner), out=dk)
                np.add(dv, self._block(s.gv, owner), out=dv)
            nxt = (owner - 1) % self.cp
            into = (s.dk, s.dv) if step == self.cp - 1 else (self._block(s.gk, nxt), self._block(s.gv, nxt))
            passing = [
                *start_shift(self.group, dk, into[0], Tag.SHIFT_DK),
                *start_shift(self.group, dv, into[1], Tag.SHIFT_DV),
            ]
            for request in moving:
                request.wait()
            k, v = nk, nv
        for request in passing:
            request.wait()

    def _pair_grad(self, q, k, v, do, lse, dsum, dq, dk, dv, diagonal: bool, s: Buffers) -> None:
        """One pair of one head: P recomputed from the kept log-sum-exp; dQ, dK, dV accumulated."""
        rows, keys = q.shape[0], k.shape[0]
        p = self._scores(q, k, diagonal, s)
        np.subtract(p, self._spread(lse, s, s.e2[:rows, :keys]), out=p)
        np.exp(p, out=p)
        dp = s.e3[:rows, :keys]
        np.matmul(do, v.T, out=dp)
        np.matmul(p.T, do, out=s.ta[:keys])
        np.add(dv, s.ta[:keys], out=dv)
        np.subtract(dp, self._spread(dsum, s, s.e2[:rows, :keys]), out=dp)
        np.multiply(dp, p, out=dp)
        np.multiply(dp, self.scale, out=dp)  # dS
        np.matmul(dp, k, out=s.ta[:rows])
        np.add(dq, s.ta[:rows], out=dq)
        np.matmul(dp.T, q, out=s.ta[:keys])
        np.add(dk, s.ta[:keys], out=dk)
