"""Each tile of C (a rank's rows x an owner's columns) is computed exactly once, by that rank."""

import numpy as np
import pytest

from spmd.dp import dp_rank
from spmd.fsdp import fsdp_rank
from spmd.layout import block_range


class CountingBlock(np.ndarray):
    """An A block that records the B block of every matmul it takes part in."""

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        plain = [x.view(np.ndarray) if isinstance(x, CountingBlock) else x for x in inputs]
        if "out" in kwargs:
            kwargs["out"] = tuple(o.view(np.ndarray) if isinstance(o, CountingBlock) else o for o in kwargs["out"])
        if ufunc is np.matmul:
            self.products.append(plain[1].copy())
        return getattr(ufunc, method)(*plain, **kwargs)


def every_tile_once(comm, rank, strategy):
    size = comm.num_devices
    m, k, n = 2 * size + 1, 3, 3 * size + 2  # uneven on purpose
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((m, k)), rng.standard_normal((k, n))
    a_block = a[slice(*block_range(m, size, rank))].view(CountingBlock)
    a_block.products = []
    if strategy == "dp":
        dp_rank(comm, rank, a_block, b)
        expected = [b]
    else:
        fsdp_rank(comm, rank, a_block, b[:, slice(*block_range(n, size, rank))], n)
        expected = [b[:, slice(*block_range(n, size, owner))] for owner in range(size)]
    # Which owner's columns each product used, found by content.
    used = [next(o for o, e in enumerate(expected) if e.shape == p.shape and np.array_equal(e, p))
            for p in a_block.products]
    assert sorted(used) == list(range(len(expected)))  # every owner's block once, no repeats


@pytest.mark.parametrize("strategy", ["dp", "fsdp"])
def test_every_tile_of_c_is_computed_exactly_once(world, strategy):
    world.run(every_tile_once, strategy)
