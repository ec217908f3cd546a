"""The MLP training workload's record: shapes, seeded inputs (spmd.model.config.Net's MLP runs, through Net.as_mlp;
the tests' single-device oracle is tests/mlp_oracle.py).

Each of the L layers maps X (tokens, h) to Y = X + relu((X * g) W1) W2, with
W1 (h, f), W2 (f, h) and a per-channel gain g (h,), which stands in for a
LayerNorm's weight: replicated under tensor parallelism, so its gradient is
the one sequence parallelism must all-reduce. Loss: 0.5 sum((Y_L - target)^2),
a sum over tokens, so a data-parallel step sums gradients (no averaging).
Optimizer: SGD with momentum, velocity v = mu v + lr grad, then W -= v.

A layer's parameters live in one flat vector [W1 (row-major), W2, g], the
unit FSDP/ZeRO shard, gather and reduce.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from spmd.workloads.exact import exactness_bound

DTYPES = ("float64", "float32")


@dataclass(frozen=True)
class MLP:
    """One training run's shapes and hyper-parameters.

    Attributes:
        layers, hidden, ffn: L, h and f.
        tokens: rows of X per step (batch x sequence), split by data/sequence/pipeline parallelism.
        microbatches: how many pieces a pipeline streams the tokens in (1 for the other strategies).
        chunks: model chunks per pipeline rank (v: interleaved schedules; 1 for the others).
        steps: optimizer steps.
        dtype: float64 or float32.
        lr, momentum: SGD's learning rate (default 0.2 / (tokens x hidden): the loss is a sum) and momentum.
        integers: small integer inputs and weights (with lr, momentum powers of two, results are exact).
        seed: of the inputs and initial weights.
    """

    layers: int = 4
    hidden: int = 64
    ffn: int = 256
    tokens: int = 64
    microbatches: int = 1
    chunks: int = 1
    steps: int = 2
    dtype: str = "float64"
    lr: float | None = None
    momentum: float = 0.5
    integers: bool = False
    seed: int = 0

    def __post_init__(self):
        for name in ("layers", "hidden", "ffn", "tokens", "microbatches", "chunks", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.lr is None:
            object.__setattr__(self, "lr", 0.2 / (self.tokens * self.hidden))
        if not (np.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"--lr must be a finite number > 0, got {self.lr}")
        if not (0 <= self.momentum < 1):
            raise ValueError(f"--momentum must be in [0, 1), got {self.momentum}")
        if self.seed < 0:
            raise ValueError(f"--seed must be >= 0, got {self.seed}")
        if self.integers:
            self.check_exact()

    def check_exact(self) -> None:
        """Integer mode promises bitwise steps on every mesh: refuse, before the run, where a sum could round
        (spmd/workloads/exact.py proves it: every partial sum's numerator fits the mantissa)."""
        limit = 2.0 ** (np.finfo(self.dtype).nmant + 1)
        bound, where = exactness_bound(self, layer_views)
        if bound >= limit:
            raise ValueError(
                f"--integers at these sizes is not exact: a partial sum's numerator reaches {bound:.3g} >= 2^"
                f"{np.finfo(self.dtype).nmant + 1} ({self.dtype}'s exact integers) at {where}; use fewer --steps "
                f"or --layers, a smaller --hidden/--ffn (e.g. --layers 2 --hidden 16 --ffn 32), and a power-of-two "
                f"--lr (e.g. 0.015625) beyond one step"
            )

    @property
    def rate(self) -> float:
        """The learning rate (lr, its default filled in)."""
        assert self.lr is not None
        return self.lr

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    @property
    def layer_size(self) -> int:
        """Elements of one layer's flat parameter vector: 2 h f + h."""
        return layer_size(self.hidden, self.ffn)

    def initial_layer(self, layer: int) -> np.ndarray:
        """Layer `layer`'s flat parameters at step 0, the same on every rank and for every strategy."""
        rng = np.random.default_rng((self.seed, 1, layer))
        h, f = self.hidden, self.ffn
        if self.integers:
            flat = rng.integers(-1, 2, self.layer_size).astype(self.dtype)
            flat[2 * h * f :] = rng.integers(1, 3, h)
            return flat
        flat = np.empty(self.layer_size, dtype=self.dtype)
        flat[: h * f] = rng.standard_normal(h * f) / np.sqrt(h)
        flat[h * f : 2 * h * f] = rng.standard_normal(h * f) / np.sqrt(2 * f * self.layers)  # a stable residual stream
        flat[2 * h * f :] = 1 + 0.1 * rng.standard_normal(h)
        return flat

    def batch_data(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """The same as batch(step): the name every model's config answers to."""
        return self.batch(step)

    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(X, target) of step `step`, each (tokens, hidden)."""
        rng = np.random.default_rng((self.seed, 2, step))
        shape = (self.tokens, self.hidden)
        if self.integers:
            return rng.integers(-2, 3, shape).astype(self.dtype), rng.integers(-2, 3, shape).astype(self.dtype)
        return rng.standard_normal(shape).astype(self.dtype), rng.standard_normal(shape).astype(self.dtype)


def layer_size(hidden: int, ffn: int) -> int:
    return 2 * hidden * ffn + hidden


def layer_views(flat: np.ndarray, hidden: int, ffn: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(W1 (h, f), W2 (f, h), g (h,)) as views of one layer's flat vector."""
    hf = hidden * ffn
    return flat[:hf].reshape(hidden, ffn), flat[hf : 2 * hf].reshape(ffn, hidden), flat[2 * hf :]
