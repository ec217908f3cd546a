"""DP and FSDP give a @ b for any shape, rank count and numeric dtype, on both backends."""

import numpy as np
import pytest

from spmd import dp_mat_mul, dp_rank, fsdp_mat_mul, fsdp_rank
from spmd.collectives import Tag
from spmd.layout import block_range
from spmd.matmul import STRATEGIES
from spmd.transport.group import Group
from strategy_run import run_strategy

SHAPES = [(8, 6, 4), (7, 5, 11), (1, 1, 1), (2, 9, 3), (0, 4, 3), (5, 0, 2), (4, 3, 0), (33, 17, 65)]
DTYPES = [np.float64, np.float32, np.complex128, np.int64, np.int8, np.bool_]


def make(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind in "biu":
        return rng.integers(0, 2 if dtype is np.bool_ else 5, shape).astype(dtype)
    imaginary = 1j * rng.standard_normal(shape) if dtype is np.complex128 else 0
    return (rng.standard_normal(shape) + imaginary).astype(dtype)


def assert_product(c, a, b):
    want = a @ b
    assert c.shape == want.shape and c.dtype == want.dtype
    if want.dtype.kind in "biu":
        np.testing.assert_array_equal(c, want)  # integers: exact
    else:
        tolerance = 10 * np.finfo(want.dtype).eps
        np.testing.assert_allclose(c, want, rtol=tolerance, atol=tolerance)


def strategy_gives_product(comm, rank, name, shape, dtype):
    m, k, n = shape
    a, b = make((m, k), dtype, 1), make((k, n), dtype, 2)  # the same on every rank
    c, _, _ = run_strategy(comm, rank, STRATEGIES[name], a, b)
    if rank == 0:
        assert_product(c, a, b)
    else:
        assert c is None


@pytest.mark.parametrize("name", sorted(STRATEGIES))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_shapes(world, name, shape):
    world.run(strategy_gives_product, name, shape, np.float64)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_dtypes(world, name, dtype):
    world.run(strategy_gives_product, name, (7, 5, 6), dtype)


def dp_stacks_rows_of_unknown_count(comm, rank, shape):
    """dp_rank without m_rows: rank 0 stacks whatever rows arrive."""
    m, k, n = shape
    a, b = make((m, k), np.float64, 1), make((k, n), np.float64, 2)
    c = dp_rank(Group.world(comm, rank), a[slice(*block_range(m, comm.num_devices, rank))], b)
    if rank == 0:
        assert_product(c, a, b)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_dp_stacked(world, shape):
    world.run(dp_stacks_rows_of_unknown_count, shape)


def fsdp_without_overlap(comm, rank, shape):
    m, k, n = shape
    a, b = make((m, k), np.float64, 1), make((k, n), np.float64, 2)
    c, _, _ = run_strategy(comm, rank, STRATEGIES["fsdp"], a, b, overlap=False)
    if rank == 0:
        assert_product(c, a, b)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fsdp_without_overlap(world, shape):
    world.run(fsdp_without_overlap, shape)


class RecordingComm:
    """Passes messages through, remembering the (tag, shape) of each one received."""

    tracer = None

    def __init__(self, comm):
        self.comm, self.num_devices, self.received = comm, comm.num_devices, []

    def isend(self, *args, **kwargs):
        return self.comm.isend(*args, **kwargs)

    def irecv(self, dst, src, tag, out):
        self.received.append((tag, out.shape))
        return self.comm.irecv(dst, src, tag, out)


def fsdp_never_receives_more_than_one_shard_at_a_time(comm, rank):
    m, k, n = 6, 4, 10
    size = comm.num_devices
    a, b = make((m, k), np.float64, 1), make((k, n), np.float64, 2)
    spy = RecordingComm(comm)
    a_block, b_shard = a[slice(*block_range(m, size, rank))], b[:, slice(*block_range(n, size, rank))]
    fsdp_rank(Group.world(spy, rank), a_block, b_shard, (m, n))
    ring = [shape for tag, shape in spy.received if tag == Tag.RING]
    widest = -(-n // size)
    assert len(ring) == size - 1  # the D-1 shards it does not own, one message each
    assert all(shape[0] == k and shape[1] <= widest for shape in ring)


def test_fsdp_moves_shards_not_matrices(world):
    world.run(fsdp_never_receives_more_than_one_shard_at_a_time)


@pytest.mark.parametrize("mat_mul", [dp_mat_mul, fsdp_mat_mul])
@pytest.mark.parametrize("devices", [1, 2, 3, 5, 8, 40])
def test_wrappers_on_uneven_and_oversplit_shapes(mat_mul, devices):
    a, b = make((13, 7), np.float64, 3), make((7, 9), np.float64, 4)
    assert_product(mat_mul(a, b, devices), a, b)


@pytest.mark.parametrize("mat_mul", [dp_mat_mul, fsdp_mat_mul])
def test_inputs_are_not_modified(mat_mul):
    a, b = make((6, 4), np.float64, 5), make((4, 5), np.float64, 6)
    a_before, b_before = a.copy(), b.copy()
    mat_mul(a, b, 3)
    np.testing.assert_array_equal(a, a_before)
    np.testing.assert_array_equal(b, b_before)
    assert a.flags.writeable and b.flags.writeable


@pytest.mark.parametrize("mat_mul", [dp_mat_mul, fsdp_mat_mul])
@pytest.mark.parametrize(
    "a, b, devices, error, message",
    [
        (np.ones(3), np.ones((3, 2)), 2, ValueError, "a must be a 2-D matrix, got 1-D"),
        (np.ones((2, 3)), np.ones((2, 3, 1)), 2, ValueError, "b must be a 2-D matrix, got 3-D"),
        (np.ones((2, 3)), np.ones((4, 2)), 2, ValueError, "inner dimensions differ: a is 2x3 but b is 4x2"),
        (np.ones((2, 3)), np.ones((3, 2)), 0, ValueError, "num_devices must be >= 1, got 0"),
        (np.ones((2, 3)), np.ones((3, 2)), 2.0, TypeError, "num_devices must be an int"),
        (np.array([["x"]]), np.ones((1, 1)), 1, TypeError, "a must hold numbers"),
    ],
)
def test_bad_input_is_named_before_any_rank_starts(mat_mul, a, b, devices, error, message):
    with pytest.raises(error, match=message):
        mat_mul(a, b, devices)
