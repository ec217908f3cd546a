"""spmd's dense models' parameters and data: the MLP's and the pre-norm transformer's flat layers, their tensor
slices, initial values and seeded rows (the numbers spmd's MLP workload has always drawn, bit for bit).

A layer's parameters are one flat vector, the unit FSDP/ZeRO shards: MLP [W1, W2, g]; transformer
[g1, Wq, Wk, Wv, Wo, W1, W2, g2] (its MLP part has the MLP layer's layout).
"""

from __future__ import annotations

import numpy as np

from spmd.model.exact import exactness_bound


def layer_size(attention: bool, hidden: int, ffn: int, width: int) -> int:
    """Elements of a layer's flat vector; `width` is the width of Q/K/V (h, or a TP rank's heads x d)."""
    mlp = 2 * hidden * ffn + hidden
    return mlp + hidden + 4 * hidden * width if attention else mlp


def mlp_views(flat: np.ndarray, hidden: int, ffn: int):
    """(W1 (h, f), W2 (f, h), g (h,)) of an MLP layer's flat vector."""
    hf = hidden * ffn
    return flat[:hf].reshape(hidden, ffn), flat[hf : 2 * hf].reshape(ffn, hidden), flat[2 * hf : 2 * hf + hidden]


def transformer_views(flat: np.ndarray, hidden: int, ffn: int, attention: int):
    """(g1, Wq, Wk, Wv (h, w), Wo (w, h), W1, W2, g2) of a transformer layer; w = `attention`."""
    h, w = hidden, attention
    g1 = flat[:h]
    at = h + h * w
    wq, wk, wv = (flat[h + i * h * w : at + i * h * w].reshape(h, w) for i in range(3))
    wo = flat[h + 3 * h * w : h + 4 * h * w].reshape(w, h)
    w1, w2, g2 = mlp_views(flat[h + 4 * h * w :], hidden, ffn)
    return g1, wq, wk, wv, wo, w1, w2, g2


def tensor_slice(net, attention: bool, heads: tuple[int, int], ffn: tuple[int, int]) -> np.ndarray:
    """Where a tensor-parallel rank's slice lives in the full flat layer: its heads' columns of Wq, Wk, Wv
    and rows of Wo, its ffn columns of W1 and rows of W2; the gains whole. The slice has the layout of a
    layer with attention width (heads) x d and ffn share, so the block runs on it unchanged."""
    h, f, d = net.hidden, net.ffn, net.head_size
    index = np.arange(layer_size(attention, h, f, h))
    (f0, f1), (c0, c1) = ffn, (heads[0] * d, heads[1] * d)
    if not attention:
        w1, w2, g = mlp_views(index, h, f)
        return np.concatenate([w1[:, f0:f1].ravel(), w2[f0:f1].ravel(), g])
    g1, wq, wk, wv, wo, w1, w2, g2 = transformer_views(index, h, f, h)
    columns = [w[:, c0:c1].ravel() for w in (wq, wk, wv)]
    return np.concatenate([g1, *columns, wo[c0:c1].ravel(), w1[:, f0:f1].ravel(), w2[f0:f1].ravel(), g2])


def mlp_initial(net, layer: int) -> np.ndarray:
    """An MLP layer's flat parameters at step 0, the same on every rank: small integers under --integers."""
    rng = np.random.default_rng((net.seed, 1, layer))
    h, f = net.hidden, net.ffn
    size = layer_size(False, h, f, h)
    if net.integers:
        flat = rng.integers(-1, 2, size).astype(net.dtype)
        flat[2 * h * f :] = rng.integers(1, 3, h)
        return flat
    flat = np.empty(size, dtype=net.dtype)
    flat[: h * f] = rng.standard_normal(h * f) / np.sqrt(h)
    flat[h * f : 2 * h * f] = rng.standard_normal(h * f) / np.sqrt(2 * f * net.layers)  # a stable residual stream
    flat[2 * h * f :] = 1 + 0.1 * rng.standard_normal(h)
    return flat


def transformer_initial(net, layer: int) -> np.ndarray:
    """A transformer layer's flat parameters at step 0: gains near 1, the residual outputs scaled by 1/sqrt(2 L)."""
    h, f = net.hidden, net.ffn
    rng = np.random.default_rng((net.seed, 3, layer))
    flat = np.empty(layer_size(True, h, f, h), dtype=net.dtype)
    g1, wq, wk, wv, wo, w1, w2, g2 = transformer_views(flat, h, f, h)
    g1[...], g2[...] = 1 + 0.1 * rng.standard_normal(h), 1 + 0.1 * rng.standard_normal(h)
    for w in (wq, wk, wv):
        w[...] = rng.standard_normal((h, h)) / np.sqrt(h)
    wo[...] = rng.standard_normal((h, h)) / np.sqrt(2 * h * net.layers)
    w1[...] = rng.standard_normal((h, f)) / np.sqrt(h)
    w2[...] = rng.standard_normal((f, h)) / np.sqrt(2 * f * net.layers)
    return flat


def rows(net, step: int) -> tuple[np.ndarray, np.ndarray]:
    """(X, target) of step `step`, each (batch x seq, hidden): seeded normal rows, or small integers."""
    rng = np.random.default_rng((net.seed, 2, step))
    shape = (net.tokens, net.hidden)
    if net.integers:
        return rng.integers(-2, 3, shape).astype(net.dtype), rng.integers(-2, 3, shape).astype(net.dtype)
    return rng.standard_normal(shape).astype(net.dtype), rng.standard_normal(shape).astype(net.dtype)


def check_exact(net, views=mlp_views) -> None:
    """Integer mode promises bitwise steps on every mesh: refuse, before the run, where a sum could round
    (spmd/model/exact.py proves it: every partial sum's numerator fits the mantissa)."""
    limit = 2.0 ** (np.finfo(net.dtype).nmant + 1)
    bound, where = exactness_bound(net, views)
    if bound >= limit:
        raise ValueError(
            f"--integers at these sizes is not exact: a partial sum's numerator reaches {bound:.3g} >= 2^"
            f"{np.finfo(net.dtype).nmant + 1} ({net.dtype}'s exact integers) at {where}; use fewer --steps "
            f"or --layers, a smaller --hidden/--ffn (e.g. --layers 2 --hidden 16 --ffn 32), and a power-of-two "
            f"--lr (e.g. 0.015625) beyond one step"
        )
