"""Each tile of C (a rank's rows x an owner's columns) is computed exactly once, by that rank."""

import numpy as np
import pytest

from spmd.dp import dp_rank
from spmd.fsdp import fsdp_rank
from spmd.layout import block_range


class CountingBlock(np.ndarray):
    """An A block that logs (first row, row count, B operand) of every matmul it (or a slice) takes part in."""

    def __array_finalize__(self, obj):
        self.log = getattr(obj, "log", None)
        self.origin = getattr(obj, "origin", None)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        plain = [x.view(np.ndarray) if isinstance(x, CountingBlock) else x for x in inputs]
        if "out" in kwargs:
            kwargs["out"] = tuple(o.view(np.ndarray) if isinstance(o, CountingBlock) else o for o in kwargs["out"])
        if ufunc is np.matmul:
            first = (inputs[0].__array_interface__["data"][0] - self.origin) // max(inputs[0].strides[0], 1)
            self.log.append((first, inputs[0].shape[0], plain[1].copy()))
        return getattr(ufunc, method)(*plain, **kwargs)


def every_tile_once(comm, rank, strategy):
    size = comm.num_devices
    m, k, n = 300 * size + 1, 3, 3 * size + 2  # uneven on purpose; several row panels per rank
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((m, k)), rng.standard_normal((k, n))
    a_block = np.ascontiguousarray(a[slice(*block_range(m, size, rank))]).view(CountingBlock)
    a_block.log, a_block.origin = [], a_block.__array_interface__["data"][0]
    if strategy == "dp":
        dp_rank(comm, rank, a_block, b, m_rows=m)
        owners = [b]
    else:
        fsdp_rank(comm, rank, a_block, b[:, slice(*block_range(n, size, rank))], (m, n))
        owners = [b[:, slice(*block_range(n, size, owner))] for owner in range(size)]
    rows_done = {owner: [] for owner in range(len(owners))}
    for first, count, operand in a_block.log:
        # Which owner's columns this product used, found by content.
        owner = next(o for o, e in enumerate(owners) if e.shape == operand.shape and np.array_equal(e, operand))
        rows_done[owner].extend(range(first, first + count))
    for owner, rows in rows_done.items():
        assert sorted(rows) == list(range(a_block.shape[0])), f"owner {owner}: rows not covered exactly once"


@pytest.mark.parametrize("strategy", ["dp", "fsdp"])
def test_every_tile_of_c_is_computed_exactly_once(world, strategy):
    world.run(every_tile_once, strategy)
