"""Attention's core, O = softmax(Q K^T / sqrt(d) + causal) V, as the transformer block calls it.

A core owns where Q, K, V live (`projections`), computes O into the block's kept `o` (`forward`) and, from
dO (s.do), writes dQ, dK, dV into the block's scratch (`backward`). LocalAttention attends whole sequences
on this rank; the context-parallel cores (spmd.parallel.ring_attention, spmd.parallel.ulysses) split them
over the cp axis. With keep_probs=False (selective recomputation, Megatron's choice) the probabilities
P, a sequence^2 array per head, are not kept: backward recomputes them from Q and K, one head at a time.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from spmd.model import kernels
from spmd.model.blocks import Buffers, Rows


class AttentionCore(Protocol):
    saved_rows: dict[str, str]
    scratch_rows: dict[str, str]

    def saved_shapes(self, rows: Rows) -> dict[str, tuple]: ...
    def scratch_shapes(self, rows: Rows) -> dict[str, tuple]: ...
    def prepare(self, s: Buffers) -> None: ...
    def projections(self, saved: Buffers, s: Buffers) -> tuple[np.ndarray, np.ndarray, np.ndarray]: ...
    def forward(self, saved: Buffers, s: Buffers) -> None: ...
    def backward(self, saved: Buffers, s: Buffers) -> None: ...


class SoftmaxAttention:
    """Causal softmax attention of whole sequences, `heads` heads of `head_size`: the arithmetic on arrays
    of rows (sequences x seq, heads x d), shared by LocalAttention and Ulysses (after its all-to-all)."""

    def __init__(self, heads: int, head_size: int, seq: int, keep_probs: bool):
        self.heads, self.d, self.seq, self.keep_probs = heads, head_size, seq, keep_probs
        self.scale = 1 / np.sqrt(head_size)

    def probs_shape(self, sequences: int) -> dict[str, tuple]:
        return {"p": (sequences, self.heads, self.seq, self.seq)} if self.keep_probs else {}

    def scratch_shapes(self) -> dict[str, tuple]:
        """e e2 mask (seq^2), r ones (seq); and pr (seq^2) where P is recomputed."""
        s = self.seq
        return {"e": (s, s), "e2": (s, s), "r": (s,), "ones": (s,), "mask": (s, s),
                **({} if self.keep_probs else {"pr": (s, s)})}

    def prepare(self, s: Buffers) -> None:
        """Fill the scratch that never changes: ones, and the causal mask (0 on and below the diagonal, -inf above)."""
        s.ones[...] = 1
        s.mask[np.triu_indices(self.seq, 1)] = -np.inf

    def _probs(self, q, k, p, s: Buffers) -> None:
        """p = softmax(q k^T scale + causal) for one sequence and head."""
        np.matmul(q, k.T, out=s.e)
        np.multiply(s.e, self.scale, out=s.e)
        np.add(s.e, s.mask, out=s.e)
        np.max(s.e, axis=1, out=s.r)
        np.subtract(s.e, kernels.spread(s.r, s.ones, s.e2), out=s.e)  # minus the row maxima
        np.exp(s.e, out=s.e)
        np.sum(s.e, axis=1, out=s.r)
        np.reciprocal(s.r, out=s.r)
        kernels.scale_rows(s.e, s.r, p)

    def _each(self, sequences: int):
        n, d = self.seq, self.d
        for b in range(sequences):
            for j in range(self.heads):
                yield b, j, slice(b * n, (b + 1) * n), slice(j * d, (j + 1) * d)

    def attend(self, q, k, v, o, probs, s: Buffers) -> None:
        """o = attention(q, k, v); P kept in probs[b, j] (or None: in s.pr, for this head only)."""
        for b, j, rows, cols in self._each(q.shape[0] // self.seq):
            p = probs[b, j] if probs is not None else s.pr
            self._probs(q[rows, cols], k[rows, cols], p, s)
            np.matmul(p, v[rows, cols], out=o[rows, cols])

    def attend_backward(self, q, k, v, do, dq, dk, dv, probs, s: Buffers) -> None:
        """From do: dq, dk, dv, through the softmax: dS = P (dP - rowsum(dP P)); P kept or recomputed."""
        for b, j, rows, cols in self._each(q.shape[0] // self.seq):
            if probs is not None:
                p = probs[b, j]
            else:
                p = s.pr
                self._probs(q[rows, cols], k[rows, cols], p, s)
            dob = do[rows, cols]
            np.matmul(dob, v[rows, cols].T, out=s.e)  # dP
            np.matmul(p.T, dob, out=dv[rows, cols])
            np.multiply(s.e, p, out=s.e2)
            np.sum(s.e2, axis=1, out=s.r)
            np.subtract(s.e, kernels.spread(s.r, s.ones, s.e2), out=s.e)
            np.multiply(s.e, p, out=s.e)
            np.multiply(s.e, self.scale, out=s.e)  # dS, through the 1/sqrt(d) of the scores
            np.matmul(s.e, k[rows, cols], out=dq[rows, cols])
            np.matmul(s.e.T, q[rows, cols], out=dk[rows, cols])


class LocalAttention:
    """Whole sequences on this rank (no cp axis): keeps Q, K, V and (unless recomputed) P."""

    saved_rows = {"q": "matmul", "k": "matmul", "v": "matmul", "p": "sequences"}
    scratch_rows: dict[str, str] = {}

    def __init__(self, heads: int, head_size: int, seq: int, keep_probs: bool):
        self.math = SoftmaxAttention(heads, head_size, seq, keep_probs)
        self.width = heads * head_size

    def saved_shapes(self, rows: Rows) -> dict[str, tuple]:
        w = self.width
        return {"q": (rows.matmul, w), "k": (rows.matmul, w), "v": (rows.matmul, w),
                **self.math.probs_shape(rows.sequences)}

    def scratch_shapes(self, rows: Rows) -> dict[str, tuple]:
        return self.math.scratch_shapes()

    def prepare(self, s: Buffers) -> None:
        self.math.prepare(s)

    def projections(self, saved: Buffers, s: Buffers):
        return saved.q, saved.k, saved.v

    def forward(self, saved: Buffers, s: Buffers) -> None:
        self.math.attend(saved.q, saved.k, saved.v, saved.o, getattr(saved, "p", None), s)

    def backward(self, saved: Buffers, s: Buffers) -> None:
        self.math.attend_backward(saved.q, saved.k, saved.v, s.do, s.dq, s.dk, s.dv, getattr(saved, "p", None), s)
