"""Collectives with a root on a Group: gather, row gather into C, barrier, broadcast."""

import numpy as np

from spmd.collectives.shift import progress
from spmd.collectives.tags import Tag
from spmd.collectives.workspace import Workspace, scratch
from spmd.layout import block_range, row_panels
from spmd.transport.comm import CommError
from spmd.transport.group import Group


def gather(group: Group, block: np.ndarray, root: int = 0, tag: int = Tag.GATHER):
    """Collect every rank's block at `root`: the list in rank order there, None elsewhere.

    Non-root ranks send once; the root receives from each sender by name, so
    a fast rank's block for the next gather can never be taken for this one's.
    """
    if group.rank != root:
        group.send(root, block, tag=tag)
        return None
    return [block if src == root else group.recv(src=src, tag=tag)[1] for src in range(group.size)]


def result_rows(group: Group, c_shape: tuple, dtype, root: int = 0, workspace: Workspace | None = None):
    """(C, this rank's rows of C): C allocated at `root` only, its rows a view into it.

    Computing straight into these rows lets `stream_rows` receive the other
    ranks' rows in place at the root, with no copy of the root's own. Other
    ranks' rows are scratch (they are sent away), kept in `workspace` if given.
    """
    m, n = c_shape
    lo, hi = block_range(m, group.size, group.rank)
    if group.rank != root:
        return None, scratch(workspace, "c_rows", (hi - lo, n), dtype)
    c = np.empty((m, n), dtype=dtype)
    return c, c[lo:hi]


def gather_rows(group: Group, rows: np.ndarray, root: int = 0, tag: int = Tag.GATHER):
    """Stack every rank's row block, in rank order, into one matrix C at `root`, whatever each rank's row
    count (stream_rows receives blocks split as np.array_split in place instead). A block whose column count
    or dtype is not the root's is an error naming its rank, never a silently reshaped result.
    """
    if group.rank != root:
        group.isend(root, rows, tag=tag).wait()
        return None
    blocks = gather(group, rows, root=root, tag=tag)
    for src, block in enumerate(blocks):
        if block.ndim != 2 or block.shape[1] != rows.shape[1] or block.dtype != rows.dtype:
            raise CommError(
                f"rank {root} expected a row block of {rows.shape[1]} columns of {rows.dtype} "
                f"from rank {src}, got shape {block.shape} of {block.dtype}"
            )
    return np.concatenate(blocks, axis=0)


STREAM_PANELS = 4  # row panels each rank's C rows go out in: at n = 4096 4 cost no time, 8 cost ~6% (each re-packs B)


def stream_rows(
    group: Group, rows: np.ndarray, compute, out: np.ndarray | None = None, root: int = 0, tag: int = Tag.GATHER
) -> np.ndarray | None:
    """`gather_rows` under the compute: `compute(panel)` fills `rows[panel]`, panel by panel; every finished
    panel leaves for `root` at once, and the root receives the others' panels into `out` (from `result_rows`)
    between its own. The same bytes as `gather_rows`; what it saves is the wait after the last multiply for C's
    rows to land in fresh memory at the root (measured: 0.13-0.24 s for 64 MiB on these VMs).
    """
    panels = row_panels(rows.shape[0], STREAM_PANELS)
    if group.rank != root:
        sending = []
        for panel in panels:
            compute(panel)
            sending.append(group.isend(root, rows[panel], tag=tag))
            progress(sending)
        for request in sending:
            request.wait()
        return None
    if out is None:
        raise ValueError("stream_rows: the root needs `out`, C from result_rows")
    m, receiving = out.shape[0], []
    for src in range(group.size):
        if src != root:
            lo, hi = block_range(m, group.size, src)
            receiving += [
                group.irecv(src, tag, out[lo + p.start : lo + p.stop]) for p in row_panels(hi - lo, STREAM_PANELS)
            ]
    done = 0  # receives are finished in posting order on every backend, so the message log does not depend
    for panel in panels:  # on timing (MPI's progress still moves every transfer at each test)
        compute(panel)
        while done < len(receiving) and receiving[done].test():
            done += 1
    for request in receiving[done:]:
        request.wait()
    return out


def barrier(group: Group, root: int = 0, tag: int = Tag.BARRIER) -> None:
    """Return on each rank only once every rank has called it."""
    token = np.empty(0, dtype=np.uint8)
    if gather(group, token, root=root, tag=tag) is not None:
        for dst in range(group.size):
            if dst != root:
                group.send(dst, token, tag=tag)
    else:
        group.recv(src=root, tag=tag)


def tree_children(rank: int, size: int, root: int = 0) -> list[int]:
    """The ranks `rank` forwards a broadcast to: a binomial tree, so the root sends ceil(log2 D) times."""
    v = (rank - root) % size
    children, bit = [], 1
    while v + bit < size:
        if bit > v:
            children.append((v + bit + root) % size)
        bit <<= 1
    return children


def tree_parent(rank: int, size: int, root: int = 0) -> int | None:
    """The rank `rank` receives a broadcast from (None at the root): clear v's highest bit."""
    v = (rank - root) % size
    return None if v == 0 else ((v - (1 << (v.bit_length() - 1))) + root) % size


def broadcast(group: Group, array: np.ndarray | None, root: int = 0, tag: int = Tag.BROADCAST) -> np.ndarray:
    """The root's `array` on every rank (the others pass None: shape and dtype come with the message).

    Communication: a binomial tree rooted at `root`; a rank receives once from
    its parent, then sends to its children (tree_children), the farthest first.
    """
    if not 0 <= root < group.size:
        raise ValueError(f"broadcast: root {root} is not a rank of this group of {group.size} (0..{group.size - 1})")
    parent = tree_parent(group.rank, group.size, root)
    if parent is None:
        if array is None:
            raise ValueError(f"broadcast: the root (rank {root}) must pass the array")
        data = np.asarray(array, order="C")
    else:
        _, data = group.recv(src=parent, tag=tag)
    sending = [group.isend(child, data, tag) for child in reversed(tree_children(group.rank, group.size, root))]
    for request in sending:
        request.wait()
    return data


def alone_at_root(group: Group, work, root: int = 0, pause: float = 0.02):
    """work() at `root` while every other rank waits in long sleeps (a rank polling on a shared core would take
    its share of it: a measurement then sees half a core); work's result at root, None elsewhere."""
    barrier(group, root)
    if group.rank == root:
        result = work()
        barrier(group, root)
        return result
    with group.comm.quiet_waits(pause):
        barrier(group, root)
    return None
