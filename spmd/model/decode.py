"""Sampling from the trained language model on one device, with a key/value cache (nanoGPT's sampler).

Each new token runs the decoder on itself alone, attending to the cached keys and values of the tokens before
it (RoPE at its position, grouped-query heads repeated as in training). The context is the trained sequence
length: when it is full the oldest half is dropped and the rest re-read (RoPE sees relative positions only).
Sampling: the last position's logits / temperature, the top k kept, drawn with numpy's PCG64 from the seed, so
the same seed gives the same text on any machine (temperature 0: the most likely token). A mixture of experts
trained with --bias-balance chooses its experts with the trained bias, as training and validation did
(DeepSeek-V3 keeps it at inference); with a capacity (--capacity-factor) a token's pair is dropped when its expert
already took C pairs of the context's earlier tokens, as in a training sequence (a causal rule: the context's
first seq tokens route exactly as a validation sequence does).
"""

from __future__ import annotations

import numpy as np

from spmd.model.llama import is_moe
from spmd.model.llama_reference import rms_norm, rope, rope_tables, sigmoid, views
from spmd.model.moe_reference import moe_forward


class Decoder:
    def __init__(self, net, units: list[np.ndarray], biases: dict[int, np.ndarray] | None = None):
        """`biases`: the balancing bias of each mixture-of-experts unit (unit index -> E values), as trained."""
        self.net, self.units = net, [np.asarray(u, dtype=np.float64) for u in units]
        self.biases = dict(biases or {})
        d, L = net.head_size, net.layers
        self.cache_k = np.zeros((L, net.seq, net.kv, d))
        self.cache_v = np.zeros((L, net.seq, net.kv, d))
        self.length = 0  # tokens in the cache
        self.taken = {layer: [0] * net.experts for layer in range(net.layers) if is_moe(net, layer)}

    def read(self, ids: np.ndarray) -> np.ndarray:
        """Append `ids` to the context; the logits (len(ids), V) after each of them."""
        net, h, d = self.net, self.net.hidden, self.net.head_size
        n, start = len(ids), self.length
        group = net.heads // net.kv
        x = self.units[0].reshape(net.vocab, h)[ids]
        cos, sin = rope_tables(np.arange(start, start + n), d, net.rope_base)
        cos, sin = cos[:, None, :], sin[:, None, :]
        for layer in range(net.layers):
            moe = is_moe(net, layer)
            g1, wq, wk, wv, wo, g2, *ffn = views(self.units[1 + layer], net, moe)
            n1 = rms_norm(x, g1, net.norm_eps)[0]
            q = rope((n1 @ wq).reshape(n, net.heads, d), cos, sin)
            self.cache_k[layer, start:start + n] = rope((n1 @ wk).reshape(n, net.kv, d), cos, sin)
            self.cache_v[layer, start:start + n] = (n1 @ wv).reshape(n, net.kv, d)
            keys = np.repeat(self.cache_k[layer, :start + n], group, axis=1)  # (T, heads, d)
            values = np.repeat(self.cache_v[layer, :start + n], group, axis=1)
            scores = np.einsum("nhd,thd->hnt", q, keys) / np.sqrt(d)
            future = np.arange(start + n)[None, :] > (start + np.arange(n))[:, None]
            scores[:, future] = -np.inf
            p = np.exp(scores - scores.max(axis=-1, keepdims=True))
            p /= p.sum(axis=-1, keepdims=True)
            x = x + np.einsum("hnt,thd->nhd", p, values).reshape(n, net.heads * d) @ wo
            n2 = rms_norm(x, g2, net.norm_eps)[0]
            if moe:
                x = x + moe_forward(n2, ffn, net, self.biases.get(1 + layer), self.taken[layer])[0]
            else:
                w1, w3, w2 = ffn
                z = n2 @ w1
                x = x + (z * sigmoid(z) * (n2 @ w3)) @ w2
        self.length += n
        final = rms_norm(x, self.units[net.layers + 1], net.norm_eps)[0]
        return final @ self.units[net.layers + 2].reshape(net.vocab, h).T


def sample(logits: np.ndarray, temperature: float, top_k: int, rng: np.random.Generator) -> int:
    if temperature == 0:
        return int(np.argmax(logits))
    scaled = logits / temperature
    if 0 < top_k < scaled.size:
        scaled[scaled < np.sort(scaled)[-top_k]] = -np.inf
    p = np.exp(scaled - scaled.max())
    return int(rng.choice(scaled.size, p=p / p.sum()))


def generate(net, units: list[np.ndarray], prompt: np.ndarray, max_tokens: int, temperature: float = 0.8,
             top_k: int = 40, seed: int = 0, biases: dict[int, np.ndarray] | None = None) -> list[int]:
    """The tokens sampled after `prompt` (ids), max_tokens of them (`biases`: see Decoder)."""
    if temperature < 0 or top_k < 0 or max_tokens < 0:
        raise ValueError(f"--temperature, --top-k and --max-tokens must be >= 0, got {temperature}, {top_k}, "
                         f"{max_tokens}")
    if len(prompt) == 0:
        raise ValueError("an empty prompt: give at least one token (the CLI starts from the end-of-document token)")
    rng = np.random.default_rng(seed)
    context = list(prompt[-net.seq:])
    decoder = Decoder(net, units, biases)
    logits = decoder.read(np.array(context))[-1]
    out: list[int] = []
    for _ in range(max_tokens):
        token = sample(logits, temperature, top_k, rng)
        out.append(token)
        context.append(token)
        if decoder.length == net.seq:  # full: keep the newest half and read it again
            context = context[-(net.seq // 2):]
            decoder = Decoder(net, units, biases)
            logits = decoder.read(np.array(context))[-1]
        else:
            logits = decoder.read(np.array([token]))[-1]
    return out
