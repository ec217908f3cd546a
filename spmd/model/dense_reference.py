"""The MLP's and the transformer's training steps on one device, written for reading, not speed: the oracle every
parallel run of them is compared with. It shares nothing with the blocks' code but the weights' layout."""

from __future__ import annotations

import numpy as np

from spmd.model.fields import NetFields
from spmd.model.optimizers import STATE, adamw_reference


def causal_softmax(scores: np.ndarray) -> np.ndarray:
    """Softmax over the last axis with every key after its query masked out."""
    s = scores.shape[-1]
    masked = np.where(np.tril(np.ones((s, s), dtype=bool)), scores, -np.inf)
    e = np.exp(masked - masked.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def mlp_forward(x, w1, w2, g):
    a = (x * g) @ w1
    return x + np.maximum(a, 0) @ w2, a


def mlp_backward(d, x, a, w1, w2, g):
    """(d of the input, [dW1, dW2, dg]) from d of the output."""
    dz = (d @ w2.T) * (a > 0)
    dxn = dz @ w1.T
    grads = [(x * g).T @ dz, np.maximum(a, 0).T @ d, (x * dxn).sum(axis=0)]
    return d + dxn * g, grads


def attention_forward(x, g1, wq, wk, wv, wo, net: NetFields):
    b, s, a, dh = net.batch_of(x), net.seq, net.heads, net.head_size
    z = x * g1
    q, k, v = ((z @ w).reshape(b, s, a, dh).transpose(0, 2, 1, 3) for w in (wq, wk, wv))
    p = causal_softmax(q @ k.transpose(0, 1, 3, 2) / np.sqrt(dh))
    o = (p @ v).transpose(0, 2, 1, 3).reshape(b * s, a * dh)
    return x + o @ wo, (z, q, k, v, p, o)


def attention_backward(d, x, saved, g1, wq, wk, wv, wo, net: NetFields):
    z, q, k, v, p, o = saved
    b, s, a, dh = net.batch_of(x), net.seq, net.heads, net.head_size
    d_wo = o.T @ d
    do = (d @ wo.T).reshape(b, s, a, dh).transpose(0, 2, 1, 3)
    dp = do @ v.transpose(0, 1, 3, 2)
    dv = p.transpose(0, 1, 3, 2) @ do
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True)) / np.sqrt(dh)
    dq, dk = ds @ k, ds.transpose(0, 1, 3, 2) @ q
    flat = [t.transpose(0, 2, 1, 3).reshape(b * s, a * dh) for t in (dq, dk, dv)]
    d_w = [z.T @ t for t in flat]
    dz = sum(t @ w.T for t, w in zip(flat, (wq, wk, wv), strict=True))
    return d + dz * g1, [(x * dz).sum(axis=0), *d_w, d_wo]


def dense_train(net: NetFields, spec) -> tuple[list[float], list[np.ndarray]]:
    """The MLP's and the transformer's steps on one device. The run's optimizer on its precision policy: under
    mixed precision the weights and data are cast to the compute dtype each step (numpy then computes as it
    promotes: a 16-bit matmul returns float32), the gradients to the reduction dtype, and the optimizer steps
    fp32 master weights, which are returned."""
    policy = net.policy
    master = [spec.initial_unit(net, i).astype(policy.state) for i in range(net.layers)]
    state = [[np.zeros_like(p) for _ in STATE[net.optimizer]] for p in master]
    losses = []
    for step in range(net.steps):
        x, target = (a.astype(policy.compute) for a in spec.batch_data(net, step))
        layers = [p.astype(policy.compute) if policy.mixed else p for p in master]
        saved: list[tuple] = []
        for p in layers:
            x, kept = layer_forward(net, spec.has_attention, p, x)
            saved.append(kept)
        d = x - target
        wide = d.astype(np.float64) if policy.mixed else d
        losses.append(0.5 * float(np.sum(wide * wide)))
        grads: list[np.ndarray] = [np.empty(0)] * net.layers
        for i in reversed(range(net.layers)):
            d, grads[i] = layer_backward(net, spec.has_attention, layers[i], d, saved[i])
        grads = clipped(net, [g.astype(policy.reduce) if policy.mixed else g for g in grads])
        for p, moments, grad in zip(master, state, grads, strict=True):
            if net.optimizer == "adamw":
                adamw_reference(p, grad, moments[0], moments[1], step + 1, net.adamw_at(step + 1))
            else:
                v = moments[0]
                v[:] = net.momentum * v + net.rate_at(step + 1) * grad
                p -= v
    return losses, master


def mlp_views(flat: np.ndarray, h: int, f: int) -> tuple[np.ndarray, ...]:
    """(W1 (h, f), W2 (f, h), g (h,)) of an MLP layer's flat vector: written here, not read from the model."""
    return flat[: h * f].reshape(h, f), flat[h * f : 2 * h * f].reshape(f, h), flat[2 * h * f : 2 * h * f + h]


def transformer_views(flat: np.ndarray, h: int, f: int) -> tuple[np.ndarray, ...]:
    """(g1, Wq, Wk, Wv, Wo (h, h), W1, W2, g2) of a transformer layer's flat vector (its MLP part the MLP's)."""
    wq, wk, wv, wo = (flat[h + i * h * h : h + (i + 1) * h * h].reshape(h, h) for i in range(4))
    return (flat[:h], wq, wk, wv, wo, *mlp_views(flat[h + 4 * h * h :], h, f))


def layer_forward(net: NetFields, attention: bool, p: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, tuple]:
    """(a layer's output, what its backward needs): the MLP's, or attention then the MLP."""
    h, f = net.hidden, net.ffn
    if not attention:
        y, a = mlp_forward(x, *mlp_views(p, h, f))
        return y, (x, a)
    g1, wq, wk, wv, wo, w1, w2, g2 = transformer_views(p, h, f)
    hid, att = attention_forward(x, g1, wq, wk, wv, wo, net)
    y, a = mlp_forward(hid, w1, w2, g2)
    return y, (x, att, hid, a)


def layer_backward(
    net: NetFields, attention: bool, p: np.ndarray, d: np.ndarray, kept: tuple
) -> tuple[np.ndarray, np.ndarray]:
    """(d of the layer's input, its flat gradient) from d of its output."""
    h, f = net.hidden, net.ffn
    if not attention:
        x_in, a = kept
        d, (dw1, dw2, dg) = mlp_backward(d, x_in, a, *mlp_views(p, h, f))
        return d, np.concatenate([dw1.ravel(), dw2.ravel(), dg])
    g1, wq, wk, wv, wo, w1, w2, g2 = transformer_views(p, h, f)
    x_in, att, hid, a = kept
    d, (dw1, dw2, dg2) = mlp_backward(d, hid, a, w1, w2, g2)
    d, (dg1, dwq, dwk, dwv, dwo) = attention_backward(d, x_in, att, g1, wq, wk, wv, wo, net)
    return d, np.concatenate([dg1, dwq.ravel(), dwk.ravel(), dwv.ravel(), dwo.ravel(), dw1.ravel(), dw2.ravel(), dg2])


def clipped(net: NetFields, grads: list[np.ndarray]) -> list[np.ndarray]:
    """The gradients scaled to --clip-grad by the global norm over every layer (torch's clip_grad_norm_)."""
    if not net.clip_grad > 0:
        return grads
    norm = float(np.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in grads)))
    scale = min(1.0, net.clip_grad / (norm + 1e-6))
    return [g * np.asarray(scale, dtype=g.dtype) if scale < 1.0 else g for g in grads]
