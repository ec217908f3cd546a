"""The MLP layer's forward, backward and optimizer step, written into preallocated arrays.

Every kernel writes with out=, so a step allocates nothing: a rank's peak memory
is exactly the arrays its Arena handed out, which the tests compare with each
strategy's closed form. A layer may be a tensor-parallel slice (ffn = its share of f).
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from spmd.model.precision import native
from spmd.stopwatch import matmul

MEMORY_KINDS = ("params", "master", "grads", "optimizer", "activations", "buffers")


class Arena:
    """Hands out a rank's arrays and counts their bytes by kind (MEMORY_KINDS), each kind in its dtype
    (one dtype for all, or a precision policy's per kind)."""

    def __init__(self, dtypes) -> None:
        self.dtypes = dtypes if isinstance(dtypes, dict) else {kind: np.dtype(dtypes) for kind in MEMORY_KINDS}
        self.bytes: Counter = Counter()

    def take(self, kind: str, shape, dtype=None) -> np.ndarray:
        """Zeros of `shape`, counted under `kind`, in the kind's dtype unless `dtype` is given."""
        if kind not in MEMORY_KINDS:
            raise ValueError(f"unknown memory kind {kind!r}; one of {', '.join(MEMORY_KINDS)}")
        array = np.zeros(shape, dtype=dtype or self.dtypes[kind])
        self.bytes[kind] += array.nbytes
        return array

    def by_kind(self) -> dict[str, int]:
        return {kind: self.bytes[kind] for kind in MEMORY_KINDS}


def scale(x: np.ndarray, g: np.ndarray, out: np.ndarray) -> None:
    """out = x * g, g per column; out must not be x. einsum, because np.multiply with a broadcast operand
    takes a 64 KiB ufunc buffer (measured with tracemalloc) the memory model would not see; einsum is
    also faster here, but copies an input that is also its output. einsum has no 16-bit floats: those
    broadcast (mixed precision's peak is not asserted: numpy's casts allocate too)."""
    if native(x.dtype):
        np.einsum("ij,j->ij", x, g, out=out)
    else:
        np.multiply(x, g, out=out)


def scale_rows(x: np.ndarray, r: np.ndarray, out: np.ndarray) -> None:
    """out = x * r, r per row (out must not be x: see scale)."""
    if native(x.dtype):
        np.einsum("ij,i->ij", x, r, out=out)
    else:
        np.multiply(x, r[:, None], out=out)


def row_dots(a: np.ndarray, b: np.ndarray, out: np.ndarray, tmp: np.ndarray) -> None:
    """out = the sum over the last axis of a * b: einsum's one pass (no temporary), or for 16-bit floats (which
    einsum lacks) and an `out` of another dtype a product in tmp, summed."""
    if native(a.dtype) and out.dtype == a.dtype:
        np.einsum("...j,...j->...", a, b, out=out)
    else:
        np.multiply(a, b, out=tmp)
        np.sum(tmp, axis=-1, out=out)


def row_sums(a: np.ndarray, out: np.ndarray) -> None:
    """out = the sum over the last axis of a: einsum's loop, 4x np.sum's over short rows; np.sum for 16-bit floats
    and an `out` of another dtype."""
    if native(a.dtype) and out.dtype == a.dtype:
        np.einsum("...j->...", a, out=out)
    else:
        np.sum(a, axis=-1, out=out)


def spread(column: np.ndarray, ones: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out[i, j] = column[i], `ones` a vector of ones at least as long as a row (see scale)."""
    if native(out.dtype):
        np.einsum("i,j->ij", column, ones[: out.shape[1]], out=out)
    else:
        np.copyto(out, column[:, None])
    return out


def forward(xn: np.ndarray, w1: np.ndarray, w2: np.ndarray, a: np.ndarray, z: np.ndarray, y: np.ndarray) -> None:
    """y = relu(xn @ w1) @ w2, keeping a = xn @ w1 for the backward pass."""
    matmul(xn, w1, out=a)
    np.maximum(a, 0, out=z)
    matmul(z, w2, out=y)


def backward(dy, xn, a, w1, w2, dw1, dw2, s, wg) -> None:
    """From dy (the gradient of y): dw1, dw2 (by wg: a WeightGrads), and the gradient of xn into s.dxn (partial
    under TP); s holds the scratch z and dz (rows, f) and dxn (rows, h)."""
    np.maximum(a, 0, out=s.z)
    wg.products(s.z, (dy, dw2))
    matmul(dy, w2.T, out=s.dz)
    relu_derivative(a, out=s.z)
    np.multiply(s.dz, s.z, out=s.dz)
    wg.products(xn, (s.dz, dw1))
    matmul(s.dz, w1.T, out=s.dxn)


def relu_derivative(a: np.ndarray, out: np.ndarray) -> None:
    """out = 1 where a > 0, else 0. float32/64: a comparison cast into `out` (through an 8 KiB buffer; 10x
    faster than heaviside, which has no vector loop: 14 of a layer's 84 ms backward, measured); other dtypes:
    heaviside (no boolean temporary)."""
    if native(out.dtype):
        np.greater(a, 0, out=out)
    else:
        np.heaviside(a, 0, out=out)


def gain_grad(x: np.ndarray, dxn: np.ndarray, dg: np.ndarray, tmp: np.ndarray) -> None:
    """dg = sum over tokens of x * dxn (tmp: an x-shaped scratch)."""
    np.multiply(x, dxn, out=tmp)
    np.sum(tmp, axis=0, out=dg)


def input_grad(dy: np.ndarray, dxn: np.ndarray, g: np.ndarray, tmp: np.ndarray) -> None:
    """dy becomes the gradient of the layer's input: dy + dxn * g (tmp: a dy-shaped scratch)."""
    scale(dxn, g, tmp)  # not in place: einsum copies an input that is also its output
    np.add(dy, tmp, out=dy)


def loss_grad(y: np.ndarray, target: np.ndarray) -> float:
    """y becomes y - target, the loss's gradient; returns the loss 0.5 |y - target|^2."""
    np.subtract(y, target, out=y)
    flat = y.reshape(-1)
    if not native(flat.dtype):  # a 16-bit dot would sum in 16 bits
        flat = flat.astype(np.float32)
    return 0.5 * float(np.dot(flat, flat))


def sgd(params: np.ndarray, grads: np.ndarray, velocity: np.ndarray, lr: float, momentum: float) -> None:
    """v = momentum v + lr grad; params -= v. In place (grads is scaled)."""
    np.multiply(grads, lr, out=grads)
    np.multiply(velocity, momentum, out=velocity)
    np.add(velocity, grads, out=velocity)
    np.subtract(params, velocity, out=params)
