"""The GPT-2-style model's key/value-cache decoder on one device (what spmd.model.decode samples with).

Each new token runs the blocks on itself alone: its learned position is the cache's length (the tokens before
it), its query attends to the cached keys and values; LayerNorm, the GELU MLP and the head (tied or not) as the
single-device oracle (spmd.model.gpt2_reference) computes them, in float64. The model knows net.seq positions:
the sampler starts a full context again from its newest half, at position 0, as nanoGPT crops its context.
"""

from __future__ import annotations

import numpy as np

from spmd.model.decode import cached_attention
from spmd.model.gpt2_reference import block_views, gelu, layer_norm


class GPT2Decoder:
    def __init__(self, net, units: list[np.ndarray], biases: dict | None = None):
        """`biases`: unused (a GPT-2 has no mixture of experts); taken as every model's decoder takes it."""
        self.net, self.units = net, [np.asarray(u, dtype=np.float64) for u in units]
        shape = (net.layers, net.seq, net.heads, net.head_size)
        self.cache_k, self.cache_v = np.zeros(shape), np.zeros(shape)
        self.length = 0  # tokens in the cache

    def read(self, ids: np.ndarray) -> np.ndarray:
        """Append `ids` to the context; the logits (len(ids), V) after each of them."""
        net, h, v = self.net, self.net.hidden, self.net.vocab
        n, start = len(ids), self.length
        if start + n > net.seq:
            raise ValueError(f"{start + n} tokens: the model has {net.seq} positions (it trained with --seq {net.seq})")
        table, positions = self.units[0][: v * h].reshape(v, h), self.units[0][v * h :].reshape(net.seq, h)
        x = table[ids] + positions[start : start + n]
        for layer in range(net.layers):
            x = self._block(layer, x, start)
        self.length += n
        final = self.units[net.layers + 1]
        normed = layer_norm(x, final[:h], final[h:], net.norm_eps)[0]
        return normed @ self.units[net.layers + 2][: v * h].reshape(v, h).T

    def _block(self, layer: int, x: np.ndarray, start: int) -> np.ndarray:
        """One block on the new rows `x`, their keys and values cached after the `start` before them."""
        net, d = self.net, self.net.head_size
        n, eps = len(x), net.norm_eps
        g1, c1, wq, bq, wk, bk, wv, bv, wo, bo, g2, c2, w1, b1, w2, b2 = block_views(
            self.units[1 + layer], net.hidden, net.ffn, net.hidden
        )
        n1 = layer_norm(x, g1, c1, eps)[0]
        q = (n1 @ wq + bq).reshape(n, net.heads, d)
        self.cache_k[layer, start : start + n] = (n1 @ wk + bk).reshape(n, net.heads, d)
        self.cache_v[layer, start : start + n] = (n1 @ wv + bv).reshape(n, net.heads, d)
        attended = cached_attention(q, self.cache_k[layer, : start + n], self.cache_v[layer, : start + n], start)
        hid = x + attended @ wo + bo
        n2 = layer_norm(hid, g2, c2, eps)[0]
        return hid + gelu(n2 @ w1 + b1) @ w2 + b2
