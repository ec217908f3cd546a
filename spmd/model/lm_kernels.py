"""The language model's kernels, written with out= into a rank's arrays: RMSNorm, RoPE, SiLU.

RMSNorm: r = (mean_j x_j^2 + eps)^(-1/2) per row, y = g * x * r; its row statistic r is kept in the state
dtype (fp32 under mixed precision). Backward: dg = sum over rows of dy * xhat, dx = r (dy g - xhat mean_j(dy g
xhat)). The mean is over the hidden dimension, which no axis splits: no collective.
RoPE, the half-split ("rotate_half", Megatron's default and Hugging Face's) pairing: channel i of a head turns
with channel i + d/2 by the angle position x base^(-2i/d). Backward turns by minus the angle.
"""

from __future__ import annotations

import numpy as np

from spmd.model import kernels
from spmd.model.precision import native
from spmd.split import by_rows


def rms_norm(x, g, eps: float, r, out, tmp) -> None:
    """out = g * x * r, r (rows,) = 1/sqrt(mean(x^2) + eps) kept; tmp an x-shaped scratch."""
    kernels.row_dots(x, x, r, tmp)
    np.divide(r, x.shape[1], out=r)  # the mean
    np.add(r, eps, out=r)
    np.sqrt(r, out=r)
    np.reciprocal(r, out=r)
    normed(x, g, r, out, tmp)


def normed(x, g, r, out, tmp) -> None:
    """out = g * x * r with r kept (the forward again, for a backward that needs its output): one einsum pass of
    x r g (the bits of x r, then times g; 0.7x the time of two), two passes through tmp for 16-bit floats."""
    rr = r.astype(x.dtype, copy=False)
    if native(x.dtype) and g.dtype == x.dtype:
        np.einsum("ij,i,j->ij", x, rr, g, out=out)
    else:
        kernels.scale_rows(x, rr, tmp)
        kernels.scale(tmp, g, out)


def rms_norm_backward(x, g, r, dy, dx, dg, c, tmp, tmp2) -> None:
    """dx = r (dy g - xhat mean(dy g xhat)); dg = sum over rows of dy xhat. dx, tmp, tmp2 (x-shaped, distinct
    from x and dy) and c (rows,) are scratch."""
    rr = r.astype(x.dtype, copy=False)
    kernels.scale_rows(x, rr, tmp)  # xhat
    np.multiply(dy, tmp, out=tmp2)
    np.sum(tmp2, axis=0, out=dg)
    kernels.scale(dy, g, tmp2)  # dy g
    kernels.row_dots(tmp2, tmp, c, dx)
    np.divide(c, x.shape[1], out=c)  # mean(dy g xhat)
    kernels.scale_rows(tmp, c, dx)  # xhat mean(dy g xhat)
    np.subtract(tmp2, dx, out=tmp2)
    kernels.scale_rows(tmp2, rr, dx)


def rope_tables(positions, theta, cos, sin) -> None:
    """cos, sin (rows, heads x d) for each row's position: channel i and i + d/2 of every head at angle position x
    theta_i (theta (d/2,)); sin signed for the half-split pairing, -sin on the first half, +sin on the second.
    The sines and cosines are taken for one head and copied to the others (every head turns alike)."""
    rows, width = cos.shape
    half = theta.size
    c, s = (a.reshape(rows, width // (2 * half), 2, half) for a in (cos, sin))
    angle = c[:, 0, 1]
    np.multiply(positions[:, None], theta[None, :], out=angle)
    np.sin(angle, out=s[:, 0, 1])
    np.negative(s[:, 0, 1], out=s[:, 0, 0])
    np.cos(angle, out=angle)
    np.copyto(c[:, 0, 0], angle)
    for table in (c, s):
        np.copyto(table[:, 1:], table[:, :1])


def rope(u, half: int, cos, sin, t, inverse: bool = False) -> None:
    """Turn each head (d = 2 half channels) of u (rows, heads x d) in place by its rows' angles (by minus them
    if `inverse`): u cos + swap(u) sin, swap exchanging each head's halves, with rope_tables' signed sin. cos,
    sin, t (rows, >= u's width): their first columns are used."""
    rows, width = u.shape
    c, s, tt = cos[:, :width], sin[:, :width], t[:, :width]
    swapped = u.reshape(rows, -1, 2, half)[:, :, ::-1, :]
    np.multiply(swapped, s.reshape(rows, -1, 2, half), out=tt.reshape(rows, -1, 2, half))
    np.multiply(u, c, out=u)
    (np.subtract if inverse else np.add)(u, tt, out=u)


@by_rows("z", "out")
def silu(z, out) -> None:
    """out = z sigmoid(z)."""
    np.negative(z, out=out)
    np.exp(out, out=out)
    np.add(out, 1, out=out)
    np.divide(z, out, out=out)


GELU_C = np.sqrt(2 / np.pi)  # GELU's tanh approximation: 0.5 z (1 + tanh(c (z + 0.044715 z^3)))


@by_rows("z", "out")
def gelu(z, out) -> None:
    """out = 0.5 z (1 + tanh(c (z + 0.044715 z^3))) (Grok-1's experts: jax.nn.gelu's default)."""
    np.multiply(z, z, out=out)
    np.multiply(out, 0.044715, out=out)
    np.add(out, 1, out=out)
    np.multiply(out, z, out=out)
    np.multiply(out, GELU_C, out=out)
    np.tanh(out, out=out)
    np.add(out, 1, out=out)
    np.multiply(out, z, out=out)
    np.multiply(out, 0.5, out=out)


@by_rows("z", "out", "tmp")
def gelu_grad(z, out, tmp) -> None:
    """out = gelu'(z) = 0.5 (1 + t) (1 + q (1 - t)), t = tanh(c (z + 0.044715 z^3)), q = c z (1 + 3 0.044715 z^2)
    (the derivative's 0.5 (1 + t) + 0.5 z (1 - t^2) c (1 + 3 0.044715 z^2), factored); tmp a z-shaped scratch."""
    np.multiply(z, z, out=tmp)
    np.multiply(tmp, 0.044715, out=out)
    np.add(out, 1, out=out)
    np.multiply(out, z, out=out)
    np.multiply(out, GELU_C, out=out)
    np.tanh(out, out=out)  # t
    np.multiply(tmp, 3 * 0.044715, out=tmp)
    np.add(tmp, 1, out=tmp)
    np.multiply(tmp, GELU_C, out=tmp)
    np.multiply(tmp, z, out=tmp)  # q
    np.subtract(1, out, out=out)  # 1 - t
    np.multiply(tmp, out, out=tmp)
    np.add(tmp, 1, out=tmp)  # 1 + q (1 - t)
    np.subtract(2, out, out=out)  # 1 + t
    np.multiply(out, tmp, out=out)
    np.multiply(out, 0.5, out=out)


@by_rows("z", "act", "keep")
def silu_parts(z, act, keep) -> None:
    """act = silu(z), keep = sigmoid(z): the backward's one exp (silu_grad_after takes its derivative from keep)."""
    np.negative(z, out=keep)
    np.exp(keep, out=keep)
    np.add(keep, 1, out=keep)
    np.reciprocal(keep, out=keep)
    np.multiply(z, keep, out=act)


def silu_grad_after(z, keep, out) -> None:
    """out = silu'(z) = s (1 + z (1 - s)), s = sigmoid(z) in keep (from silu_parts)."""
    np.subtract(1, keep, out=out)
    np.multiply(out, z, out=out)
    np.add(out, 1, out=out)
    np.multiply(out, keep, out=out)


def gelu_parts(z, act, keep) -> None:
    """act = gelu(z); keep unused (gelu_grad_after recomputes its tanh there): silu_parts' signature."""
    gelu(z, act)


def gelu_grad_after(z, keep, out) -> None:
    gelu_grad(z, out, keep)
