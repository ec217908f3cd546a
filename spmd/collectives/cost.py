"""Exact payload bytes each collective sends and receives per rank, for uneven splits too.

Each function returns (bytes sent, bytes received) of one rank; tests assert
them equal to the measured Traffic. `counts` are the ranks' row counts,
`row_bytes` the bytes of one row; n = sum(counts).
"""

from collections.abc import Sequence

from spmd.collectives.rooted import tree_children, tree_parent
from spmd.layout import block_sizes


def all_gather_bytes(counts: Sequence[int], rank: int, row_bytes: int) -> tuple[int, int]:
    """Ring: sends all but its right neighbour's block, receives all but its own: (n - c[r+1], n - c[r])."""
    size, n = len(counts), sum(counts)
    if size == 1:
        return 0, 0
    return (n - counts[(rank + 1) % size]) * row_bytes, (n - counts[rank]) * row_bytes


def reduce_scatter_bytes(counts: Sequence[int], rank: int, row_bytes: int) -> tuple[int, int]:
    """Ring: sends every chunk but its own, receives every chunk but its left neighbour's: (n - c[r], n - c[r-1])."""
    size, n = len(counts), sum(counts)
    if size == 1:
        return 0, 0
    return (n - counts[rank]) * row_bytes, (n - counts[(rank - 1) % size]) * row_bytes


def all_reduce_bytes(elements: int, size: int, rank: int, itemsize: int) -> tuple[int, int]:
    """Reduce-scatter then all-gather of the flat array: 2 (D-1)/D n s each way for even chunks."""
    counts = block_sizes(elements, size)
    rs, ag = reduce_scatter_bytes(counts, rank, itemsize), all_gather_bytes(counts, rank, itemsize)
    return rs[0] + ag[0], rs[1] + ag[1]


def broadcast_bytes(nbytes: int, size: int, rank: int, root: int = 0) -> tuple[int, int]:
    """Binomial tree: one copy to each child, one from the parent; the tree sends (D-1) n in all."""
    received = 0 if tree_parent(rank, size, root) is None else nbytes
    return nbytes * len(tree_children(rank, size, root)), received


def all_to_all_bytes(block_bytes: list[list[int]], rank: int) -> tuple[int, int]:
    """Pairwise: block_bytes[q][r] is what rank q addresses to r; nothing to itself."""
    sent = sum(b for dst, b in enumerate(block_bytes[rank]) if dst != rank)
    received = sum(row[rank] for src, row in enumerate(block_bytes) if src != rank)
    return sent, received


def gather_bytes(block_bytes: list[int], rank: int, root: int = 0) -> tuple[int, int]:
    """Every non-root sends its block to the root once."""
    if rank != root:
        return block_bytes[rank], 0
    return 0, sum(b for src, b in enumerate(block_bytes) if src != root)


def ring_shift_bytes(block_bytes: list[int], rank: int) -> tuple[int, int]:
    """Each rank sends its block to rank + 1 and receives rank - 1's."""
    return block_bytes[rank], block_bytes[(rank - 1) % len(block_bytes)]
