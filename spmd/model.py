"""Closed-form communication and memory of each strategy, exact for uneven splits.

For D ranks, A (M x K), B (K x N), element size s bytes; rows(r) and cols(r)
are rank r's share of M and N as np.array_split gives it. Every figure here
is checked against the measured Traffic in the tests.
"""

from dataclasses import dataclass

from spmd.layout import block_size


@dataclass(frozen=True)
class Problem:
    """C = A @ B on `ranks` ranks: A (m x k), B (k x n), `itemsize` bytes an element."""

    m: int
    k: int
    n: int
    ranks: int
    itemsize: int

    def rows(self, rank: int) -> int:
        return block_size(self.m, self.ranks, rank)

    def cols(self, rank: int) -> int:
        return block_size(self.n, self.ranks, rank)


def gather_bytes_sent(p: Problem, rank: int, root: int = 0) -> int:
    """C rows a rank sends to the root: rows(r) N s, none from the root itself."""
    return 0 if rank == root else p.rows(rank) * p.n * p.itemsize


def gather_bytes_received(p: Problem, rank: int, root: int = 0) -> int:
    """C rows the root receives: (M - rows(root)) N s."""
    return (p.m - p.rows(root)) * p.n * p.itemsize if rank == root else 0


def fsdp_ring_bytes_sent(p: Problem, rank: int) -> int:
    """B shards rank r passes right: all but its right neighbour's, K (N - cols(r+1)) s.

    (D-1)/D K N s for even splits.
    """
    if p.ranks == 1:
        return 0
    return p.k * (p.n - p.cols((rank + 1) % p.ranks)) * p.itemsize


def fsdp_ring_bytes_received(p: Problem, rank: int) -> int:
    """B shards rank r receives: every one but its own, K (N - cols(r)) s."""
    return p.k * (p.n - p.cols(rank)) * p.itemsize if p.ranks > 1 else 0


def bytes_sent(strategy: str, p: Problem, rank: int) -> int:
    """All payload bytes rank `rank` sends in one multiply of `strategy` ("dp" or "fsdp").

    DP sends no B: every rank makes or reads its own copy, so only C's rows move.
    """
    ring = fsdp_ring_bytes_sent(p, rank) if strategy == "fsdp" else 0
    return ring + gather_bytes_sent(p, rank)


def bytes_received(strategy: str, p: Problem, rank: int) -> int:
    """All payload bytes rank `rank` receives in one multiply of `strategy`."""
    ring = fsdp_ring_bytes_received(p, rank) if strategy == "fsdp" else 0
    return ring + gather_bytes_received(p, rank)


def b_bytes_held(strategy: str, p: Problem, rank: int) -> int:
    """Peak bytes of B a rank holds: DP all of B; FSDP its shard plus the ring's buffers.

    The ring's buffers (the shard in use and the one arriving) are each as
    large as the widest shard: two of them, one when D = 2, none when D = 1.
    So FSDP holds about 3/D of DP's B (2/D at D = 2).
    """
    if strategy == "dp":
        return p.k * p.n * p.itemsize
    widest = max(p.cols(r) for r in range(p.ranks))
    buffers = min(2, p.ranks - 1) * p.k * widest
    return (p.k * p.cols(rank) + buffers) * p.itemsize


def peak_bytes_held(strategy: str, p: Problem, rank: int, root: int = 0) -> int:
    """Peak bytes of array blocks a rank holds: its A rows, its B (above), its C rows (all of C at the root)."""
    c_rows = p.m if rank == root else p.rows(rank)
    return (p.rows(rank) * p.k + c_rows * p.n) * p.itemsize + b_bytes_held(strategy, p, rank)
