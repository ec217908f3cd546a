"""The training and validation batches of a prepared corpus, read on demand through a memory map.

A sample is a window of seq + 1 tokens of train.bin: window j starts at token j x seq (N = (tokens - 1) // seq
windows). The run's i-th sample is window order_e(i mod N) of epoch e = i div N, order_e a permutation of 0..N-1
keyed by (seed, e): a function of (seed, global sample index) only. The permutation is a 4-round Feistel network
on the next even power of two, walked until it lands below N (format-preserving encryption's cycle walk), so no
array of N is ever held. Step s's global batch is samples s x B ... s x B + B - 1,
so any mesh, and a run resumed on any mesh, reads the same batches: the checkpoint's data position is the count
of samples consumed (step x B). A Batch is the global batch's token rows as the engine asks for them (a slice of
rows at a time): a rank reads from the file only the rows it holds (its data rank's sequences, its cp chunks,
the first stage the ids and the last the targets); nothing is held per step or for the run's length.
Validation: the windows of val.bin in order, from its start.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from spmd.data.tokenizer import load_tokenizer
from spmd.data.tokens import TokenFile, TokenFileError


def _mix(x: int) -> int:
    """splitmix64's finalizer: a well-mixed 64-bit function of x (the Feistel rounds' function)."""
    x &= (1 << 64) - 1
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return x ^ (x >> 31)


class Batch:
    """Rows of one batch (sample after sample, seq rows each) of a token file: ids (shift 0) or their next tokens
    (shift 1); rows[lo:hi] reads only those."""

    def __init__(self, tokens: np.ndarray, starts: np.ndarray, seq: int, shift: int):
        self.tokens, self.starts, self.seq, self.shift = tokens, starts, seq, shift

    def __len__(self) -> int:
        return self.starts.size * self.seq

    def __getitem__(self, rows: slice) -> np.ndarray:
        lo, hi, _ = rows.indices(len(self))
        out = np.empty(max(hi - lo, 0), dtype=np.int64)
        at = 0
        while lo < hi:
            sample, position = divmod(lo, self.seq)
            take = min(hi - lo, self.seq - position)
            begin = int(self.starts[sample]) + position + self.shift
            out[at : at + take] = self.tokens[begin : begin + take]
            at, lo = at + take, lo + take
        return out

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return self[0 : len(self)].astype(dtype or np.int64)


class Corpus:
    """A folder written by `python -m spmd data prepare`, opened for a run of `seq` tokens a sample."""

    def __init__(self, folder: str | Path, seq: int, batch: int, seed: int):
        self.folder, self.seq, self.batch, self.seed = Path(folder), seq, batch, seed
        try:
            self.meta = json.loads((self.folder / "meta.json").read_text())
        except (OSError, ValueError) as exc:
            raise TokenFileError(
                f"--data {folder}: not a prepared corpus (meta.json: {exc}); make one with "
                "python -m spmd data prepare --out DIR"
            ) from None
        self.tokenizer = load_tokenizer(self.folder)
        self.train, self.val = TokenFile(self.folder / "train.bin"), TokenFile(self.folder / "val.bin")
        for part in (self.train, self.val):
            if part.vocab != self.tokenizer.vocab:
                raise TokenFileError(f"{part.path}: vocabulary {part.vocab}, its tokenizer's is {self.tokenizer.vocab}")
            part.check_ids()  # an id outside the vocabulary would train silently wrong: refused here
        self.windows = (self.train.count - 1) // seq
        if self.windows < 1:
            raise TokenFileError(f"{self.train.path}: {self.train.count} tokens hold no window of --seq {seq} + 1")
        self.half_bits = max(1, (int(self.windows - 1).bit_length() + 1) // 2)  # the Feistel halves' width
        self._keys: tuple[int, list[int]] = (-1, [])

    @property
    def vocab(self) -> int:
        return self.tokenizer.vocab

    @property
    def fingerprint(self) -> str:
        return self.meta["fingerprint"]

    def window(self, epoch: int, at: int) -> int:
        """Epoch `epoch`'s at-th window: a permutation of range(windows) keyed by (seed, epoch)."""
        bits, mask = self.half_bits, (1 << self.half_bits) - 1
        if self._keys[0] != epoch:  # the current epoch's 4 round keys, and no other's
            self._keys = (epoch, np.random.default_rng((self.seed, 8, epoch)).integers(0, 1 << 62, 4).tolist())
        keys = self._keys[1]
        x = at
        while True:
            left, right = x >> bits, x & mask
            for key in keys:
                left, right = right, left ^ (_mix(right ^ key) & mask)
            x = (left << bits) | right
            if x < self.windows:
                return x

    def sample_starts(self, first: int, count: int) -> np.ndarray:
        """Where samples first ... first + count - 1 of the run start in train.bin."""
        return np.array(
            [self.window(*divmod(i, self.windows)) * self.seq for i in range(first, first + count)], dtype=np.int64
        )

    def batch_data(self, step: int) -> tuple[Batch, Batch]:
        """Step `step`'s global batch: (ids, targets) rows."""
        starts = self.sample_starts(step * self.batch, self.batch)
        return Batch(self.train.tokens, starts, self.seq, 0), Batch(self.train.tokens, starts, self.seq, 1)

    def eval_batches(self, tokens: int) -> list[tuple[Batch, Batch]]:
        """The validation batches covering at least `tokens` target tokens (whole batches), from val.bin's start."""
        windows = (self.val.count - 1) // self.seq
        count = min(-(-tokens // (self.batch * self.seq)), windows // self.batch)
        if count < 1:
            raise TokenFileError(
                f"{self.val.path}: {self.val.count} tokens hold no validation batch of --batch "
                f"{self.batch} x --seq {self.seq}"
            )
        out = []
        for b in range(count):
            starts = np.arange(b * self.batch, (b + 1) * self.batch, dtype=np.int64) * self.seq
            out.append((Batch(self.val.tokens, starts, self.seq, 0), Batch(self.val.tokens, starts, self.seq, 1)))
        return out

    def eval_bytes(self, evals: list[tuple[Batch, Batch]]) -> int:
        """The UTF-8 bytes the targets of `evals` stand for: bits a byte = the mean loss x targets / (bytes ln 2),
        so runs with different tokenizers compare on the same text."""
        lengths = self.tokenizer.token_bytes()
        return int(sum(lengths[np.asarray(targets)].sum() for _, targets in evals))

    def describe(self) -> dict:
        """What a checkpoint records of the data, to refuse a resume on other data."""
        return {
            "fingerprint": self.fingerprint,
            "tokenizer": self.tokenizer.kind,
            "vocab": self.vocab,
            "folder": str(self.folder.resolve()),
            "unigram_entropy": self.meta.get("unigram_entropy"),
        }
