"""Data-parallel matmul: A split by rows, every rank holds all of B, C gathered at rank 0.

    mpirun -n 4 python -m spmd.dp --check     # one MPI process per rank
    python -m spmd.dp --devices 4 --check     # one thread per rank
"""

import sys

import numpy as np

from spmd.collectives import Workspace, gather_rows, result_rows
from spmd.job import Strategy
from spmd.operands import check_operands, read_only, row_blocks
from spmd.threads import run_threads
from spmd.trace import traced


def dp_rank(comm, rank: int, a_block, b, m_rows: int | None = None, workspace: Workspace | None = None):
    """C = A @ B, data parallel; returns C at rank 0 and None elsewhere.

    Communication: none but the gather; each rank multiplies its own rows of
    A by all of B and sends the C rows to rank 0, which stacks them in rank order.

    Args:
        a_block: this rank's rows of A, (M/D, K).
        b: all of B, (K, N).
        m_rows: M, if known: rank 0 then receives every block in place in C
            (rows split as np.array_split); without it, it stacks what arrives.
        workspace: scratch buffers (C rows to send) to reuse across calls.
    """
    if m_rows is None:
        with traced(comm, rank, f"A{rank} x B"):
            c_rows = a_block @ b  # c_rows: (M/D, N)
        return gather_rows(comm, rank, c_rows)
    c, c_rows = result_rows(comm, rank, (m_rows, b.shape[1]), np.result_type(a_block.dtype, b.dtype),
                            workspace=workspace)
    with traced(comm, rank, f"A{rank} x B"):
        np.matmul(a_block, b, out=c_rows)  # c_rows: (M/D, N), inside C at rank 0
    return gather_rows(comm, rank, c_rows, out=c)


def compute_fn(comm, rank, a_chunk, b, result):
    """One device's Data Parallel work (the problem statement's signature).

    Multiplies `a_chunk` by `b` and sends the product to rank 0, which puts
    the whole C in `result[0]`.
    """
    c = dp_rank(comm, rank, a_chunk, b)
    if rank == 0:
        result[0] = c


def dp_mat_mul(a, b, num_devices: int):
    """Multiply matrices with Data Parallelism on `num_devices` threads.

    Divides A across rows (as np.array_split), computes each block
    independently, and gathers the row blocks at rank 0.
    """
    a, b = check_operands(a, b, num_devices)
    a_blocks, b_all = row_blocks(a, num_devices), read_only(b)
    result = [None]
    run_threads(num_devices, lambda comm, rank: compute_fn(comm, rank, a_blocks[rank], b_all, result))
    return result[0]


DP = Strategy(
    name="dp",
    b_columns=lambda n, num_devices, rank: (0, n),  # every rank holds all of B
    rank_fn=lambda comm, rank, a_block, b, c_shape: dp_rank(comm, rank, a_block, b, m_rows=c_shape[0]),
)


def main(argv=None) -> int:
    from spmd.cli import main as cli_main

    return cli_main(DP, argv)


if __name__ == "__main__":
    sys.exit(main())
