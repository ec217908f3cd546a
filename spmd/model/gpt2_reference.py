"""The GPT-2-style language model on one device, written for reading, not speed: the oracle the parallel runs
are compared with. It shares nothing with the parallel units but the flat layouts and initial values
(spmd.model.gpt2) and the Llama oracle's softmaxes, loss and clipping; every gradient is written by hand.

Rows are the step's batch x seq tokens, sequence after sequence; x0 = E[ids] + P[position]. A block:
n1 = LN(x; g1, c1); q, k, v = n1 Wq + bq, n1 Wk + bk, n1 Wv + bv; causal multi-head attention o;
h1 = x + o Wo + bo; n2 = LN(h1; g2, c2); y = h1 + gelu(n2 W1 + b1) W2 + b2. The loss is the mean cross-entropy
of LN(y_L; gf, cf) W^T against the targets. Under mixed precision the units are cast to the compute dtype;
the norms and softmaxes compute in at least float32.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from spmd.model.fields import NetFields
from spmd.model.gpt2 import initial_unit
from spmd.model.llama import unit_kinds
from spmd.model.llama_reference import (
    _wide,
    causal_softmax,
    clip_scale,
    combined_grads,
    cross_entropy,
    global_norm,
    merge_heads,
    softmax_backward,
    split_heads,
    step_batch,
    trained_units,
)
from spmd.model.optimizers import adamw_reference

C = np.sqrt(2 / np.pi)  # GELU's tanh approximation: 0.5 z (1 + tanh(C (z + 0.044715 z^3)))


def gelu(z: np.ndarray) -> np.ndarray:
    return 0.5 * z * (1 + np.tanh(C * (z + 0.044715 * z**3)))


def gelu_derivative(z: np.ndarray) -> np.ndarray:
    t = np.tanh(C * (z + 0.044715 * z**3))
    return 0.5 * (1 + t) + 0.5 * z * (1 - t * t) * C * (1 + 3 * 0.044715 * z * z)


def layer_norm(x: np.ndarray, g: np.ndarray, b: np.ndarray, eps: float) -> tuple[np.ndarray, tuple]:
    xw = _wide(x)
    xhat = (xw - xw.mean(axis=1, keepdims=True)) / np.sqrt(xw.var(axis=1, keepdims=True) + eps)
    xhat = xhat.astype(x.dtype)
    return xhat * g + b, (xhat, np.sqrt(xw.var(axis=1, keepdims=True) + eps))


def layer_norm_backward(dy: np.ndarray, g: np.ndarray, saved: tuple) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dx, dg, db): the Jacobian of (x - mean) / std applied to dn = dy g, by hand."""
    xhat, std = saved
    dn = dy * g
    dx = (dn - dn.mean(axis=1, keepdims=True) - xhat * (dn * xhat).mean(axis=1, keepdims=True)) / std
    return dx.astype(dy.dtype), (dy * xhat).sum(axis=0), dy.sum(axis=0)


def block_views(flat: np.ndarray, h: int, f: int, w: int) -> tuple[np.ndarray, ...]:
    """(g1, c1, Wq, bq, Wk, bk, Wv, bv, Wo, bo, g2, c2, W1, b1, W2, b2) of a block's flat vector, `w` the width
    of Q, K, V: written here, not read from the model."""
    shapes = (
        (h,),
        (h,),
        (h, w),
        (w,),
        (h, w),
        (w,),
        (h, w),
        (w,),
        (w, h),
        (h,),
        (h,),
        (h,),
        (h, f),
        (f,),
        (f, h),
        (h,),
    )
    views, at = [], 0
    for shape in shapes:
        views.append(flat[at : at + int(np.prod(shape))].reshape(shape))
        at += int(np.prod(shape))
    return tuple(views)


def block_forward(x: np.ndarray, flat: np.ndarray, net: NetFields) -> tuple[np.ndarray, dict[str, Any]]:
    g1, c1, wq, bq, wk, bk, wv, bv, wo, bo, g2, c2, w1, b1, w2, b2 = block_views(flat, net.hidden, net.ffn, net.hidden)
    b, s, a = net.batch_of(x), net.seq, net.heads
    n1, ln1 = layer_norm(x, g1, c1, net.norm_eps)
    q, k, v = (split_heads(n1 @ w + bias, b, s, a) for w, bias in ((wq, bq), (wk, bk), (wv, bv)))
    p = causal_softmax(q @ k.swapaxes(-1, -2) / np.sqrt(net.head_size))
    o = merge_heads(p @ v)
    h1 = x + o @ wo + bo
    n2, ln2 = layer_norm(h1, g2, c2, net.norm_eps)
    z = n2 @ w1 + b1
    y = h1 + gelu(z) @ w2 + b2
    return y, dict(x=x, n1=n1, ln1=ln1, q=q, k=k, v=v, p=p, o=o, h1=h1, n2=n2, ln2=ln2, z=z)


def block_backward(
    dy: np.ndarray, flat: np.ndarray, c: dict[str, Any], net: NetFields
) -> tuple[np.ndarray, np.ndarray]:
    """(d of the block's input, its flat gradient) from d of its output."""
    g1, c1, wq, bq, wk, bk, wv, bv, wo, bo, g2, c2, w1, b1, w2, b2 = block_views(flat, net.hidden, net.ffn, net.hidden)
    b, s, a = net.batch_of(dy), net.seq, net.heads
    dz = (dy @ w2.T) * gelu_derivative(c["z"])
    dn2 = dz @ w1.T
    dh1_norm, dg2, dc2 = layer_norm_backward(dn2, g2, c["ln2"])
    dh1 = dy + dh1_norm
    do = split_heads(dh1 @ wo.T, b, s, a)
    dv = c["p"].swapaxes(-1, -2) @ do
    dscores = softmax_backward(c["p"], do @ c["v"].swapaxes(-1, -2)) / np.sqrt(net.head_size)
    dq, dk = merge_heads(dscores @ c["k"]), merge_heads(dscores.swapaxes(-1, -2) @ c["q"])
    dv = merge_heads(dv)
    dn1 = dq @ wq.T + dk @ wk.T + dv @ wv.T
    dx_norm, dg1, dc1 = layer_norm_backward(dn1, g1, c["ln1"])
    n1, n2 = c["n1"], c["n2"]
    grads = [
        dg1,
        dc1,
        *(piece for d in (dq, dk, dv) for piece in ((n1.T @ d).ravel(), d.sum(axis=0))),
        (c["o"].T @ dh1).ravel(),
        dh1.sum(axis=0),
        dg2,
        dc2,
        (n2.T @ dz).ravel(),
        dz.sum(axis=0),
        (gelu(c["z"]).T @ dy).ravel(),
        dy.sum(axis=0),
    ]
    return dh1 + dx_norm, np.concatenate([np.asarray(g, dtype=dy.dtype).ravel() for g in grads])


def loss_and_grads(
    net: NetFields, units: list[np.ndarray], ids: np.ndarray, targets: np.ndarray, dtype: Any = np.float64
):
    """(loss, gradient of each unit) of one batch, the units cast to `dtype`. A tied head is read as the head
    (its first V h elements) and gets its own contribution; its position rows get 0."""
    v, h, layers, seq = net.vocab, net.hidden, net.layers, net.seq
    params = [np.asarray(p).astype(dtype) for p in units]
    table, positions = params[0][: v * h].reshape(v, h), params[0][v * h :].reshape(seq, h)
    final, head = params[layers + 1], params[layers + 2][: v * h].reshape(v, h)
    position = np.arange(ids.size) % seq
    x = table[ids] + positions[position]
    saved = []
    for flat in params[1 : layers + 1]:
        x, cache = block_forward(x, flat, net)
        saved.append(cache)
    n, ln = layer_norm(x, final[:h], final[h:], net.norm_eps)
    loss, dlogits = cross_entropy(n @ head.T, targets)
    d_head = np.zeros_like(params[layers + 2])
    d_head[: v * h] = (dlogits.T @ n).ravel()
    dx, dgf, dcf = layer_norm_backward(dlogits @ head, final[:h], ln)
    block_grads = []
    for flat, cache in zip(reversed(params[1 : layers + 1]), reversed(saved), strict=True):
        dx, grad = block_backward(dx, flat, cache, net)
        block_grads.append(grad)
    d_table, d_positions = np.zeros((v, h), dtype=_wide(dx).dtype), np.zeros((seq, h), dtype=_wide(dx).dtype)
    np.add.at(d_table, ids, dx)  # a token (a position) used by several rows sums their gradients
    np.add.at(d_positions, position, dx)
    embed = np.concatenate([d_table.ravel(), d_positions.ravel()])
    return loss, [embed, *reversed(block_grads), np.concatenate([dgf, dcf]), d_head]


def reference_train(net: NetFields, source=None) -> tuple[list[float], list[np.ndarray]]:
    """Every step on one device: forward, backward, global-norm clipping, the optimizer on the master weights;
    (loss per step, final master units). The batches are `source`'s (a prepared corpus) or the net's tokens."""
    policy = net.policy
    master = [initial_unit(net, u).astype(policy.state) for u in range(len(unit_kinds(net)))]
    trained = trained_units(net)
    state = {u: [np.zeros_like(master[u]) for _ in range(2 if net.optimizer == "adamw" else 1)] for u in trained}
    losses = []
    for step in range(1, net.steps + 1):
        ids, targets = step_batch(net, source, step - 1)
        loss, grads = loss_and_grads(net, master, ids, targets, dtype=policy.compute)
        applied = [g.astype(policy.reduce) for g in combined_grads(net, grads)]
        scale = clip_scale(net, global_norm(applied))
        losses.append(loss)
        for u, grad in zip(trained, applied, strict=True):
            grad = grad * np.asarray(scale, dtype=grad.dtype) if scale < 1 else grad
            if net.optimizer == "adamw":
                adamw_reference(master[u], grad, state[u][0], state[u][1], step, net.adamw_at(step))
            else:
                state[u][0][...] = net.momentum * state[u][0] + net.rate_at(step) * grad
                master[u] -= state[u][0]
        if net.tie_embeddings:
            master[-1] = master[0].copy()
    return losses, master
