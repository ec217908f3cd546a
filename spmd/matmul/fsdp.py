"""FSDP matmul: A split by rows, B split by columns, B shards rotating around a ring.

mpirun -n 4 python -m spmd fsdp --check   # one MPI process per rank
python -m spmd fsdp --devices 4 --check   # one thread per rank
"""

import functools

import numpy as np

from spmd.collectives import Workspace, result_rows, ring_allgather, stream_rows
from spmd.collectives.cost import all_gather_bytes, gather_bytes
from spmd.layout import block_range, block_size, row_panels
from spmd.matmul.problem import Problem
from spmd.matmul.strategy import Cost, Strategy
from spmd.observe.schedule import Cell, Schedule
from spmd.transport.clock import traced
from spmd.transport.group import Group
from spmd.transport.mesh import Mesh


def fsdp_rank(group: Group, a_block, b_shard, c_shape: tuple, overlap: bool = True, workspace: Workspace | None = None):
    """C = A @ B, fully sharded; returns C at rank 0 and None elsewhere.

    Communication: B shards rotate right around the ring (an all-gather);
    each step multiplies the shard in hand into the C columns of its owner
    while the next shard is already on its way. No rank holds more of B than
    its own shard, the one in use and the one arriving. Trace, 3 ranks, rank 1:
    step 0 its own shard 1, step 1 shard 0 (from rank 0), step 2 shard 2
    (owned by rank 2, passed on by rank 0). The last step sends its row panels of C
    to rank 0 as each is done (stream_rows).

    Args:
        a_block: this rank's rows of A, (M/D, K), split as np.array_split.
        b_shard: this rank's columns of B, (K, N/D), split as np.array_split.
        c_shape: (M, N), the shape of C.
        overlap: False waits for each shard only after multiplying the last
            (to measure what the overlap gains).
        workspace: scratch buffers (ring, C rows) to reuse across calls.
    """
    size, rank = group.size, group.rank
    (m, n), k = c_shape, a_block.shape[1]

    def shard_shape(owner):
        return (k, block_size(n, size, owner))

    a_rows = block_size(m, size, rank)
    if b_shard.shape != shard_shape(rank) or a_block.shape[0] != a_rows:
        raise ValueError(
            f"rank {rank} holds A rows {a_block.shape} and B shard {b_shard.shape}, but C {c_shape} "
            f"split over {size} ranks gives it ({a_rows}, {k}) and {shard_shape(rank)}"
        )
    c, c_rows = result_rows(group, c_shape, np.result_type(a_block.dtype, b_shard.dtype), workspace=workspace)

    def multiply(owner: int, shard: np.ndarray, rows: slice):
        """A's rows `rows` times the shard of `owner`: those rows of C's columns that `owner` holds."""
        with traced(group, f"A{rank} x B{owner}"):
            np.matmul(a_block[rows], shard, out=c_rows[rows, slice(*block_range(n, size, owner))])

    ring = ring_allgather(group, b_shard, shard_shape, overlap=overlap, workspace=workspace)
    for step, (owner, shard, progress) in enumerate(ring):  # shard: (K, N/D), the columns `owner` holds
        if step == size - 1:  # the last shard completes C's rows: multiplied below, panel by panel
            break
        # In panels while the next shard is on its way, letting it move in between.
        for rows in [slice(None)] if progress() else row_panels(c_rows.shape[0], PANELS_PER_STEP):
            multiply(owner, shard, rows)
            progress()
    # each finished panel leaves for rank 0 at once
    return stream_rows(group, c_rows, functools.partial(multiply, owner, shard), out=c)


PANELS_PER_STEP = 2  # progress calls per step; each multiply re-packs the shard, so few


def placements(p: Problem, mesh: Mesh, rank: int) -> dict:
    """Rank r: rows r of A and columns r of B (np.array_split)."""
    return {"a": (block_range(p.m, mesh.size, rank), (0, p.k)), "b": ((0, p.k), block_range(p.n, mesh.size, rank))}


def b_bytes_held(p: Problem, d: int, rank: int) -> int:
    """Peak bytes of B a rank holds: its shard plus the ring's buffers.

    The ring's buffers (the shard in use and the one arriving) are each as
    large as the widest shard: two of them, one when D = 2, none when D = 1.
    So FSDP holds about 3/D of DP's B (2/D at D = 2).
    """
    widest = max(p.cols(d, r) for r in range(d))
    return (p.k * p.cols(d, rank) + min(2, d - 1) * p.k * widest) * p.itemsize


def cost(p: Problem, mesh: Mesh) -> Cost:
    """The ring all-gather of B's shards (K (N - cols(r+1)) s sent), then C's rows to rank 0.

    Peak memory: its A rows, its B (above), its C rows (all of C at rank 0).
    """
    d = mesh.size
    cols = [p.cols(d, r) for r in range(d)]
    ring = [all_gather_bytes(cols, r, p.k * p.itemsize) for r in range(d)]
    c_rows = [gather_bytes([p.rows(d, r) * p.n * p.itemsize for r in range(d)], r) for r in range(d)]
    peak = [
        (p.rows(d, r) * p.k + (p.m if r == 0 else p.rows(d, r)) * p.n) * p.itemsize + b_bytes_held(p, d, r)
        for r in range(d)
    ]
    return Cost([ring[r][0] + c_rows[r][0] for r in range(d)], [ring[r][1] + c_rows[r][1] for r in range(d)], peak)


def schedule(mesh: Mesh) -> Schedule:
    """Rotation to the right: at step s rank r multiplies the shard of (r - s) mod D, sends it to r + 1
    and receives the shard of (r - s - 1) mod D from r - 1; the last step only multiplies."""
    d = mesh.size
    steps = []
    for s in range(d):
        cells = []
        for r in range(d):
            held = (r - s) % d
            if s == d - 1:
                cells.append(Cell(f"A{r} x B{held}"))
            else:
                cells.append(
                    Cell(f"A{r} x B{held}, B{held}->{(r + 1) % d}, B{(held - 1) % d}<-{(r - 1) % d}", ((r + 1) % d,))
                )
        steps.append((str(s), cells))
    steps.append(("end", [Cell("C rows -> 0", (0,)) if r else Cell("gathers C") for r in range(d)]))
    return Schedule(
        "FSDP: B's column shards rotate right. At each step a rank multiplies its A rows by the shard it\n"
        "holds (writing that owner's columns of its C rows), sends that shard to the next rank and\n"
        "receives the next one from the previous rank (both in flight during the multiply).",
        steps,
    )


FSDP = Strategy(
    name="fsdp",
    summary="fully sharded: A by rows, B by columns, B's shards rotate around a ring, C gathered at rank 0",
    axes=("fsdp",),
    placements=placements,
    rank_fn=lambda world, mesh, blocks, p, workspace, overlap=True: fsdp_rank(
        world, blocks["a"], blocks["b"], (p.m, p.n), overlap=overlap, workspace=workspace
    ),
    cost=cost,
    schedule=schedule,
)
