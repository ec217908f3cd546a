"""Block arithmetic: which contiguous slice of an axis each rank owns.

The split is `np.array_split`'s: the first `size % parts` ranks get one extra
element, so any size and any rank count work (ranks past the end own nothing).
"""


def block_range(size: int, parts: int, index: int) -> tuple[int, int]:
    """Return the half-open range [lo, hi) that block `index` of `parts` owns.

    Args:
        size: length of the axis being split (>= 0).
        parts: number of blocks (>= 1).
        index: which block, 0 <= index < parts.
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    if not 0 <= index < parts:
        raise ValueError(f"block index {index} is outside 0..{parts - 1}")
    base, extra = divmod(size, parts)
    lo = index * base + min(index, extra)
    return lo, lo + base + (index < extra)


def block_size(size: int, parts: int, index: int) -> int:
    """Return the length of block `index`."""
    lo, hi = block_range(size, parts, index)
    return hi - lo


def block_sizes(size: int, parts: int) -> list[int]:
    """Return the length of every block, in rank order (block_range's split, computed once for all: the
    planner asks this for every rank of every layout)."""
    if parts < 1:
        return []
    base, extra = divmod(size, parts)
    return [base + 1] * extra + [base] * (parts - extra)


def largest_block(size: int, parts: int) -> int:
    """The length of the largest block (the first one): ceil(size / parts)."""
    return -(-size // parts)


def row_panels(rows: int, count: int, min_rows: int = 128) -> list[slice]:
    """`rows` cut into about `count` panels of at least `min_rows` each (below that a BLAS call loses speed);
    one empty panel when `rows` is 0 (a rank past the end still takes its turn)."""
    step = max(min_rows, -(-rows // count))
    return [slice(r, min(r + step, rows)) for r in range(0, max(rows, 1), step)]


def join_adjacent(pieces: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The ranges `pieces` with each one that starts where the previous ends joined to it (the same elements, in
    the same order, in as few slices as possible; unlike observe.trace.merged, never sorted: order is meaning)."""
    joined: list[tuple[int, int]] = []
    for lo, hi in pieces:
        if joined and joined[-1][1] == lo:
            joined[-1] = (joined[-1][0], hi)
        else:
            joined.append((lo, hi))
    return joined


def select(pieces: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """Elements lo..hi of the concatenation of the ranges `pieces`, as ranges (empty ones left out)."""
    chosen, at = [], 0
    for start, stop in pieces:
        a, b = max(lo - at, 0), min(hi - at, stop - start)
        if a < b:
            chosen.append((start + a, start + b))
        at += stop - start
    return chosen
