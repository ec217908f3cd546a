"""Block arithmetic, checked against np.array_split without any communicator."""

import numpy as np
import pytest

from spmd.layout import block_range, block_sizes, join_adjacent, row_panels


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


def test_join_adjacent_keeps_order_and_joins_only_touching_ranges():
    assert join_adjacent([(0, 1), (1, 2), (2, 5)]) == [(0, 5)]  # a token a sequence: one slice
    assert join_adjacent([(4, 6), (0, 4), (6, 8)]) == [(4, 6), (0, 4), (6, 8)]  # order is kept, never sorted
    assert join_adjacent([(0, 2), (3, 4), (4, 5)]) == [(0, 2), (3, 5)]
    assert join_adjacent([]) == []


@pytest.mark.parametrize("rows", [0, 1, 127, 128, 300, 2048])
def test_row_panels_cover_every_row_once_in_panels_of_at_least_128(rows):
    panels = row_panels(rows, 4)
    assert [r for p in panels for r in range(rows)[p]] == list(range(rows))
    assert len(panels) >= 1 and all(p.stop - p.start >= 128 for p in panels[:-1])
    assert len(panels) <= max(1, -(-rows // 128)) and (rows < 512 or len(panels) == 4)
