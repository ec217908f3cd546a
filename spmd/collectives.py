"""Collectives written once on the Communicator's send/recv, each with a reference.

A reference (`*_ref`) computes from the list of every rank's block what the
collective must give each rank; tests compare the two on both backends.
Each collective has its own tag, so it never takes another protocol's messages.
"""

import numpy as np

from spmd.comm import ANY, CommError

RING_TAG = 1
GATHER_TAG = 2
BARRIER_TAG = 3


def ring_allgather(comm, rank: int, block: np.ndarray, tag: int = RING_TAG):
    """Yield (owner, block) for every rank's block, this rank's own first.

    Blocks rotate right around the ring: at step s this rank holds the block
    owned by rank (rank - s) mod D; before yielding it, it sends it on to
    rank + 1, so the transfer is in flight while the caller computes; then it
    receives the next one from rank - 1. Only one foreign block is held at a time.
    """
    size = comm.num_devices
    right, left = (rank + 1) % size, (rank - 1) % size
    held = block
    for step in range(size):
        last = step == size - 1
        if not last:
            comm.send(rank, right, held, tag=tag)
        yield (rank - step) % size, held
        if not last:
            _, held = comm.recv(rank, src=left, tag=tag)


def ring_allgather_ref(blocks: list) -> list:
    """For each rank, the (owner, block) pairs `ring_allgather` yields, in order."""
    size = len(blocks)
    return [[((rank - s) % size, blocks[(rank - s) % size]) for s in range(size)] for rank in range(size)]


def gather(comm, rank: int, block: np.ndarray, root: int = 0, tag: int = GATHER_TAG):
    """Collect every rank's block at `root`: the list in rank order there, None elsewhere.

    Non-root ranks send once; the root takes the blocks in whatever order they
    arrive and places each by its sender.
    """
    if rank != root:
        comm.send(rank, root, block, tag=tag)
        return None
    blocks = [None] * comm.num_devices
    blocks[root] = block
    for _ in range(comm.num_devices - 1):
        src, received = comm.recv(rank, src=ANY, tag=tag)
        if blocks[src] is not None:
            raise CommError(f"rank {root} got a second gather block from rank {src}")
        blocks[src] = received
    return blocks


def gather_ref(blocks: list, root: int = 0) -> list:
    """For each rank, what `gather` returns there."""
    return [list(blocks) if rank == root else None for rank in range(len(blocks))]


def gather_rows(comm, rank: int, rows: np.ndarray, root: int = 0, tag: int = GATHER_TAG):
    """Stack every rank's row block, in rank order, into one matrix at `root`.

    Every block must have the root's column count and dtype; a block that does
    not is an error naming its rank, never a silently reshaped result.
    """
    blocks = gather(comm, rank, rows, root=root, tag=tag)
    if blocks is None:
        return None
    for src, block in enumerate(blocks):
        if block.ndim != 2 or block.shape[1] != rows.shape[1] or block.dtype != rows.dtype:
            raise CommError(
                f"rank {root} expected a row block of {rows.shape[1]} columns of {rows.dtype} "
                f"from rank {src}, got shape {block.shape} of {block.dtype}"
            )
    return np.concatenate(blocks, axis=0)


def barrier(comm, rank: int, root: int = 0, tag: int = BARRIER_TAG) -> None:
    """Return on each rank only once every rank has called it."""
    token = np.empty(0, dtype=np.uint8)
    if gather(comm, rank, token, root=root, tag=tag) is not None:
        for dst in range(comm.num_devices):
            if dst != root:
                comm.send(root, dst, token, tag=tag)
    else:
        comm.recv(rank, src=root, tag=tag)
