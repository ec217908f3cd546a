"""Synthetic tokens with structure a model can learn: a fixed random bigram chain over the vocabulary.

Each token has `FANOUT` likely successors (drawn once from the seed); a sequence starts at a random token
and walks the chain. A model that learned nothing reaches about log V; one that learned the chain about
log FANOUT. Step `step`'s batch is a function of (seed, step) only, so every mesh draws the same batch and
a resumed run reads the batches it would have read.
"""

from __future__ import annotations

import numpy as np

FANOUT = 3


def successors(vocab: int, seed: int) -> np.ndarray:
    """(V, FANOUT) the chain's next tokens of each token."""
    return np.random.default_rng((seed, 6)).integers(0, vocab, (vocab, FANOUT))


def token_batch(vocab: int, batch: int, seq: int, seed: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids, targets), each (batch x seq,) int64 sequence after sequence: targets[i] is the token after ids[i]."""
    table = successors(vocab, seed)
    rng = np.random.default_rng((seed, 7, step))
    walk = np.empty((batch, seq + 1), dtype=np.int64)
    walk[:, 0] = rng.integers(0, vocab, batch)
    choices = rng.integers(0, FANOUT, (batch, seq))
    for i in range(seq):
        walk[:, i + 1] = table[walk[:, i], choices[:, i]]
    return walk[:, :-1].reshape(-1).copy(), walk[:, 1:].reshape(-1).copy()
