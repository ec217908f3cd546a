"""Ring collectives on a Group: all-gather (streamed or in place), reduce-scatter, all-reduce.

Every message goes to the right neighbour (rank + 1) and comes from the left
(rank - 1). Arrays split along their first axis as np.array_split does
(`counts` gives each rank's rows), so any size works, empty chunks included.
"""

import functools
import math
from collections.abc import Sequence

import numpy as np

from spmd.collectives.handle import Handle, run
from spmd.collectives.tags import Tag
from spmd.collectives.workspace import Workspace, scratch
from spmd.layout import block_sizes
from spmd.transport.group import Group


def ring_allgather(
    group: Group,
    block: np.ndarray,
    shape_of,
    tag: int = Tag.RING,
    overlap: bool = True,
    workspace: Workspace | None = None,
):
    """Yield (owner, block, progress) for every rank's block, this rank's own first.

    Blocks rotate right around the ring: at step s this rank holds the block
    owned by rank (rank - s) mod D. Before yielding it, it starts sending it on
    to rank + 1 and (with `overlap`) posts the receive of the next one from
    rank - 1 into a preallocated buffer, so the transfer can proceed while the
    caller computes; calling `progress()` now and then during that compute
    lets MPI move the bytes (it returns True once nothing in flight needs this
    rank's progress: on threads a send is finished by its receiver alone).
    Beyond its own block a rank holds at most two buffers, alternating: the
    block in use and the one arriving (one buffer when D = 2, none when D = 1).

    Args:
        block: this rank's block (the caller keeps it; it is sent, never modified).
        shape_of: owner -> shape of that owner's block (all share `block`'s dtype).
        overlap: False posts each receive only after the caller is done with
            the current block, for measuring what the overlap gains.
        workspace: where the two ring buffers live across calls (default: new ones).
    """
    size, rank = group.size, group.rank
    right, left = (rank + 1) % size, (rank - 1) % size
    held = np.asarray(block, order="C")
    largest = max(math.prod(shape_of(owner)) for owner in range(size))
    buffers = [scratch(workspace, f"ring{i}", (largest,), held.dtype) for i in range(min(2, size - 1))]
    for step in range(size):
        owner = (rank - step) % size
        if step == size - 1:
            yield owner, held, _no_progress
            return
        shape = shape_of((owner - 1) % size)  # the next block: owner - 1's
        incoming = buffers[step % 2][: math.prod(shape)].reshape(shape)
        receiving = group.irecv(left, tag, incoming) if overlap else None
        sending = group.isend(right, held, tag=tag)
        pending = tuple(r for r in (sending, receiving) if r is not None)
        yield owner, held, functools.partial(_all_done, pending)
        if receiving is None:
            receiving = group.irecv(left, tag, incoming)
        receiving.wait()
        sending.wait()  # `held` may now be overwritten: it becomes the next receive buffer
        held = incoming


def _all_done(requests: tuple) -> bool:
    """Test every request (each test lets its transfer progress); True once none needs this rank's progress."""
    return not any([r.needs_progress() for r in requests])


def _no_progress() -> bool:
    """Nothing in flight: the last step of a ring."""
    return True


def _row_slices(counts: list[int]) -> list[slice]:
    starts = np.cumsum([0, *counts])
    return [slice(int(lo), int(hi)) for lo, hi in zip(starts[:-1], starts[1:], strict=True)]


def all_gather(
    group: Group,
    block: np.ndarray,
    counts: Sequence[int] | None = None,
    out: np.ndarray | None = None,
    tag: int = Tag.ALL_GATHER,
) -> np.ndarray:
    """The blocking form of start_all_gather (see all_gather_steps)."""
    return run(all_gather_steps(group, block, counts, out, tag))


def start_all_gather(
    group: Group,
    block: np.ndarray,
    counts: Sequence[int] | None = None,
    out: np.ndarray | None = None,
    tag: int = Tag.ALL_GATHER,
) -> Handle:
    """all_gather started: a Handle to progress() between compute panels and wait() for `out`."""
    return Handle(all_gather_steps(group, block, counts, out, tag))


def all_gather_steps(group: Group, block: np.ndarray, counts, out, tag):
    """Every rank's block stacked along axis 0 in rank order, on every rank (ring, in place).

    Communication: at step s this rank sends the block of rank (rank - s) to the
    right and receives that of (rank - s - 1) from the left, straight into its
    place in `out`. Sends all but its right neighbour's block.

    Args:
        block: this rank's rows, (counts[rank], ...).
        counts: every rank's row count (default: all equal to this block's).
        out: where to assemble the result, C-contiguous (default: a new array).
    """
    size, rank = group.size, group.rank
    counts = [block.shape[0]] * size if counts is None else list(counts)
    if len(counts) != size or counts[rank] != block.shape[0]:
        raise ValueError(
            f"rank {rank} holds {block.shape[0]} rows, but counts {counts} are for "
            f"{len(counts)} ranks with {counts[rank] if rank < len(counts) else '?'} rows here"
        )
    shape = (sum(counts), *block.shape[1:])
    if out is None:
        out = np.empty(shape, dtype=block.dtype)
    elif out.shape != shape or out.dtype != block.dtype or not out.flags.c_contiguous:
        raise ValueError(f"all_gather's out must be C-contiguous {block.dtype} {shape}, got {out.dtype} {out.shape}")
    rows = _row_slices(counts)
    out[rows[rank]] = block
    right, left = (rank + 1) % size, (rank - 1) % size
    for step in range(size - 1):
        receiving = group.irecv(left, tag, out[rows[(rank - step - 1) % size]])
        yield receiving, group.isend(right, out[rows[(rank - step) % size]], tag)
    return out


REDUCTION_BUFFERS = ("reduce0", "reduce1", "reduced")  # a Workspace's arrays for reduce_scatter and all_reduce


def reduce_scatter(
    group: Group,
    array: np.ndarray,
    tag: int = Tag.REDUCE_SCATTER,
    workspace: Workspace | None = None,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """The blocking form of start_reduce_scatter (see reduce_scatter_steps)."""
    return run(reduce_scatter_steps(group, array, tag, workspace, out))


def start_reduce_scatter(
    group: Group,
    array: np.ndarray,
    tag: int = Tag.REDUCE_SCATTER,
    workspace: Workspace | None = None,
    out: np.ndarray | None = None,
) -> Handle:
    """reduce_scatter started: a Handle; `array` and the workspace stay in use until it is done."""
    return Handle(reduce_scatter_steps(group, array, tag, workspace, out))


def reduce_scatter_steps(group: Group, array: np.ndarray, tag, workspace, out, op=np.add):
    """This rank's chunk of the sum over ranks of `array`, chunks split along axis 0 (np.array_split).

    Communication: at step s this rank sends its running sum of chunk
    (rank - s - 1) to the right and adds its own part to the sum of chunk
    (rank - s - 2) arriving from the left; after D - 1 steps it holds chunk
    `rank`, summed over every rank. Chunk c is always summed in one order,
    starting at rank c + 1 (see reduce_scatter_ref), so results do not depend
    on timing or backend. Sends all but its own chunk.

    Args:
        workspace: holds the two ring buffers (each the largest chunk) across calls.
        out: where the result goes; it may be this rank's own chunk of `array`
            (an in-place reduce-scatter). Without it: a new array.
    """
    size, rank = group.size, group.rank
    chunks = [array[s] for s in _row_slices(block_sizes(array.shape[0], size))]
    held = np.asarray(chunks[(rank - 1) % size], order="C")
    right, left = (rank + 1) % size, (rank - 1) % size
    largest = max(c.size for c in chunks)
    buffers = [scratch(workspace, name, (largest,), array.dtype) for name in REDUCTION_BUFFERS[:2]] if size > 1 else []
    for step in range(size - 1):
        mine = chunks[(rank - step - 2) % size]
        incoming = buffers[step % 2][: mine.size].reshape(mine.shape)
        yield group.irecv(left, tag, incoming), group.isend(right, held, tag)
        op(incoming, mine, out=incoming)  # the running sum (or max: op) so far, then this rank's part
        held = incoming
    if out is None:
        return held.copy()
    if out is not held:
        out[...] = held
    return out


def all_reduce(
    group: Group, array: np.ndarray, workspace: Workspace | None = None, out: np.ndarray | None = None, op=np.add
) -> np.ndarray:
    """The sum over ranks of `array` (or another elementwise ufunc `op`, e.g. np.maximum), bitwise the same on
    every rank: reduce-scatter, then all-gather.

    Each flat chunk is summed once, by its owner, in a fixed order, and then copied.
    `out` may be `array` itself (in place); with a workspace nothing is allocated.
    """
    return run(all_reduce_steps(group, array, workspace, out, op))


def start_all_reduce(
    group: Group, array: np.ndarray, workspace: Workspace | None = None, out: np.ndarray | None = None
) -> Handle:
    """all_reduce started: a Handle; `array` and the workspace stay in use until it is done."""
    return Handle(all_reduce_steps(group, array, workspace, out))


def all_reduce_steps(group: Group, array: np.ndarray, workspace, out, op=np.add):
    flat = np.asarray(array, order="C").reshape(-1)
    counts = block_sizes(flat.size, group.size)
    if out is None:
        out = np.empty_like(flat)
    elif out.shape != array.shape or not out.flags.c_contiguous:
        raise ValueError(f"all_reduce's out must be C-contiguous of shape {array.shape}, got {out.shape}")
    mine = yield from reduce_scatter_steps(
        group,
        flat,
        Tag.REDUCE_SCATTER,
        workspace,
        scratch(workspace, REDUCTION_BUFFERS[2], (counts[group.rank],), flat.dtype),
        op,
    )
    yield from all_gather_steps(group, mine, counts, out.reshape(-1), Tag.ALL_GATHER)
    return out.reshape(array.shape)
