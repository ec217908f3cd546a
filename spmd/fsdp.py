"""FSDP matmul: A split by rows, B split by columns, B shards rotating around a ring.

    mpirun -n 4 python -m spmd.fsdp --check   # one MPI process per rank
    python -m spmd.fsdp --devices 4 --check   # one thread per rank
"""

import sys

import numpy as np

from spmd.collectives import Workspace, gather_rows, result_rows, ring_allgather
from spmd.job import Strategy
from spmd.layout import block_range, block_size
from spmd.operands import check_operands, column_blocks, row_blocks
from spmd.threads import run_threads
from spmd.trace import traced


def fsdp_rank(comm, rank: int, a_block, b_shard, c_shape: tuple, overlap: bool = True,
              workspace: Workspace | None = None):
    """C = A @ B, fully sharded; returns C at rank 0 and None elsewhere.

    Communication: B shards rotate right around the ring (an all-gather);
    each step multiplies the shard in hand into the C columns of its owner
    while the next shard is already on its way. No rank holds more of B than
    its own shard, the one in use and the one arriving. Trace, 3 ranks, rank 1:
    step 0 its own shard 1, step 1 shard 0 (from rank 0), step 2 shard 2
    (owned by rank 2, passed on by rank 0). Rank 0 then gathers C's rows.

    Args:
        a_block: this rank's rows of A, (M/D, K), split as np.array_split.
        b_shard: this rank's columns of B, (K, N/D), split as np.array_split.
        c_shape: (M, N), the shape of C.
        overlap: False waits for each shard only after multiplying the last
            (to measure what the overlap gains).
        workspace: scratch buffers (ring, C rows) to reuse across calls.
    """
    size = comm.num_devices
    (m, n), k = c_shape, a_block.shape[1]

    def shard_shape(owner):
        return (k, block_size(n, size, owner))

    a_rows = block_size(m, size, rank)
    if b_shard.shape != shard_shape(rank) or a_block.shape[0] != a_rows:
        raise ValueError(
            f"rank {rank} holds A rows {a_block.shape} and B shard {b_shard.shape}, but C {c_shape} "
            f"split over {size} ranks gives it ({a_rows}, {k}) and {shard_shape(rank)}"
        )
    c, c_rows = result_rows(comm, rank, c_shape, np.result_type(a_block.dtype, b_shard.dtype), workspace=workspace)
    for owner, shard, progress in ring_allgather(comm, rank, b_shard, shard_shape, overlap=overlap, workspace=workspace):
        # shard: (K, N/D), the columns of B (and of C) that `owner` holds
        cols = slice(*block_range(n, size, owner))
        # In panels while the next shard is on its way, letting it move in between.
        for rows in [slice(None)] if progress() else _panels(c_rows.shape[0]):
            with traced(comm, rank, f"A{rank} x B{owner}"):
                np.matmul(a_block[rows], shard, out=c_rows[rows, cols])
            progress()
    return gather_rows(comm, rank, c_rows, out=c)


PANELS_PER_STEP = 2  # progress calls per step; each multiply re-packs the shard, so few
MIN_PANEL_ROWS = 128  # below this a BLAS call loses speed


def _panels(rows: int) -> list[slice]:
    """Row panels of a step's multiply, with a progress call after each."""
    step = max(MIN_PANEL_ROWS, -(-rows // PANELS_PER_STEP))
    return [slice(r, min(r + step, rows)) for r in range(0, max(rows, 1), step)]


def fsdp_mat_mul(a, b, num_devices: int):
    """Multiply matrices with Fully Sharded Data Parallelism on `num_devices` threads.

    Divides A by rows and B by columns (as np.array_split); B shards circulate
    in an all-gather rotation while each device fills its rows of C.
    """
    a, b = check_operands(a, b, num_devices)
    a_blocks, b_shards = row_blocks(a, num_devices), column_blocks(b, num_devices)
    c_shape = (a.shape[0], b.shape[1])
    results = run_threads(
        num_devices, lambda comm, rank: fsdp_rank(comm, rank, a_blocks[rank], b_shards[rank], c_shape)
    )
    return results[0]


FSDP = Strategy(name="fsdp", b_columns=block_range, rank_fn=fsdp_rank)


def main(argv=None) -> int:
    from spmd.cli import main as cli_main

    return cli_main(FSDP, argv)


if __name__ == "__main__":
    sys.exit(main())
