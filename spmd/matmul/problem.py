"""The matmul workload: C = A @ B. Its shape record, flop count and result check.

Strategies for it live in spmd/matmul (dp.py, fsdp.py); their byte and
memory closed forms use this record.
"""

from dataclasses import dataclass

import numpy as np

from spmd.layout import block_size


@dataclass(frozen=True)
class Problem:
    """C = A @ B: A (m x k), B (k x n), `itemsize` bytes an element."""

    m: int
    k: int
    n: int
    itemsize: int

    def rows(self, parts: int, index: int) -> int:
        """Rows of A and C that block `index` of `parts` owns (np.array_split)."""
        return block_size(self.m, parts, index)

    def cols(self, parts: int, index: int) -> int:
        """Columns of B and C that block `index` of `parts` owns."""
        return block_size(self.n, parts, index)


def flops(m: int, k: int, n: int, dtype: np.dtype) -> float:
    """Real floating-point operations of an (m x k) @ (k x n) product."""
    return 2.0 * m * k * n * (4 if dtype.kind == "c" else 1)


def first_nonfinite(name: str, array: np.ndarray) -> str | None:
    """'A has nan at row 3, column 4', or None if every value of `array` is finite (integers always are)."""
    if array.dtype.kind not in "fc":
        return None
    bad = np.argwhere(~np.isfinite(array))
    if not len(bad):
        return None
    row, col = bad[0]
    return f"{name} has {array[row, col]} at row {row}, column {col} ({len(bad)} non-finite values in all)"


def check_product(c: np.ndarray, a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """(max abs error of c against a @ b, the tolerance it must meet).

    Integers must match exactly. For floats the tolerance is the worst-case
    rounding bound of a length-k dot product, 2 k eps max|a| max|b|, paid by
    both c and the reference, so any real mistake (a wrong or missing block) exceeds it.
    """
    expected = a @ b
    if c.shape != expected.shape or c.dtype != expected.dtype:
        return float("inf"), 0.0
    if c.dtype.kind in "biu":  # compared in float64: no wrap-around, no bool arithmetic
        c, expected = c.astype(np.float64), expected.astype(np.float64)
        return float(np.max(np.abs(c - expected), initial=0.0)), 0.0
    error = float(np.max(np.abs(c - expected), initial=0.0))
    bound = np.max(np.abs(a), initial=0.0) * np.max(np.abs(b), initial=0.0)
    return error, float(4 * a.shape[1] * np.finfo(c.dtype).eps * bound)
