"""A plain single-device training step of each model, written for reading, not speed: the oracle every
parallel run is compared with. It shares nothing with the blocks' code but the weights' layout."""

from __future__ import annotations

import numpy as np

from spmd.model.config import Net, mlp_views, transformer_views
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


def attention_forward(x, g1, wq, wk, wv, wo, net: Net):
    b, s, a, dh = net.batch_of(x), net.seq, net.heads, net.head_size
    z = x * g1
    q, k, v = ((z @ w).reshape(b, s, a, dh).transpose(0, 2, 1, 3) for w in (wq, wk, wv))
    p = causal_softmax(q @ k.transpose(0, 1, 3, 2) / np.sqrt(dh))
    o = (p @ v).transpose(0, 2, 1, 3).reshape(b * s, a * dh)
    return x + o @ wo, (z, q, k, v, p, o)


def attention_backward(d, x, saved, g1, wq, wk, wv, wo, net: Net):
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


def reference_train(net: Net, source=None) -> tuple[list[float], list[np.ndarray]]:
    """Every step on one device: (loss per step, final flat layers). The run's optimizer on its precision
    policy: under mixed precision the weights and data are cast to the compute dtype each step (numpy then
    computes as it promotes: a 16-bit matmul returns float32), the gradients to the reduction dtype, and
    the optimizer steps fp32 master weights, which are returned."""
    from spmd.model.registry import spec_of  # the registry imports the models, this among them

    own = spec_of(net).reference
    if own is not None:
        return own(net, source) if source is not None else own(net)
    policy = net.policy
    master = [net.initial_layer(i).astype(policy.state) for i in range(net.layers)]
    state = [[np.zeros_like(p) for _ in STATE[net.optimizer]] for p in master]
    losses = []
    h, f = net.hidden, net.ffn
    for step in range(net.steps):
        x, target = (a.astype(policy.compute) for a in net.batch_data(step))
        layers = [p.astype(policy.compute) if policy.mixed else p for p in master]
        saved: list[tuple] = []
        for p in layers:
            if net.model == "mlp":
                w1, w2, g = mlp_views(p, h, f)
                y, a = mlp_forward(x, w1, w2, g)
                saved.append((x, a))
            else:
                g1, wq, wk, wv, wo, w1, w2, g2 = transformer_views(p, h, f, h)
                hid, att = attention_forward(x, g1, wq, wk, wv, wo, net)
                y, a = mlp_forward(hid, w1, w2, g2)
                saved.append((x, att, hid, a))
            x = y
        d = x - target
        wide = d.astype(np.float64) if policy.mixed else d
        losses.append(0.5 * float(np.sum(wide * wide)))
        grads: list[np.ndarray] = [np.empty(0)] * net.layers
        for i in reversed(range(net.layers)):
            p = layers[i]
            if net.model == "mlp":
                w1, w2, g = mlp_views(p, h, f)
                x_in, a = saved[i]
                d, (dw1, dw2, dg) = mlp_backward(d, x_in, a, w1, w2, g)
                grads[i] = np.concatenate([dw1.ravel(), dw2.ravel(), dg])
            else:
                g1, wq, wk, wv, wo, w1, w2, g2 = transformer_views(p, h, f, h)
                x_in, att, hid, a = saved[i]
                d, (dw1, dw2, dg2) = mlp_backward(d, hid, a, w1, w2, g2)
                d, (dg1, dwq, dwk, dwv, dwo) = attention_backward(d, x_in, att, g1, wq, wk, wv, wo, net)
                grads[i] = np.concatenate(
                    [dg1, dwq.ravel(), dwk.ravel(), dwv.ravel(), dwo.ravel(), dw1.ravel(), dw2.ravel(), dg2]
                )
        grads = [g.astype(policy.reduce) if policy.mixed else g for g in grads]
        if net.clip_grad > 0:  # the global norm over every layer, torch's clip_grad_norm_
            norm = float(np.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in grads)))
            scale = min(1.0, net.clip_grad / (norm + 1e-6))
            grads = [g * np.asarray(scale, dtype=g.dtype) if scale < 1.0 else g for g in grads]
        for p, moments, grad in zip(master, state, grads, strict=True):
            if net.optimizer == "adamw":
                adamw_reference(p, grad, moments[0], moments[1], step + 1, net.adamw_at(step + 1))
            else:
                v = moments[0]
                v[:] = net.momentum * v + net.rate_at(step + 1) * grad
                p -= v
    return losses, master
