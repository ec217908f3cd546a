"""Sampling from a trained language model on one device, with a key/value cache (nanoGPT's sampler).

Each new token runs the decoder its model's spec gives on itself alone, attending to the cached keys and values
of the tokens before it (the Llama's below: RoPE at its position, grouped-query heads repeated as in training;
the GPT-2's in spmd.model.gpt2_decode: its learned position). The context is the trained sequence length: when
it is full the oldest half is dropped and the rest re-read (RoPE sees relative positions only; GPT-2's learned
positions start again at 0, as nanoGPT crops its context).
Sampling (nanoGPT's and llm.c's controls): the last position's logits / temperature, the top k kept, then the
nucleus (top p), all in float64 with numpy; drawn with numpy's PCG64 from the seed, so the same seed gives the
same text on any machine (temperature 0: the most likely token). A mixture of experts trained with
--bias-balance chooses its experts with the trained bias, as training and validation did (DeepSeek-V3 keeps it
at inference); with a capacity (--capacity-factor) a token's pair is dropped when its expert already took C
pairs of the context's earlier tokens, as in a training sequence (a causal rule: the context's first seq tokens
route exactly as a validation sequence does).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Protocol

import numpy as np

from spmd.model.llama import is_moe
from spmd.model.llama_reference import rms_norm, rope, rope_tables, sigmoid, views
from spmd.model.moe_reference import moe_forward


class CachedDecoder(Protocol):
    """What the sampler asks of a model's decoder (its spec's `decoder`): the tokens read so far, and the
    logits after each of the next ones, appended to the cache."""

    length: int

    def read(self, ids: np.ndarray) -> np.ndarray: ...


def cached_attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, start: int) -> np.ndarray:
    """Causal attention of the n new queries q (n, heads, d), at positions start.., over the cache's T = start + n
    keys and values (T, heads, d): (n, heads x d)."""
    n, heads, d = q.shape
    scores = np.einsum("nhd,thd->hnt", q, keys) / np.sqrt(d)
    scores[:, np.arange(start + n)[None, :] > (start + np.arange(n))[:, None]] = -np.inf  # the future
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("hnt,thd->nhd", p, values).reshape(n, heads * d)


class Decoder:
    """The Llama-style model's (its spec's `decoder`; the GPT-2's is spmd.model.gpt2_decode's)."""

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
            self.cache_k[layer, start : start + n] = rope((n1 @ wk).reshape(n, net.kv, d), cos, sin)
            self.cache_v[layer, start : start + n] = (n1 @ wv).reshape(n, net.kv, d)
            keys = np.repeat(self.cache_k[layer, : start + n], group, axis=1)  # (T, heads, d)
            values = np.repeat(self.cache_v[layer, : start + n], group, axis=1)
            x = x + cached_attention(q, keys, values, start) @ wo
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


def cli_flag(name: str) -> str:
    """A sampling control's name as the command line spells it: top_p -> --top-p."""
    return "--" + name.replace("_", "-")


def check_sampling(
    max_tokens: int, temperature: float, top_k: int, top_p: float, name: Callable[[str], str] = cli_flag
) -> None:
    """Refuse a control out of range, naming it as `name` spells it (the CLI's flags, or the API's arguments)."""
    if not max_tokens >= 1:
        raise ValueError(f"{name('max_tokens')} must be >= 1, got {max_tokens}")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"{name('temperature')} must be a number >= 0 (0: the most likely token), got {temperature}")
    if not top_k >= 0:
        raise ValueError(f"{name('top_k')} must be >= 0 (0: off), got {top_k}")
    if not 0 < top_p <= 1:  # NaN fails too
        raise ValueError(f"{name('top_p')} must be in (0, 1] (1: off), got {top_p}")


def probabilities(logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """The distribution a token is drawn from, in float64: softmax(logits / temperature) over the k most likely
    (ties at the k-th kept; 0: all), then cut to the nucleus of top_p (1: all). temperature > 0."""
    scaled = np.asarray(logits, dtype=np.float64) / temperature
    if 0 < top_k < scaled.size:
        scaled[scaled < np.sort(scaled)[-top_k]] = -np.inf
    p = np.exp(scaled - scaled.max())
    p /= p.sum()
    return nucleus(p, top_p) if top_p < 1 else p


def nucleus(p: np.ndarray, top_p: float) -> np.ndarray:
    """`p` cut to the smallest set of most likely tokens whose probabilities sum to >= top_p, renormalized;
    equal probabilities rank by id (a stable sort), so the set is the same on any machine."""
    order = np.argsort(-p, kind="stable")
    reached = int(np.searchsorted(np.cumsum(p[order]), top_p))  # the first prefix sum >= top_p
    inside = order[: reached + 1]
    kept = np.zeros_like(p)
    kept[inside] = p[inside]
    return kept / kept.sum()


def sample(logits: np.ndarray, temperature: float, top_k: int, top_p: float, rng: np.random.Generator) -> int:
    """One token drawn from `probabilities` with `rng` (temperature 0: the most likely, drawing nothing)."""
    if temperature == 0:
        return int(np.argmax(logits))
    p = probabilities(logits, temperature, top_k, top_p)
    return int(rng.choice(p.size, p=p))


def sample_rng(seed: int, index: int = 0) -> np.random.Generator:
    """The generator of sample `index` of `seed`: sample 0 draws from the seed itself (so it is the single sample
    of that seed), sample i > 0 from numpy's child stream (seed, spawn key i): independent, and for seeds below
    2**128 equal to no other (seed, index)'s."""
    if index == 0:
        return np.random.default_rng(seed)
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(index,)))


def tokens(
    net,
    units: list[np.ndarray],
    prompt: np.ndarray,
    max_tokens: int,
    temperature: float = 0.8,
    top_k: int = 40,
    top_p: float = 1.0,
    rng: np.random.Generator | None = None,
    biases: dict[int, np.ndarray] | None = None,
) -> Iterator[int]:
    """The tokens sampled after `prompt` (ids; its last net.seq are read), one at a time as each is drawn, up to
    max_tokens (`biases`: see Decoder). The controls are checked now, before the first token is asked for."""
    check_sampling(max_tokens, temperature, top_k, top_p)
    if len(prompt) == 0:
        raise ValueError("an empty prompt: give at least one token (the CLI starts from the end-of-document token)")
    return _sampled(
        net,
        units,
        list(prompt[-net.seq :]),
        max_tokens,
        (temperature, top_k, top_p),
        rng if rng is not None else sample_rng(0),
        biases,
    )


def _sampled(
    net, units, context: list, max_tokens: int, controls: tuple[float, int, float], rng, biases
) -> Iterator[int]:
    decoder = net.spec.decoder(net, units, biases)
    logits = decoder.read(np.array(context))[-1]
    for _ in range(max_tokens):
        token = sample(logits, *controls, rng)
        yield token
        context.append(token)
        if decoder.length == net.seq:  # full: keep the newest half and read it again
            context = context[-(net.seq // 2) :]
            decoder = net.spec.decoder(net, units, biases)
            logits = decoder.read(np.array(context))[-1]
        else:
            logits = decoder.read(np.array([token]))[-1]


def generate(
    net,
    units: list[np.ndarray],
    prompt: np.ndarray,
    max_tokens: int,
    temperature: float = 0.8,
    top_k: int = 40,
    seed: int = 0,
    biases: dict[int, np.ndarray] | None = None,
    *,
    top_p: float = 1.0,
    index: int = 0,
) -> list[int]:
    """The max_tokens tokens of sample `index` of `seed` after `prompt` (see tokens, sample_rng)."""
    return list(tokens(net, units, prompt, max_tokens, temperature, top_k, top_p, sample_rng(seed, index), biases))
