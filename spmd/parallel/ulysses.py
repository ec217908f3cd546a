"""DeepSpeed-Ulysses: an all-to-all over the cp axis turns each rank's slice of every sequence (all its
heads) into whole sequences for a share of its heads; attention runs locally (SoftmaxAttention), and a
second all-to-all turns O back. Four all-to-alls of the activations per layer forward (Q, K, V, then O)
and four in backward (dO, then dQ, dK, dV). A tp rank's heads split over cp by blocks: uneven when cp
does not divide them (DeepSpeed requires it to), each rank at least one (context.UlyssesCore.check).
"""

from __future__ import annotations

import numpy as np

from spmd.collectives import all_to_all_into
from spmd.layout import block_range
from spmd.model.attention import SoftmaxAttention
from spmd.model.blocks import Buffers, Rows
from spmd.parallel.tokens import Chunk
from spmd.transport.group import Group


class UlyssesAttention:
    saved_rows = {"qh": "sequences", "kh": "sequences", "vh": "sequences", "p": "sequences"}
    scratch_rows = {
        "q": "matmul",
        "k": "matmul",
        "v": "matmul",
        "oh": "sequences",
        "dqh": "sequences",
        "dkh": "sequences",
        "dvh": "sequences",
        "send": "sequences",
        "recv": "sequences",
    }

    def __init__(
        self,
        group: Group | None,
        rank: int,
        heads: int,
        head_size: int,
        seq: int,
        chunks: list[list[Chunk]],
        keep_probs: bool,
    ):
        self.group, self.rank, self.d, self.seq = group, rank, head_size, seq
        self.cp, self.width = len(chunks), heads * head_size
        self.starts = [held[0].start for held in chunks]
        self.tokens = [held[0].size for held in chunks]
        self.columns = [tuple(head_size * c for c in block_range(heads, self.cp, g)) for g in range(self.cp)]
        self.mine = self.columns[rank][1] - self.columns[rank][0]  # width of this rank's heads
        self.math = SoftmaxAttention(self.mine // head_size, head_size, seq, keep_probs)

    def saved_shapes(self, rows: Rows) -> dict[str, tuple]:
        whole = (rows.sequences, self.seq, self.mine)
        return {"qh": whole, "kh": whole, "vh": whole, **self.math.probs_shape(rows.sequences)}

    def scratch_shapes(self, rows: Rows) -> dict[str, tuple]:
        """q k v (this rank's tokens, all its heads: the projections), oh dqh dkh dvh (whole sequences, its
        share of heads; oh holds dO in backward), send and recv (an all-to-all's blocks, packed), and the
        softmax's scratch."""
        w, whole = self.width, (rows.sequences, self.seq, self.mine)
        packed = (rows.sequences, max(self.tokens[self.rank] * w, self.seq * self.mine))
        return {
            "q": (rows.matmul, w),
            "k": (rows.matmul, w),
            "v": (rows.matmul, w),
            "oh": whole,
            "dqh": whole,
            "dkh": whole,
            "dvh": whole,
            "send": packed,
            "recv": packed,
            **self.math.scratch_shapes(rows.sequences),
        }

    def prepare(self, s: Buffers) -> None:
        self.math.prepare(s)

    def projections(self, saved: Buffers, s: Buffers):
        return s.q, s.k, s.v

    def _blocks(self, buffer: np.ndarray, shapes: list[tuple]) -> list[np.ndarray]:
        """Consecutive C-contiguous blocks of these shapes in a packed buffer."""
        flat, blocks, at = buffer.reshape(-1), [], 0
        for shape in shapes:
            size = int(np.prod(shape))
            blocks.append(flat[at : at + size].reshape(shape))
            at += size
        return blocks

    def to_heads(self, local: np.ndarray, out: np.ndarray, s: Buffers) -> None:
        """(this rank's tokens, all heads) -> out (whole sequences, this rank's heads)."""
        assert self.group is not None
        n, t = out.shape[0], self.tokens[self.rank]
        x = local.reshape(n, t, self.width)
        sends = self._blocks(s.send, [(n, t, hi - lo) for lo, hi in self.columns])
        for block, (lo, hi) in zip(sends, self.columns, strict=True):
            np.copyto(block, x[:, :, lo:hi])
        recvs = self._blocks(s.recv, [(n, tr, self.mine) for tr in self.tokens])
        all_to_all_into(self.group, sends, recvs)
        for block, start, tr in zip(recvs, self.starts, self.tokens, strict=True):
            np.copyto(out[:, start : start + tr], block)

    def to_tokens(self, whole: np.ndarray, out: np.ndarray, s: Buffers) -> None:
        """(whole sequences, this rank's heads) -> out (this rank's tokens, all heads): to_heads reversed."""
        assert self.group is not None
        n, t = whole.shape[0], self.tokens[self.rank]
        sends = self._blocks(s.send, [(n, tr, self.mine) for tr in self.tokens])
        for block, start, tr in zip(sends, self.starts, self.tokens, strict=True):
            np.copyto(block, whole[:, start : start + tr])
        recvs = self._blocks(s.recv, [(n, t, hi - lo) for lo, hi in self.columns])
        all_to_all_into(self.group, sends, recvs)
        y = out.reshape(n, t, self.width)
        for block, (lo, hi) in zip(recvs, self.columns, strict=True):
            np.copyto(y[:, :, lo:hi], block)

    def forward(self, saved: Buffers, s: Buffers) -> None:
        for local, whole in ((s.q, saved.qh), (s.k, saved.kh), (s.v, saved.vh)):
            self.to_heads(local, whole, s)
        flat = lambda a: a.reshape(-1, self.mine)  # noqa: E731
        self.math.attend(flat(saved.qh), flat(saved.kh), flat(saved.vh), flat(s.oh), saved.get("p"), s)
        self.to_tokens(s.oh, saved.o, s)

    def backward(self, saved: Buffers, s: Buffers) -> None:
        self.to_heads(s.do, s.oh, s)  # oh now holds dO, by heads
        flat = lambda a: a.reshape(-1, self.mine)  # noqa: E731
        self.math.attend_backward(
            flat(saved.qh),
            flat(saved.kh),
            flat(saved.vh),
            flat(s.oh),
            flat(s.dqh),
            flat(s.dkh),
            flat(s.dvh),
            saved.get("p"),
            s,
        )
        for whole, local in ((s.dqh, s.dq), (s.dkh, s.dk), (s.dvh, s.dv)):
            self.to_tokens(whole, local, s)
