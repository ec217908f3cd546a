"""Optimizers as data: the state each keeps per parameter, and its step, in place with out=.

SGD with momentum (v = mu v + lr g; p -= v) keeps one array; AdamW (Loshchilov and Hutter 2019: Adam's
bias-corrected moments, weight decay decoupled from the gradient) keeps two and a scratch the size of
the part it updates. Both step `params` (the master copy under mixed precision) from `grad` (consumed).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

OPTIMIZERS = ("sgd", "adamw")
STATE = {"sgd": ("velocity",), "adamw": ("m", "v")}  # arrays per parameter, each the size of the part updated


@dataclass(frozen=True)
class AdamW:
    lr: float
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01

    def step(self, params, grad, m, v, tmp, t: int) -> None:
        """Step `t` (1-based): m, v updated; params -= lr (m^ / (sqrt(v^) + eps) + wd params)."""
        b1, b2 = self.beta1, self.beta2
        np.multiply(grad, grad, out=tmp)
        np.multiply(tmp, 1 - b2, out=tmp)
        np.multiply(v, b2, out=v)
        np.add(v, tmp, out=v)
        np.multiply(grad, 1 - b1, out=grad)
        np.multiply(m, b1, out=m)
        np.add(m, grad, out=m)
        np.multiply(v, 1 / (1 - b2**t), out=tmp)
        np.sqrt(tmp, out=tmp)
        np.add(tmp, self.eps, out=tmp)
        np.divide(m, tmp, out=tmp)
        np.multiply(tmp, self.lr / (1 - b1**t), out=tmp)
        np.multiply(params, 1 - self.lr * self.weight_decay, out=params)
        np.subtract(params, tmp, out=params)


def adamw_reference(params, grad, m, v, t: int, opt: AdamW) -> None:
    """The same step written plainly (the reference's; it allocates)."""
    m[...] = opt.beta1 * m + (1 - opt.beta1) * grad
    v[...] = opt.beta2 * v + (1 - opt.beta2) * grad * grad
    m_hat, v_hat = m / (1 - opt.beta1**t), v / (1 - opt.beta2**t)
    params[...] = params * (1 - opt.lr * opt.weight_decay) - opt.lr * m_hat / (np.sqrt(v_hat) + opt.eps)
