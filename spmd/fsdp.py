"""FSDP matmul: A split by rows, B split by columns, B shards rotating around a ring.

    mpirun -n 4 python -m spmd.fsdp --check   # one MPI process per rank
    python -m spmd.fsdp --devices 4 --check   # one thread per rank
"""

import sys

import numpy as np

from spmd.collectives import gather_rows, ring_allgather
from spmd.comm import CommError
from spmd.job import Strategy
from spmd.layout import block_range
from spmd.operands import check_operands, column_blocks, row_blocks
from spmd.threads import run_threads


def fsdp_rank(comm, rank: int, a_block, b_shard, n_cols: int):
    """C = A @ B, fully sharded; returns C at rank 0 and None elsewhere.

    Communication: B shards rotate right around the ring (an all-gather);
    each step multiplies the shard that just arrived into the C columns of its
    owner. No rank holds more of B than its own shard and the one in flight.
    Trace, 3 ranks, rank 1: step 0 its own shard 1, step 1 shard 0 (from
    rank 0), step 2 shard 2 (owned by rank 2, passed on by rank 0).

    Args:
        a_block: this rank's rows of A, (M/D, K).
        b_shard: this rank's columns of B, (K, N/D), split as np.array_split.
        n_cols: N, the column count of B and C.
    """
    size = comm.num_devices
    dtype = np.result_type(a_block.dtype, b_shard.dtype)
    c_rows = np.empty((a_block.shape[0], n_cols), dtype=dtype)  # c_rows: (M/D, N)
    for owner, shard in ring_allgather(comm, rank, b_shard):  # shard: (K, N/D) of `owner`
        lo, hi = block_range(n_cols, size, owner)
        if shard.shape != (a_block.shape[1], hi - lo) or shard.dtype != b_shard.dtype:
            raise CommError(
                f"rank {rank} expected rank {owner}'s B shard as {b_shard.dtype} "
                f"{(a_block.shape[1], hi - lo)}, got {shard.dtype} {shard.shape}"
            )
        np.matmul(a_block, shard, out=c_rows[:, lo:hi])
    return gather_rows(comm, rank, c_rows)


def fsdp_mat_mul(a, b, num_devices: int):
    """Multiply matrices with Fully Sharded Data Parallelism on `num_devices` threads.

    Divides A by rows and B by columns (as np.array_split); B shards circulate
    in an all-gather rotation while each device fills its rows of C.
    """
    a, b = check_operands(a, b, num_devices)
    a_blocks, b_shards = row_blocks(a, num_devices), column_blocks(b, num_devices)
    n_cols = b.shape[1]
    results = run_threads(
        num_devices, lambda comm, rank: fsdp_rank(comm, rank, a_blocks[rank], b_shards[rank], n_cols)
    )
    return results[0]


FSDP = Strategy(name="fsdp", b_columns=block_range, rank_fn=fsdp_rank)


def main(argv=None) -> int:
    from spmd.cli import main as cli_main

    return cli_main(FSDP, argv)


if __name__ == "__main__":
    sys.exit(main())
