"""Why integer mode is bitwise on every mesh, for any number of steps: a proof run before the ranks start.

Every float is a dyadic rational n / 2^k. A sum of such values is computed exactly, in any order, if each
partial sum's numerator over the largest denominator fits the mantissa: |partial sum| 2^k < 2^(mantissa + 1).
The pass follows the single-device step on magnitudes (|X|, |W|, relu as the identity: every sum then has
non-negative terms, so its final value bounds each partial sum) beside the real values, each array with
the largest denominator exponent k of its elements; products add exponents, sums take the larger. Step s's
real weights come from the pass itself (exact, by the check of the steps before). With integer data and
weights the first step is exact at modest sizes; beyond it both the magnitudes (each layer multiplies the
stream by up to 1 + 4 h f) and the denominators (a power-of-two --lr adds its exponent at every factor)
grow, so several exact steps exist only at toy sizes (e.g. --layers 3 --hidden 2 --ffn 2 --batch 4 --seq 1
--lr 0.25 --steps 2): the pass finds them and refuses the rest, naming the step and the operation.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def denominator_bits(a) -> int:
    """The largest k such that an element of `a` is an odd multiple of 2^-k (0 for integers)."""
    values = np.asarray(a, dtype=np.float64).ravel()
    values = values[values != 0]
    if values.size == 0:
        return 0
    if not np.isfinite(values).all():  # overflowed: no exact numerator (the bound becomes infinite)
        return 10**6
    mantissa, exponent = np.frexp(values)  # value = mantissa 2^exponent, 0.5 <= |mantissa| < 1
    whole = np.abs(mantissa * 2.0**53).astype(np.int64)  # an exact 53-bit integer: value = whole 2^(exponent-53)
    trailing = np.log2(whole & -whole).astype(np.int64)
    return int(max(0, np.max(53 - exponent - trailing)))


@dataclass
class Tracked:
    """Real values, an upper bound of their magnitudes, and their largest denominator exponent."""

    value: np.ndarray
    magnitude: np.ndarray
    bits: int

    @classmethod
    def of(cls, value) -> Tracked:
        value = np.asarray(value, dtype=np.float64)
        return cls(value, np.abs(value), denominator_bits(value))


class Proof:
    """Records the largest scaled partial sum (magnitude x 2^bits) any operation reached, and where."""

    def __init__(self):
        self.worst, self.where = 0.0, ""

    def note(self, magnitude: np.ndarray, bits: int, where: str) -> None:
        scaled = float(magnitude.max(initial=0)) * 2.0 ** min(bits, 2000)
        if not scaled <= self.worst:  # NaN (an overflowed magnitude) counts as the worst
            self.worst, self.where = scaled, where

    def matmul(self, a: Tracked, b: Tracked, where: str) -> Tracked:
        out = Tracked(a.value @ b.value, a.magnitude @ b.magnitude, a.bits + b.bits)
        self.note(out.magnitude, out.bits, where)
        return out

    def multiply(self, a: Tracked, b: Tracked, where: str) -> Tracked:
        out = Tracked(a.value * b.value, a.magnitude * b.magnitude, a.bits + b.bits)
        self.note(out.magnitude, out.bits, where)
        return out

    def add(self, a: Tracked, b: Tracked, where: str, sign: float = 1.0) -> Tracked:
        out = Tracked(a.value + sign * b.value, a.magnitude + b.magnitude, max(a.bits, b.bits))
        self.note(out.magnitude, out.bits, where)
        return out

    def sum_rows(self, a: Tracked, where: str) -> Tracked:
        out = Tracked(a.value.sum(axis=0), a.magnitude.sum(axis=0), a.bits)
        self.note(out.magnitude, out.bits, where)
        return out


def transpose(a: Tracked) -> Tracked:
    return Tracked(a.value.T, a.magnitude.T, a.bits)


def relu(a: Tracked) -> Tracked:
    return Tracked(np.maximum(a.value, 0), a.magnitude, a.bits)


def exactness_bound(mlp, layer_views) -> tuple[float, str]:
    """(the largest scaled partial sum of every step of `mlp`'s single-device run, where it is reached), with
    `layer_views` its layers' (W1, W2, g) (passed in: this proof does not import the workload it checks). The
    last update is left out: every strategy applies it elementwise in the same order, rounding or not."""
    with np.errstate(all="ignore"):  # an overflow is an infinite bound, refused by the caller
        return _bound(mlp, layer_views)


def _bound(mlp, layer_views) -> tuple[float, str]:
    proof = Proof()
    h, f = mlp.hidden, mlp.ffn
    layers = [Tracked.of(mlp.initial_layer(i)) for i in range(mlp.layers)]
    velocity = [Tracked.of(np.zeros(mlp.layer_size)) for _ in range(mlp.layers)]
    lr, momentum = Tracked.of(mlp.rate), Tracked.of(mlp.momentum)
    for step in range(mlp.steps):
        x, target = (Tracked.of(a) for a in mlp.batch_data(step))
        views = [[Tracked.of(v) for v in layer_views(p.value, h, f)] for p in layers]
        saved = []
        for i, (w1, w2, g) in enumerate(views):
            at = f"step {step + 1}, layer {i} forward"
            xn = proof.multiply(x, g, at)
            a = proof.matmul(xn, w1, at)
            saved.append((x, xn, a))
            x = proof.add(x, proof.matmul(relu(a), w2, at), at)
        d = proof.add(x, target, f"step {step + 1}, the loss", sign=-1.0)
        proof.sum_rows(proof.multiply(d, d, f"step {step + 1}, the loss"), f"step {step + 1}, the loss")
        grads: list[Tracked] = []
        for i in reversed(range(mlp.layers)):
            w1, w2, g = views[i]
            x_in, xn, a = saved[i]
            at = f"step {step + 1}, layer {i} backward"
            dz = proof.matmul(d, transpose(w2), at)
            dz = Tracked(dz.value * (a.value > 0), dz.magnitude, dz.bits)
            dxn = proof.matmul(dz, transpose(w1), at)
            parts = [
                proof.matmul(transpose(xn), dz, at),
                proof.matmul(transpose(relu(a)), d, at),
                proof.sum_rows(proof.multiply(x_in, dxn, at), at),
            ]
            grads.insert(
                0,
                Tracked(
                    np.concatenate([p.value.ravel() for p in parts]),
                    np.concatenate([p.magnitude.ravel() for p in parts]),
                    max(p.bits for p in parts),
                ),
            )
            d = proof.add(d, proof.multiply(dxn, g, at), at)
        if step + 1 == mlp.steps:
            break
        at = f"step {step + 1}, the update"
        for i in range(mlp.layers):
            velocity[i] = proof.add(proof.multiply(velocity[i], momentum, at), proof.multiply(grads[i], lr, at), at)
            layers[i] = Tracked.of(proof.add(layers[i], velocity[i], at, sign=-1.0).value)
            velocity[i] = Tracked.of(velocity[i].value)
    return proof.worst, proof.where
