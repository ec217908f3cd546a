"""spmd's dense models' parameters and data: the MLP's and the pre-norm transformer's parameter tables (their
tensor splits), initial values and seeded rows (the numbers spmd's MLP workload has always drawn, bit for bit).

A layer's parameters are one flat vector, the unit FSDP/ZeRO shards: MLP [W1, W2, g]; transformer
[g1, Wq, Wk, Wv, Wo, W1, W2, g2] (its MLP part has the MLP layer's layout).
"""

from __future__ import annotations

import numpy as np

from spmd.layout import block_range
from spmd.model.exact import exactness_bound
from spmd.model.params import Flat, Piece, Table
from spmd.model.params import size as size_of


def table(net, attention: bool) -> Table:
    """A layer's parameter table, whole: MLP [W1 (h, f), W2 (f, h), g]; the transformer's attention before it."""
    h, f = net.hidden, net.ffn
    mlp = (Piece("w1", (h, f), (None, "ffn")), Piece("w2", (f, h), ("ffn", None)), Piece("g", (h,)))
    if not attention:
        return mlp
    columns = tuple(Piece(name, (h, h), (None, "heads")) for name in ("wq", "wk", "wv"))
    return (Piece("g1", (h,)), *columns, Piece("wo", (h, h), ("heads", None)), *mlp[:2], Piece("g2", (h,)))


def cut(net, attention: bool, t: int, j: int) -> dict[str, tuple[int, int]]:
    """Tensor rank j's ranges: its heads' columns (none without attention), its ffn channels."""
    q0, q1 = block_range(net.heads, t, j) if attention else (0, 0)
    return {"heads": (q0 * net.head_size, q1 * net.head_size), "ffn": block_range(net.ffn, t, j)}


def mlp_initial(net, layer: int) -> np.ndarray:
    """An MLP layer's flat parameters at step 0, the same on every rank: small integers under --integers."""
    rng = np.random.default_rng((net.seed, 1, layer))
    h, f = net.hidden, net.ffn
    size = size_of(table(net, attention=False))
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
    layout = Flat(table(net, attention=True))
    flat = np.empty(layout.size, dtype=net.dtype)
    g1, wq, wk, wv, wo, w1, w2, g2 = layout.views(flat)
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


def check_exact(net) -> None:
    """Integer mode promises bitwise steps on every mesh: refuse, before the run, where a sum could round
    (spmd/model/exact.py proves it: every partial sum's numerator fits the mantissa)."""
    limit = 2.0 ** (np.finfo(net.dtype).nmant + 1)
    layout = Flat(table(net, attention=False))
    bound, where = exactness_bound(net, lambda flat, h, f: layout.views(flat))
    if bound >= limit:
        raise ValueError(
            f"--integers at these sizes is not exact: a partial sum's numerator reaches {bound:.3g} >= 2^"
            f"{np.finfo(net.dtype).nmant + 1} ({net.dtype}'s exact integers) at {where}; use fewer --steps "
            f"or --layers, a smaller --hidden/--ffn (e.g. --layers 2 --hidden 16 --ffn 32), and a power-of-two "
            f"--lr (e.g. 0.015625) beyond one step"
        )
