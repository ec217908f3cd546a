"""The MLP's training steps on one device, written plainly: the tests' independent oracle (not collected).

Each of the L layers maps X (tokens, h) to Y = X + relu((X * g) W1) W2, a layer's flat vector [W1 (h, f),
W2 (f, h), g (h,)]; the loss 0.5 sum((Y_L - target)^2), a sum over tokens; SGD with momentum, v = mu v + lr grad,
W -= v. The initial layers and the batches are the run's own (net.initial_layer, net.batch_data); the steps are
written here, apart from the engine's kernels and from spmd.model.reference.
"""

import numpy as np


def views(flat: np.ndarray, hidden: int, ffn: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(W1 (h, f), W2 (f, h), g (h,)) as views of one layer's flat vector."""
    hf = hidden * ffn
    return flat[:hf].reshape(hidden, ffn), flat[hf : 2 * hf].reshape(ffn, hidden), flat[2 * hf :]


def reference_train(net) -> tuple[list[float], list[np.ndarray]]:
    """Every step of the MLP run `net` on one device: (loss per step, final flat layers)."""
    layers = [net.initial_layer(i) for i in range(net.layers)]
    velocity = [np.zeros_like(p) for p in layers]
    losses = []
    for step in range(net.steps):
        x, target = net.batch_data(step)
        saved = []
        for p in layers:
            w1, w2, g = views(p, net.hidden, net.ffn)
            a = (x * g) @ w1
            saved.append((x, a))
            x = x + np.maximum(a, 0) @ w2
        d = x - target
        losses.append(0.5 * float(np.sum(d * d)))
        grads: list[np.ndarray] = [np.empty(0)] * net.layers
        for i in reversed(range(net.layers)):
            w1, w2, g = views(layers[i], net.hidden, net.ffn)
            x_in, a = saved[i]
            dz = (d @ w2.T) * (a > 0)
            dxn = dz @ w1.T
            grads[i] = np.concatenate(
                [((x_in * g).T @ dz).ravel(), (np.maximum(a, 0).T @ d).ravel(), (x_in * dxn).sum(axis=0)]
            )
            d = d + dxn * g
        for p, v, grad in zip(layers, velocity, grads, strict=True):
            v[:] = net.momentum * v + net.rate * grad
            p -= v
    return losses, layers
