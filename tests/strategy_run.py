"""Running any registered strategy on whole matrices, for the tests (not collected: no test_ prefix)."""

import numpy as np

from spmd.matmul.problem import Problem
from spmd.transport.group import Group


def run_strategy(comm, rank, strategy, a, b, mesh=None, wrap_a=None, before_return=None, **options):
    """This rank's part of `strategy` on A and B (every rank holds both; it takes only its blocks).

    `wrap_a`, if given, replaces this rank's A block with wrap_a(block) before the run;
    `before_return(world)`, if given, is called while this rank still holds its blocks and result.
    Returns (result at rank 0 or None, the mesh, the Problem).
    """
    world = Group.world(comm, rank)
    mesh = strategy.mesh(world.size, mesh)
    (m, k), (_, n) = a.shape, b.shape
    problem = Problem(m, k, n, np.result_type(a.dtype, b.dtype).itemsize)
    operands = {"a": a, "b": b}
    blocks = strategy.blocks(
        problem, mesh, rank, lambda name, rows, cols: np.array(operands[name][slice(*rows), slice(*cols)], order="C")
    )
    if wrap_a is not None:
        blocks["a"] = wrap_a(blocks["a"])
    result = strategy.run(world, mesh, blocks, problem, **options)
    if before_return is not None:
        before_return(world)
    return result, mesh, problem
