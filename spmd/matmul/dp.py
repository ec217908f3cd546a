"""Data-parallel matmul: A split by rows, every rank holds all of B, C gathered at rank 0.

mpirun -n 4 python -m spmd dp --check     # one MPI process per rank
python -m spmd dp --devices 4 --check     # one thread per rank
"""

import numpy as np

from spmd.collectives import Workspace, gather_rows, result_rows, stream_rows
from spmd.collectives.cost import gather_bytes
from spmd.layout import block_range
from spmd.matmul.problem import Problem
from spmd.matmul.strategy import Cost, Strategy
from spmd.observe.schedule import Cell, Schedule
from spmd.transport.clock import traced
from spmd.transport.group import Group
from spmd.transport.mesh import Mesh


def dp_rank(group: Group, a_block, b, m_rows: int | None = None, workspace: Workspace | None = None):
    """C = A @ B, data parallel; returns C at rank 0 and None elsewhere.

    Communication: none but the gather; each rank multiplies its own rows of
    A by all of B and sends the C rows to rank 0, which stacks them in rank order
    (with m_rows: panel by panel as they are computed, see stream_rows).

    Args:
        a_block: this rank's rows of A, (M/D, K).
        b: all of B, (K, N).
        m_rows: M, if known: rank 0 then receives every block in place in C
            (rows split as np.array_split); without it, it stacks what arrives.
        workspace: scratch buffers (C rows to send) to reuse across calls.
    """
    if m_rows is None:
        with traced(group, f"A{group.rank} x B"):
            c_rows = a_block @ b  # c_rows: (M/D, N)
        return gather_rows(group, c_rows)
    c, c_rows = result_rows(group, (m_rows, b.shape[1]), np.result_type(a_block.dtype, b.dtype), workspace=workspace)

    def multiply(panel: slice):
        with traced(group, f"A{group.rank} x B"):
            np.matmul(a_block[panel], b, out=c_rows[panel])  # c_rows: (M/D, N), inside C at rank 0

    return stream_rows(group, c_rows, multiply, out=c)


def placements(p: Problem, mesh: Mesh, rank: int) -> dict:
    """Rank r: rows r of A (np.array_split), all of B."""
    return {"a": (block_range(p.m, mesh.size, rank), (0, p.k)), "b": ((0, p.k), (0, p.n))}


def cost(p: Problem, mesh: Mesh) -> Cost:
    """No B moves (each rank makes or reads its own copy); only C's rows go to rank 0.

    Peak memory: its A rows, all of B, its C rows (all of C at rank 0).
    """
    d = mesh.size
    c_rows = [gather_bytes([p.rows(d, r) * p.n * p.itemsize for r in range(d)], r) for r in range(d)]
    peak = [(p.rows(d, r) * p.k + p.k * p.n + (p.m if r == 0 else p.rows(d, r)) * p.n) * p.itemsize for r in range(d)]
    return Cost([s for s, _ in c_rows], [r for _, r in c_rows], peak)


def schedule(mesh: Mesh) -> Schedule:
    d = mesh.size
    return Schedule(
        "DP: every rank holds all of B and multiplies its rows of A by it; no B moves.",
        [
            ("0", [Cell(f"A{r} x all of B") for r in range(d)]),
            ("end", [Cell("C rows -> 0", (0,)) if r else Cell("gathers C") for r in range(d)]),
        ],
    )


DP = Strategy(
    name="dp",
    summary="data parallel: A split by rows, all of B on every rank, C gathered at rank 0",
    axes=("dp",),
    placements=placements,
    rank_fn=lambda world, mesh, blocks, p, workspace: dp_rank(world, blocks["a"], blocks["b"], p.m, workspace),
    cost=cost,
    schedule=schedule,
)
