"""Block arithmetic, checked against np.array_split without any communicator."""

import numpy as np
import pytest

from spmd.layout import block_range, block_sizes


@pytest.mark.parametrize("size", [0, 1, 2, 5, 7, 8, 16, 100, 1023])
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 7, 8, 20])
def test_blocks_match_array_split(size, parts):
    pieces = np.array_split(np.arange(size), parts)
    for rank, piece in enumerate(pieces):
        lo, hi = block_range(size, parts, rank)
        assert list(range(lo, hi)) == piece.tolist()
    assert block_sizes(size, parts) == [len(p) for p in pieces]


def test_blocks_tile_the_axis_exactly_once():
    for size in range(0, 30):
        for parts in range(1, 12):
            covered = [i for r in range(parts) for i in range(*block_range(size, parts, r))]
            assert covered == list(range(size))


@pytest.mark.parametrize(
    "args, message",
    [((10, 0, 0), "parts must be >= 1"), ((10, 3, 3), "outside 0..2"), ((10, 3, -1), "outside 0..2")],
)
def test_bad_block_requests_are_named(args, message):
    with pytest.raises(ValueError, match=message):
        block_range(*args)
