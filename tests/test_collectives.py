"""Each collective against its reference, on threads and on MPI, at several sizes."""

import time

import numpy as np
import pytest

from spmd import RankFailure
from spmd.collectives import (
    all_gather,
    all_reduce,
    all_to_all,
    all_to_all_into,
    alone_at_root,
    barrier,
    broadcast,
    gather,
    gather_rows,
    reduce_scatter,
    result_rows,
    ring_allgather,
    ring_shift,
    stream_rows,
)
from spmd.collectives.cost import (
    all_gather_bytes,
    all_reduce_bytes,
    all_to_all_bytes,
    broadcast_bytes,
    gather_bytes,
    reduce_scatter_bytes,
    ring_shift_bytes,
)
from spmd.collectives.reference import (
    all_gather_ref,
    all_reduce_ref,
    all_to_all_ref,
    broadcast_parents_ref,
    broadcast_ref,
    gather_ref,
    reduce_scatter_ref,
    ring_allgather_ref,
    ring_shift_ref,
)
from spmd.collectives.rooted import tree_children
from spmd.layout import block_range, block_sizes
from spmd.transport.comm import CommError
from spmd.transport.group import Group
from spmd.transport.threads import Chaos, run_threads


def rank_blocks(size, rows, cols_of):
    """Every rank's block, the same on every rank: rank r's is (rows, cols_of(r)), filled with r."""
    rng = np.random.default_rng(size)
    return [rng.standard_normal((rows, cols_of(r))) + r for r in range(size)]


WIDTHS = {
    "even": lambda r: 3,
    "uneven": lambda r: 1 + r % 3,
    "some-empty": lambda r: r % 2,
    "large": lambda r: 1100,  # 8.8 KB and up per row-block: past the eager limit
}


def ring_matches_ref(comm, rank, widths, overlap):
    blocks = rank_blocks(comm.num_devices, 4, WIDTHS[widths])
    shape_of = lambda owner: (4, WIDTHS[widths](owner))  # noqa: E731
    got = []
    for owner, block, progress in ring_allgather(Group.world(comm, rank), blocks[rank], shape_of, overlap=overlap):
        progress()
        got.append((owner, block.copy()))
    want = ring_allgather_ref(blocks)[rank]
    assert [owner for owner, _ in got] == [owner for owner, _ in want]
    for (_, g), (_, w) in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("widths", sorted(WIDTHS))
def test_ring_allgather(world, widths, overlap):
    world.run(ring_matches_ref, widths, overlap)


def gather_matches_ref(comm, rank, root):
    root %= comm.num_devices
    blocks = rank_blocks(comm.num_devices, 2, WIDTHS["uneven"])
    got = gather(Group.world(comm, rank), blocks[rank], root=root)
    want = gather_ref(blocks, root=root)[rank]
    if want is None:
        assert got is None
    else:
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("root", [0, 1, 2])
def test_gather(world, root):
    world.run(gather_matches_ref, root)


def back_to_back_gathers_stay_apart(comm, rank):
    """A rank may send its block of the next gather before the root has finished this one."""
    for round_ in range(5):
        got = gather(Group.world(comm, rank), np.array([rank, round_]))
        if got is not None:
            assert [g.tolist() for g in got] == [[r, round_] for r in range(comm.num_devices)]


def test_consecutive_gathers(world):
    world.run(back_to_back_gathers_stay_apart)


def test_consecutive_gathers_under_chaos():
    for seed in range(10):
        run_threads(4, back_to_back_gathers_stay_apart, chaos=Chaos(seed=seed, max_delay=0.003))


def gather_rows_stacks_in_rank_order(comm, rank):
    rows = np.full((rank % 3, 4), rank, dtype=np.int32)  # some ranks have no rows
    got = gather_rows(Group.world(comm, rank), rows)
    if rank == 0:
        want = np.concatenate([np.full((r % 3, 4), r, dtype=np.int32) for r in range(comm.num_devices)])
        np.testing.assert_array_equal(got, want)
        assert got.dtype == np.int32


def test_gather_rows(world):
    world.run(gather_rows_stacks_in_rank_order)


def streamed_rows_equal_gathered_rows(comm, rank, m):
    """C's rows computed panel by panel and streamed to rank 0 == the rows gathered whole; the same bytes."""
    group, before = Group.world(comm, rank), mark(comm, rank)
    lo, hi = block_range(m, comm.num_devices, rank)
    mine = np.arange(lo * 3, hi * 3, dtype=np.float64).reshape(-1, 3)  # row r holds 3r, 3r + 1, 3r + 2
    c, rows = result_rows(group, (m, 3), np.float64)
    panels = []

    def compute(panel):
        panels.append(panel)
        rows[panel] = mine[panel]

    got = stream_rows(group, rows, compute, out=c)
    assert np.concatenate([rows[p] for p in panels]).tolist() == mine.tolist()  # every row computed once
    sizes = [(b - a) * 3 * 8 for a, b in (block_range(m, comm.num_devices, r) for r in range(comm.num_devices))]
    assert sent_and_received(comm, rank, before) == gather_bytes(sizes, rank)
    if rank == 0:
        np.testing.assert_array_equal(got, np.arange(m * 3, dtype=np.float64).reshape(m, 3))
    else:
        assert got is None


@pytest.mark.parametrize("m", [2, 700, 2000])  # ranks without rows; one panel; several panels (128+ rows each)
def test_stream_rows(world, m):
    world.run(streamed_rows_equal_gathered_rows, m)


def gather_rows_refuses_wrong_columns(comm, rank):
    rows = np.zeros((1, 4 if rank == 0 else 5))
    if rank == 0 and comm.num_devices > 1:
        with pytest.raises(CommError, match="expected a row block of 4 columns of float64 from rank 1"):
            gather_rows(Group.world(comm, rank), rows)
    else:
        gather_rows(Group.world(comm, rank), rows)


def test_gather_rows_names_a_rank_that_sent_the_wrong_shape(world):
    world.run(gather_rows_refuses_wrong_columns)


def nobody_leaves_the_barrier_before_everyone_entered(comm, rank):
    """Ranks enter at staggered times; every exit must come after the last entry.

    Uses the wall clock, which all ranks on one machine share.
    """
    time.sleep(0.02 * rank)
    entered = time.time()
    barrier(Group.world(comm, rank))
    left = time.time()
    times = gather(Group.world(comm, rank), np.array([entered, left]))
    if times is not None:
        assert max(t[0] for t in times) <= min(t[1] for t in times)


def test_barrier(world):
    world.run(nobody_leaves_the_barrier_before_everyone_entered)


def only_the_root_works_and_nobody_leaves_before_it_is_done(comm, rank):
    """alone_at_root: the work's result at the root only, and every rank leaves after the work ended."""
    group = Group.world(comm, rank)
    result = alone_at_root(group, lambda: (time.sleep(0.05), time.time())[1])
    left = time.time()
    ends = gather(group, np.array([left, -1.0 if result is None else result]))
    if ends is not None:
        assert [e[1] > 0 for e in ends] == [True] + [False] * (len(ends) - 1)
        assert min(e[0] for e in ends) >= ends[0][1]


def test_alone_at_root(world):
    world.run(only_the_root_works_and_nobody_leaves_before_it_is_done)


# The collectives on a Group: each against its reference, and its traffic against its cost, to the byte.

ROWS = {
    "even": lambda r, d: 3,
    "uneven": lambda r, d: 1 + r % 3,
    "some-empty": lambda r, d: r % 2,
    "large": lambda r, d: 700,
}  # large: 700 x 2 float64 = 11 KB per rank, past the eager limit


def partials(size, rows, dtype=np.float64, seed=0):
    """Every rank's full array (sum of `rows` per rank, 2 columns), the same on every rank."""
    n = sum(ROWS[rows](r, size) for r in range(size))
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((n, 2)).astype(dtype) + r for r in range(size)]


def sent_and_received(comm, rank, before):
    traffic = comm.traffic(rank)
    return traffic.bytes_sent() - before[0], traffic.bytes_received() - before[1]


def mark(comm, rank):
    traffic = comm.traffic(rank)
    return traffic.bytes_sent(), traffic.bytes_received()


def all_gather_matches(comm, rank, rows):
    world, size = Group.world(comm, rank), comm.num_devices
    counts = [ROWS[rows](r, size) for r in range(size)]
    blocks = [np.full((c, 2), r, dtype=np.int32) for r, c in enumerate(counts)]
    before = mark(comm, rank)
    got = all_gather(world, blocks[rank], counts)
    np.testing.assert_array_equal(got, all_gather_ref(blocks)[rank])
    assert sent_and_received(comm, rank, before) == all_gather_bytes(counts, rank, 2 * 4)


@pytest.mark.parametrize("rows", sorted(ROWS))
def test_all_gather(world, rows):
    world.run(all_gather_matches, rows)


def reduce_scatter_matches(comm, rank, rows, dtype):
    world, size = Group.world(comm, rank), comm.num_devices
    arrays = partials(size, rows, dtype)
    before = mark(comm, rank)
    got = reduce_scatter(world, arrays[rank])
    np.testing.assert_array_equal(got, reduce_scatter_ref(arrays)[rank])  # bitwise: the same order of sums
    counts = block_sizes(arrays[0].shape[0], size)
    assert sent_and_received(comm, rank, before) == reduce_scatter_bytes(counts, rank, 2 * np.dtype(dtype).itemsize)


@pytest.mark.parametrize("rows", sorted(ROWS))
@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.int64])
def test_reduce_scatter(world, rows, dtype):
    world.run(reduce_scatter_matches, rows, dtype)


def all_reduce_is_bitwise_identical(comm, rank, rows):
    """Floats: every rank gets the very same bits, equal to the reference's, and within rounding of the sum."""
    world, size = Group.world(comm, rank), comm.num_devices
    arrays = [a * 1e3 ** (np.arange(a.size).reshape(a.shape) % 3) for a in partials(size, rows, seed=7)]
    before = mark(comm, rank)
    got = all_reduce(world, arrays[rank])
    assert sent_and_received(comm, rank, before) == all_reduce_bytes(got.size, size, rank, 8)
    want = all_reduce_ref(arrays)[rank]
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(got, sum(arrays), rtol=1e-12)
    everyone = gather(world, got)
    if everyone is not None:
        assert all(e.tobytes() == got.tobytes() for e in everyone)


@pytest.mark.parametrize("rows", sorted(ROWS))
def test_all_reduce(world, rows):
    world.run(all_reduce_is_bitwise_identical, rows)


def broadcast_matches(comm, rank, root, nbytes):
    world, size = Group.world(comm, rank), comm.num_devices
    root %= size
    data = np.arange(nbytes // 8, dtype=np.float64).reshape(-1, 1)
    before = mark(comm, rank)
    got = broadcast(world, data if rank == root else None, root=root)
    np.testing.assert_array_equal(got, broadcast_ref(data, size)[rank])
    assert sent_and_received(comm, rank, before) == broadcast_bytes(data.nbytes, size, rank, root)


@pytest.mark.parametrize("root", [0, 1, 3])
@pytest.mark.parametrize("nbytes", [8, 16_000])
def test_broadcast(world, root, nbytes):
    world.run(broadcast_matches, root, nbytes)


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 13])
@pytest.mark.parametrize("root", [0, 2])
def test_broadcast_tree_reaches_every_rank_once(size, root):
    root %= size
    parents = broadcast_parents_ref(size, root)
    children = [tree_children(r, size, root) for r in range(size)]
    assert sorted(c for cs in children for c in cs) == sorted(set(range(size)) - {root})
    for r, cs in enumerate(children):
        assert all(parents[c] == r for c in cs)
    assert len(children[root]) == (size - 1).bit_length()  # the root sends ceil(log2 D) times


def all_to_all_matches(comm, rank):
    """All-to-all-v: rank q sends rank r a (q + r) x 2 block (some empty)."""
    world, size = Group.world(comm, rank), comm.num_devices
    blocks = [[np.full((q + r, 2), 10 * q + r, dtype=np.float32) for r in range(size)] for q in range(size)]
    before = mark(comm, rank)
    got = all_to_all(world, blocks[rank])
    for g, w in zip(got, all_to_all_ref(blocks)[rank], strict=True):
        np.testing.assert_array_equal(g, w)
    sizes = [[b.nbytes for b in row] for row in blocks]
    assert sent_and_received(comm, rank, before) == all_to_all_bytes(sizes, rank)


def test_all_to_all(world):
    world.run(all_to_all_matches)


def all_to_all_into_matches(comm, rank):
    """The same exchange into preallocated blocks (Ulysses' form): nothing allocated, the same bytes."""
    world, size = Group.world(comm, rank), comm.num_devices
    blocks = [[np.full((q + r, 2), 10 * q + r, dtype=np.float32) for r in range(size)] for q in range(size)]
    out = [np.full((q + rank, 2), -1, dtype=np.float32) for q in range(size)]
    before = mark(comm, rank)
    all_to_all_into(world, blocks[rank], out)
    for g, w in zip(out, all_to_all_ref(blocks)[rank], strict=True):
        np.testing.assert_array_equal(g, w)
    assert sent_and_received(comm, rank, before) == all_to_all_bytes([[b.nbytes for b in row] for row in blocks], rank)


def test_all_to_all_into(world):
    world.run(all_to_all_into_matches)


def ring_shift_matches(comm, rank):
    """Ring attention's step: every rank's block one hop on; blocks of different sizes (uneven K/V blocks)."""
    world, size = Group.world(comm, rank), comm.num_devices
    blocks = [np.arange(3 * (r + 1), dtype=np.float64) + 100 * r for r in range(size)]
    out = np.empty(3 * ((rank - 1) % size + 1))
    before = mark(comm, rank)
    ring_shift(world, blocks[rank], out)
    np.testing.assert_array_equal(out, ring_shift_ref(blocks)[rank])
    assert sent_and_received(comm, rank, before) == ring_shift_bytes([b.nbytes for b in blocks], rank)


def test_ring_shift(world):
    world.run(ring_shift_matches)


def consecutive_collectives_stay_apart(comm, rank):
    """Back to back, a fast rank's next collective can never be taken for this one's."""
    world = Group.world(comm, rank)
    for round_ in range(4):
        x = np.full(5, float(rank + round_))
        np.testing.assert_array_equal(all_reduce(world, x), sum(r + round_ for r in range(comm.num_devices)))
        got = all_gather(world, np.array([rank, round_]).reshape(1, 2))
        assert got.tolist() == [[r, round_] for r in range(comm.num_devices)]
        assert broadcast(world, x if rank == 0 else None).tolist() == [float(round_)] * 5


def test_consecutive_collectives(world):
    world.run(consecutive_collectives_stay_apart)


def test_consecutive_collectives_under_chaos():
    for seed in range(6):
        run_threads(4, consecutive_collectives_stay_apart, chaos=Chaos(seed=seed, max_delay=0.002))


def test_all_to_all_needs_one_block_per_rank():
    with pytest.raises(RankFailure, match="all_to_all needs one block per rank"):
        run_threads(2, lambda comm, rank: all_to_all(Group.world(comm, rank), [np.zeros(1)]))


def started_equals_blocking(comm, rank):
    """The started forms give the blocking forms' results and bytes; an all-gather and a reduce-scatter in
    flight on one group at once, progressed in turn between "compute panels", stay apart by their tags."""
    from spmd.collectives.ring import start_all_gather, start_all_reduce, start_reduce_scatter

    world, size = Group.world(comm, rank), comm.num_devices
    counts = [1 + (r % 3) for r in range(size)]
    block = np.full((counts[rank], 3), float(rank + 1))
    stack = np.arange(size * 5 * 2, dtype=np.float64).reshape(size * 5, 2) * (rank + 1)
    before = mark(comm, rank)
    blocking = (all_gather(world, block, counts), reduce_scatter(world, stack), all_reduce(world, stack))
    blocking_bytes = sent_and_received(comm, rank, before)
    before = mark(comm, rank)
    gather_h = start_all_gather(world, block, counts)
    scatter_h = start_reduce_scatter(world, stack)
    for _ in range(3):  # compute panels, with progress between them
        np.dot(np.ones(200), np.ones(200))
        gather_h.progress()
        scatter_h.progress()
    started = (gather_h.wait(), scatter_h.wait(), start_all_reduce(world, stack).wait())
    assert sent_and_received(comm, rank, before) == blocking_bytes
    for got, want in zip(started, blocking, strict=True):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(
        started[0], all_gather_ref([np.full((c, 3), float(r + 1)) for r, c in enumerate(counts)])[rank]
    )


def test_started_collectives_equal_the_blocking_ones(world):
    world.run(started_equals_blocking)
