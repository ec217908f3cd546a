"""The problem statement's API, kept exactly: compute_fn, dp_mat_mul, fsdp_mat_mul.

Each runs one thread per device on the statement's queue Communicator and
calls the strategy's rank function through the world's Group.
"""

from spmd.matmul.dp import dp_rank
from spmd.matmul.fsdp import fsdp_rank
from spmd.matmul.operands import check_operands, column_blocks, read_only, row_blocks
from spmd.transport.group import Group
from spmd.transport.threads import run_threads


def compute_fn(comm, rank, a_chunk, b, result):
    """One device's Data Parallel work (the problem statement's signature).

    Multiplies `a_chunk` by `b` and sends the product to rank 0, which puts
    the whole C in `result[0]`.
    """
    c = dp_rank(Group.world(comm, rank), a_chunk, b)
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


def fsdp_mat_mul(a, b, num_devices: int):
    """Multiply matrices with Fully Sharded Data Parallelism on `num_devices` threads.

    Divides A by rows and B by columns (as np.array_split); B shards circulate
    in an all-gather rotation while each device fills its rows of C.
    """
    a, b = check_operands(a, b, num_devices)
    a_blocks, b_shards = row_blocks(a, num_devices), column_blocks(b, num_devices)
    c_shape = (a.shape[0], b.shape[1])
    results = run_threads(
        num_devices,
        lambda comm, rank: fsdp_rank(Group.world(comm, rank), a_blocks[rank], b_shards[rank], c_shape),
    )
    return results[0]
