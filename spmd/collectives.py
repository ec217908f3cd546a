"""Collectives written once on the Communicator's send/recv, each with a reference.

A reference (`*_ref`) computes from the list of every rank's block what the
collective must give each rank; tests compare the two on both backends.
Each collective has its own tag, so it never takes another protocol's messages.
"""

import math

import numpy as np

from spmd.comm import CommError
from spmd.layout import block_range

RING_TAG = 1
GATHER_TAG = 2
BARRIER_TAG = 3


class Workspace:
    """Scratch buffers a rank keeps across calls (ring buffers, C rows to send).

    Fresh memory costs page faults on first touch, and on a VM memory freed a
    while ago costs far more (measured here: +0.2 s per 64 MB); a training
    loop keeps its buffers, as FSDP implementations do. Without a Workspace
    every call allocates its own.
    """

    def __init__(self):
        self._buffers = {}

    def array(self, name: str, shape: tuple, dtype) -> np.ndarray:
        """A C-contiguous array of `shape` and `dtype`, reusing buffer `name` when it is large enough."""
        count, dtype = math.prod(shape), np.dtype(dtype)
        flat = self._buffers.get(name)
        if flat is None or flat.size < count or flat.dtype != dtype:
            flat = self._buffers[name] = np.empty(count, dtype=dtype)
        return flat[:count].reshape(shape)


def scratch(workspace: Workspace | None, name: str, shape: tuple, dtype) -> np.ndarray:
    """An array from `workspace`, or a new one when there is none."""
    return np.empty(shape, dtype=dtype) if workspace is None else workspace.array(name, shape, dtype)


def ring_allgather(comm, rank: int, block: np.ndarray, shape_of, tag: int = RING_TAG, overlap: bool = True,
                   workspace: Workspace | None = None):
    """Yield (owner, block, progress) for every rank's block, this rank's own first.

    Blocks rotate right around the ring: at step s this rank holds the block
    owned by rank (rank - s) mod D. Before yielding it, it starts sending it on
    to rank + 1 and (with `overlap`) posts the receive of the next one from
    rank - 1 into a preallocated buffer, so the transfer can proceed while the
    caller computes; calling `progress()` now and then during that compute
    lets MPI move the bytes (it returns True once nothing is in flight).
    Beyond its own block a rank holds at most two buffers, alternating: the
    block in use and the one arriving (one buffer when D = 2, none when D = 1).

    Args:
        block: this rank's block (the caller keeps it; it is sent, never modified).
        shape_of: owner -> shape of that owner's block (all share `block`'s dtype).
        overlap: False posts each receive only after the caller is done with
            the current block, for measuring what the overlap gains.
        workspace: where the two ring buffers live across calls (default: new ones).
    """
    size = comm.num_devices
    right, left = (rank + 1) % size, (rank - 1) % size
    held = np.ascontiguousarray(block)
    largest = max(math.prod(shape_of(owner)) for owner in range(size))
    buffers = [scratch(workspace, f"ring{i}", (largest,), held.dtype) for i in range(min(2, size - 1))]
    for step in range(size):
        owner = (rank - step) % size
        if step == size - 1:
            yield owner, held, _no_progress
            return
        shape = shape_of((owner - 1) % size)  # the next block: owner - 1's
        incoming = buffers[step % 2][: math.prod(shape)].reshape(shape)
        receiving = comm.irecv(rank, left, tag, incoming) if overlap else None
        sending = comm.isend(rank, right, held, tag=tag)
        pending = [r for r in (sending, receiving) if r is not None]
        yield owner, held, lambda: all([r.test() for r in pending])
        if receiving is None:
            receiving = comm.irecv(rank, left, tag, incoming)
        receiving.wait()
        sending.wait()  # `held` may now be overwritten: it becomes the next receive buffer
        held = incoming


def _no_progress() -> bool:
    """Nothing in flight: the last step of a ring."""
    return True


def ring_allgather_ref(blocks: list) -> list:
    """For each rank, the (owner, block) pairs `ring_allgather` yields, in order."""
    size = len(blocks)
    return [[((rank - s) % size, blocks[(rank - s) % size]) for s in range(size)] for rank in range(size)]


def gather(comm, rank: int, block: np.ndarray, root: int = 0, tag: int = GATHER_TAG):
    """Collect every rank's block at `root`: the list in rank order there, None elsewhere.

    Non-root ranks send once; the root receives from each sender by name, so
    a fast rank's block for the next gather can never be taken for this one's.
    """
    if rank != root:
        comm.send(rank, root, block, tag=tag)
        return None
    return [block if src == root else comm.recv(rank, src=src, tag=tag)[1] for src in range(comm.num_devices)]


def gather_ref(blocks: list, root: int = 0) -> list:
    """For each rank, what `gather` returns there."""
    return [list(blocks) if rank == root else None for rank in range(len(blocks))]


def result_rows(comm, rank: int, c_shape: tuple, dtype, root: int = 0, workspace: Workspace | None = None):
    """(C, this rank's rows of C): C allocated at `root` only, its rows a view into it.

    Computing straight into these rows lets `gather_rows` receive the other
    ranks' rows in place at the root, with no copy of the root's own. Other
    ranks' rows are scratch (they are sent away), kept in `workspace` if given.
    """
    m, n = c_shape
    lo, hi = block_range(m, comm.num_devices, rank)
    if rank != root:
        return None, scratch(workspace, "c_rows", (hi - lo, n), dtype)
    c = np.empty((m, n), dtype=dtype)
    return c, c[lo:hi]


def gather_rows(comm, rank: int, rows: np.ndarray, out: np.ndarray | None = None, root: int = 0,
                tag: int = GATHER_TAG):
    """Stack every rank's row block, in rank order, into one matrix C at `root`.

    With `out` (from `result_rows`), row blocks are split as np.array_split
    and each is received straight into its place in `out`. Without it the
    root stacks whatever each rank sent. Either way a block whose column count
    or dtype is not the root's is an error naming its rank, never a silently
    reshaped result.
    """
    size = comm.num_devices
    if rank != root:
        comm.isend(rank, root, rows, tag=tag).wait()
        return None
    if out is not None:
        m = out.shape[0]
        receiving = [
            comm.irecv(root, src, tag, out[slice(*block_range(m, size, src))]) for src in range(size) if src != root
        ]
        for request in receiving:
            request.wait()
        return out
    blocks = gather(comm, rank, rows, root=root, tag=tag)
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
