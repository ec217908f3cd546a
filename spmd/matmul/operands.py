"""Checking a caller's matrices and cutting them into read-only per-rank blocks."""

import numpy as np

from spmd.layout import block_range
from spmd.transport.comm import check_num_devices, is_numeric


def check_operands(a, b, num_devices) -> tuple[np.ndarray, np.ndarray]:
    """Return `a` and `b` as arrays after checking they can be multiplied on `num_devices`.

    Raises TypeError/ValueError naming the problem before any rank starts.
    """
    check_num_devices(num_devices)
    a, b = np.asarray(a), np.asarray(b)
    for name, m in (("a", a), ("b", b)):
        if m.ndim != 2:
            raise ValueError(f"{name} must be a 2-D matrix, got {m.ndim}-D shape {m.shape}")
        if not is_numeric(m.dtype):
            raise TypeError(f"{name} must hold numbers (bool, int, float, complex), got dtype {m.dtype}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(
            f"inner dimensions differ: a is {a.shape[0]}x{a.shape[1]} "
            f"but b is {b.shape[0]}x{b.shape[1]} (a's columns must equal b's rows)"
        )
    return a, b


def read_only(block: np.ndarray) -> np.ndarray:
    """A read-only view, so a rank cannot modify the caller's matrix through it."""
    view = block.view()
    view.flags.writeable = False
    return view


def row_blocks(m: np.ndarray, parts: int) -> list[np.ndarray]:
    """Read-only views of `m`'s row blocks, one per rank, split as np.array_split."""
    return [read_only(m[slice(*block_range(m.shape[0], parts, r))]) for r in range(parts)]


def column_blocks(m: np.ndarray, parts: int) -> list[np.ndarray]:
    """Read-only views of `m`'s column blocks, one per rank, split as np.array_split."""
    return [read_only(m[:, slice(*block_range(m.shape[1], parts, r))]) for r in range(parts)]
