"""Attention's core, O = softmax(Q K^T / sqrt(d) + causal) V, as the transformer block calls it.

A core owns where Q, K, V live (`projections`), computes O into the block's kept `o` (`forward`) and, from
dO (s.do), writes dQ, dK, dV into the block's scratch (`backward`). LocalAttention attends whole sequences
on this rank; the context-parallel cores (spmd.parallel.ring_attention, spmd.parallel.ulysses) split them
over the cp axis. With keep_probs=False (selective recomputation, Megatron's choice) the probabilities
P, a sequence^2 array per head (packed: only the causal blocks), are not kept: backward recomputes them from Q and K.
"""

from __future__ import annotations

import functools
import math
from typing import Protocol

import numpy as np

from spmd import split
from spmd.model.blocks import Buffers, Rows
from spmd.model.kernels import row_dots, row_sums


class AttentionCore(Protocol):
    saved_rows: dict[str, str]
    scratch_rows: dict[str, str]

    def saved_shapes(self, rows: Rows) -> dict[str, tuple]: ...
    def scratch_shapes(self, rows: Rows) -> dict[str, tuple]: ...
    def prepare(self, s: Buffers) -> None: ...
    def projections(self, saved: Buffers, s: Buffers) -> tuple[np.ndarray, np.ndarray, np.ndarray]: ...
    def forward(self, saved: Buffers, s: Buffers) -> None: ...
    def backward(self, saved: Buffers, s: Buffers) -> None: ...


QUERY_BLOCK = 128  # query rows scored at once: above the diagonal, whole blocks of keys are never computed
SCORE_LIMIT = 1 << 21  # elements of one scores scratch: the (sequence, head) pairs a step takes are bounded by it


class Tiles:
    """The steps attention takes over (sequences, heads, query blocks): each a group of sequences and of heads
    at once (batched matmuls), queries lo:hi against the keys 0:hi they can see. A group is as many heads, then
    sequences, as keep one step's scores (sequences x heads x block x seq) within SCORE_LIMIT elements."""

    def __init__(self, heads: int, seq: int, block: int | None = None):
        self.heads, self.seq = heads, seq
        self.block = min(seq, block or QUERY_BLOCK)
        self.bounds = [(lo, min(lo + self.block, seq)) for lo in range(0, seq, self.block)]
        self.head_group = min(heads, max(1, SCORE_LIMIT // (self.block * seq)))

    def sequence_group(self, sequences: int) -> int:
        return min(sequences, max(1, SCORE_LIMIT // (self.head_group * self.block * self.seq)))

    def score_size(self, sequences: int) -> int:
        """Elements of the largest step's scores."""
        return self.sequence_group(sequences) * self.head_group * self.block * self.seq

    def steps(self, sequences: int, reverse: bool = False):
        """(sequences slice, heads slice, lo, hi) of every step; the query blocks last to first if `reverse`."""
        g, hg = self.sequence_group(sequences), self.head_group
        bounds = self.bounds[::-1] if reverse else self.bounds
        for b in range(0, sequences, g):
            for h in range(0, self.heads, hg):
                for lo, hi in bounds:
                    yield slice(b, min(b + g, sequences)), slice(h, min(h + hg, self.heads)), lo, hi

    def causal_mask(self, mask: np.ndarray) -> None:
        """mask (block, seq + block): 0, and -inf where column c > seq + row; its columns seq - lo on
        (`shifted`) are a query block's mask over keys 0:hi."""
        mask[...] = 0
        rows, cols = np.indices(mask.shape)
        mask[cols > self.seq + rows] = -np.inf

    def shifted(self, mask: np.ndarray, lo: int, hi: int) -> np.ndarray:
        return mask[: hi - lo, self.seq - lo : self.seq - lo + hi]


def contiguous(buffer: np.ndarray, shape: tuple) -> np.ndarray:
    """The first elements of a flat scratch as a C-contiguous array of `shape` (elementwise work on it
    needs no ufunc buffers, as it would on a strided view)."""
    return buffer[: math.prod(shape)].reshape(shape)


def by_heads(a: np.ndarray, seq: int, d: int) -> np.ndarray:
    """(sequences x seq, heads x d) rows as a (sequences, heads, seq, d) view (no copy)."""
    if not a.flags.c_contiguous:
        raise ValueError("attention's operands must be C-contiguous row arrays")
    return a.reshape(a.shape[0] // seq, seq, a.shape[1] // d, d).transpose(0, 2, 1, 3)


class SoftmaxAttention:
    """Causal softmax attention of whole sequences, `heads` heads of `head_size`: the arithmetic on arrays
    of rows (sequences x seq, heads x d), shared by LocalAttention and Ulysses (after its all-to-all). It runs
    in Tiles' steps, batched over sequences and heads: a step's scores are one contiguous scratch array.
    P, where kept, is packed: each step's probabilities (keys 0:hi only) one after the other."""

    def __init__(self, heads: int, head_size: int, seq: int, keep_probs: bool, block: int | None = None):
        self.heads, self.d, self.seq, self.keep_probs = heads, head_size, seq, keep_probs
        self.scale = 1 / np.sqrt(head_size)
        self.tiles = Tiles(heads, seq, block)
        # elements of one sequence's packed P: every head's query blocks, each against the keys it sees
        self.packed = heads * sum((hi - lo) * hi for lo, hi in self.tiles.bounds)

    def probs_shape(self, sequences: int) -> dict[str, tuple]:
        return {"p": (sequences, self.packed)} if self.keep_probs else {}

    def scratch_shapes(self, sequences: int) -> dict[str, tuple]:
        """e e2 (a step's scores), r (its rows), qs (its queries times 1/sqrt(d)), mask (the causal mask, shifted
        per block); pr (P) where P is recomputed; acc (a step's dK or dV, added to those of the blocks after it)
        with more than one query block."""
        t, size = self.tiles, self.tiles.score_size(sequences)
        acc = t.sequence_group(sequences) * t.head_group * self.seq * self.d
        return {
            "e": (size,),
            "e2": (size,),
            "r": (size // self.seq,),
            "qs": (size // self.seq * self.d,),
            "mask": (t.block, self.seq + t.block),
            **({} if self.keep_probs else {"pr": (size,)}),
            **({"acc": (acc,)} if len(t.bounds) > 1 else {}),
        }

    def prepare(self, s: Buffers) -> None:
        """Fill the scratch that never changes: the causal mask."""
        self.tiles.causal_mask(s.mask)

    def _packed(self, probs, seqs: slice, heads: slice, lo: int, hi: int, sequences: int) -> np.ndarray:
        """This step's probabilities in the packed P: a group of sequences' steps are consecutive in its rows."""
        n, hh = seqs.stop - seqs.start, heads.stop - heads.start
        at = heads.start * sum((b - a) * b for a, b in self.tiles.bounds)
        at += hh * sum((b - a) * b for a, b in self.tiles.bounds if a < lo)
        flat = probs[seqs].reshape(-1)
        return flat[n * at : n * (at + hh * (hi - lo) * hi)].reshape(n, hh, hi - lo, hi)

    def _probs(self, q4, k4, seqs, heads, lo, hi, p, s: Buffers) -> None:
        """p = softmax(q k^T scale + causal) of queries lo:hi against keys 0:hi, for a group at once (the scale on
        the queries: a d-wide pass, not a keys-wide one)."""
        qs = contiguous(s.qs, p.shape[:-1] + (self.d,))
        np.multiply(q4[seqs, heads, lo:hi], self.scale, out=qs)
        np.matmul(qs, k4[seqs, heads, :hi].swapaxes(-1, -2), out=p)
        np.add(p, self.tiles.shifted(s.mask, lo, hi), out=p)
        r = contiguous(s.r, p.shape[:-1])
        np.fmax.reduce(p, axis=-1, out=r)  # the row maxima (fmax's loop is a third faster than max's)
        np.subtract(p, r[..., None], out=p)  # minus the row maxima
        np.exp(p, out=p)
        row_sums(p, r)
        np.reciprocal(r, out=r)
        np.multiply(p, r[..., None], out=p)

    def _step_probs(self, q4, k4, probs, step, sequences: int, s: Buffers, recompute: bool) -> np.ndarray:
        seqs, heads, lo, hi = step
        shape = (seqs.stop - seqs.start, heads.stop - heads.start, hi - lo, hi)
        if probs is not None:
            p = self._packed(probs, seqs, heads, lo, hi, sequences)
            if recompute:
                self._probs(q4, k4, seqs, heads, lo, hi, p, s)
            return p
        p = contiguous(s.pr, shape)
        self._probs(q4, k4, seqs, heads, lo, hi, p, s)
        return p

    def attend(self, q, k, v, o, probs, s: Buffers) -> None:
        """o = attention(q, k, v); P kept packed in probs (or None: in s.pr, a step at a time)."""
        q4, k4, v4, o4 = (by_heads(a, self.seq, self.d) for a in (q, k, v, o))
        sequences = q4.shape[0]

        def attend_step(step, s: Buffers) -> None:
            seqs, heads, lo, hi = step
            p = self._step_probs(q4, k4, probs, step, sequences, s, recompute=True)
            np.matmul(p, v4[seqs, heads, :hi], out=o4[seqs, heads, lo:hi])

        self._each_step(self.tiles.steps(sequences), sequences, s, attend_step)

    def attend_backward(self, q, k, v, do, dq, dk, dv, probs, s: Buffers) -> None:
        """From do: dq, dk, dv, through the softmax: dS = P (dP - rowsum(dP P)); P kept or recomputed. The
        query blocks run last to first: the last sees every key and writes dK, dV; the others add to them. The
        scores' 1/sqrt(d) is taken once, on dQ and dK at the end (d wide), not on every dS."""
        q4, k4, v4, do4, dq4, dk4, dv4 = (by_heads(a, self.seq, self.d) for a in (q, k, v, do, dq, dk, dv))
        sequences = q4.shape[0]

        def backward_step(step, s: Buffers) -> None:
            seqs, heads, lo, hi = step
            p = self._step_probs(q4, k4, probs, step, sequences, s, recompute=False)
            dp, t = contiguous(s.e, p.shape), contiguous(s.e2, p.shape)
            dob = do4[seqs, heads, lo:hi]
            np.matmul(dob, v4[seqs, heads, :hi].swapaxes(-1, -2), out=dp)
            self._into(p.swapaxes(-1, -2), dob, dv4[seqs, heads, :hi], hi < self.seq, s)
            r = contiguous(s.r, p.shape[:-1])
            row_dots(dp, p, r, t)
            np.subtract(dp, r[..., None], out=dp)
            np.multiply(dp, p, out=dp)  # dS, but for the scale
            np.matmul(dp, k4[seqs, heads, :hi], out=dq4[seqs, heads, lo:hi])
            self._into(dp.swapaxes(-1, -2), q4[seqs, heads, lo:hi], dk4[seqs, heads, :hi], hi < self.seq, s)

        self._each_step(self.tiles.steps(sequences, reverse=True), sequences, s, backward_step)
        np.multiply(dq, self.scale, out=dq)
        np.multiply(dk, self.scale, out=dk)

    def _each_step(self, steps, sequences: int, s: Buffers, work) -> None:
        """work(step, scratch) for every step; on a rank with cores to itself (spmd.split) each step cut by
        sequences into a piece a core, each with the part of the flat scratch its sequences would use in the
        whole step (so the pieces fit what the step was given), BLAS on one thread meanwhile."""
        ways = split.width()
        if ways == 1:
            for step in steps:
                work(step, s)
            return
        with split.one_blas_thread() as held:
            for step in steps:
                seqs, heads, lo, hi = step
                n = seqs.stop - seqs.start
                if n < 2 or not held:
                    work(step, s)
                    continue
                parts = split.blocks(n, min(ways, n))
                split.run(
                    [
                        functools.partial(
                            work, (slice(seqs.start + a, seqs.start + b), heads, lo, hi), self._share(s, a, b)
                        )
                        for a, b in parts
                    ]
                )

    def _share(self, s: Buffers, a: int, b: int) -> Buffers:
        """The scratch of a step's sequences a:b: each flat scratch's elements a sequence (scratch_shapes' sizes
        over the group's sequences) times a:b; the causal mask whole (only read)."""
        t = self.tiles
        scores = t.head_group * t.block * self.seq
        per_sequence = {
            "e": scores,
            "e2": scores,
            "pr": scores,
            "r": scores // self.seq,
            "qs": scores // self.seq * self.d,
            "acc": t.head_group * self.seq * self.d,
        }
        held = {name: (s.get(name), size) for name, size in per_sequence.items()}
        return Buffers(
            mask=s.mask, **{name: x[a * size : b * size] for name, (x, size) in held.items() if x is not None}
        )

    @staticmethod
    def _into(a, b, out, add: bool, s: Buffers) -> None:
        """out = a b, or out += a b (through s.acc) for a query block after the last."""
        if not add:
            np.matmul(a, b, out=out)
            return
        t = contiguous(s.acc, out.shape)
        np.matmul(a, b, out=t)
        np.add(out, t, out=out)


class LocalAttention:
    """Whole sequences on this rank (no cp axis): keeps Q, K, V and (unless recomputed) P."""

    saved_rows = {"q": "matmul", "k": "matmul", "v": "matmul", "p": "sequences"}
    scratch_rows: dict[str, str] = {}

    def __init__(self, heads: int, head_size: int, seq: int, keep_probs: bool):
        self.math = SoftmaxAttention(heads, head_size, seq, keep_probs)
        self.width = heads * head_size

    def saved_shapes(self, rows: Rows) -> dict[str, tuple]:
        w = self.width
        return {
            "q": (rows.matmul, w),
            "k": (rows.matmul, w),
            "v": (rows.matmul, w),
            **self.math.probs_shape(rows.sequences),
        }

    def scratch_shapes(self, rows: Rows) -> dict[str, tuple]:
        return self.math.scratch_shapes(rows.sequences)

    def prepare(self, s: Buffers) -> None:
        self.math.prepare(s)

    def projections(self, saved: Buffers, s: Buffers):
        return saved.q, saved.k, saved.v

    def forward(self, saved: Buffers, s: Buffers) -> None:
        self.math.attend(saved.q, saved.k, saved.v, saved.o, saved.get("p"), s)

    def backward(self, saved: Buffers, s: Buffers) -> None:
        self.math.attend_backward(saved.q, saved.k, saved.v, s.do, s.dq, s.dk, s.dv, saved.get("p"), s)
