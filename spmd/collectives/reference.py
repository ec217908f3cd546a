"""What each collective must give every rank, computed from the list of all ranks' inputs.

Tests compare each real collective with its reference on both backends.
"""

import numpy as np

from spmd.collectives.rooted import tree_parent
from spmd.layout import block_range


def ring_allgather_ref(blocks: list) -> list:
    """For each rank, the (owner, block) pairs `ring_allgather` yields, in order."""
    size = len(blocks)
    return [[((rank - s) % size, blocks[(rank - s) % size]) for s in range(size)] for rank in range(size)]


def all_gather_ref(blocks: list) -> list:
    """For each rank, every block stacked along axis 0."""
    return [np.concatenate(blocks, axis=0) for _ in blocks]


def gather_ref(blocks: list, root: int = 0) -> list:
    """For each rank, what `gather` returns there."""
    return [list(blocks) if rank == root else None for rank in range(len(blocks))]


def reduce_scatter_ref(arrays: list) -> list:
    """For each rank r, chunk r (np.array_split along axis 0) of the sum, in the ring's order.

    The ring sums chunk c starting from rank c + 1's part and ending with rank
    c's own; floating-point sums depend on that order, so the reference keeps it.
    """
    size = len(arrays)
    out = []
    for c in range(size):
        rows = slice(*block_range(arrays[0].shape[0], size, c))
        total = arrays[(c + 1) % size][rows].copy()
        for j in range(2, size + 1):
            total = total + arrays[(c + j) % size][rows]
        out.append(total)
    return out


def all_reduce_ref(arrays: list) -> list:
    """For each rank, the sum of all arrays, chunk by chunk in the ring's order (the same on every rank)."""
    flat = [np.asarray(a, order="C").reshape(-1) for a in arrays]
    total = np.concatenate(reduce_scatter_ref(flat)).reshape(arrays[0].shape)
    return [total for _ in arrays]


def broadcast_ref(array: np.ndarray, size: int) -> list:
    """For each rank, the root's array."""
    return [array for _ in range(size)]


def broadcast_parents_ref(size: int, root: int = 0) -> list:
    """Each rank's parent in the broadcast tree (None at the root)."""
    return [tree_parent(r, size, root) for r in range(size)]


def all_to_all_ref(blocks_by_rank: list) -> list:
    """For each rank r, the block every rank q addressed to r, in source order."""
    size = len(blocks_by_rank)
    return [[blocks_by_rank[q][r] for q in range(size)] for r in range(size)]


def ring_shift_ref(blocks: list) -> list:
    """For each rank r, the block of rank r - 1 (around the ring)."""
    return [blocks[(r - 1) % len(blocks)] for r in range(len(blocks))]
