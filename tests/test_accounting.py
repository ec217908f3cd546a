"""Measured traffic equals the closed-form model exactly, for both strategies, on both backends."""

import numpy as np
import pytest

from spmd.collectives import GATHER_TAG, RING_TAG
from spmd.dp import dp_rank
from spmd.fsdp import fsdp_rank
from spmd.layout import block_range
from spmd.model import Problem, bytes_received, bytes_sent, fsdp_ring_bytes_sent

SHAPES = [(8, 6, 4), (7, 5, 11), (2, 3, 1), (33, 17, 65)]


def traffic_matches_model(comm, rank, strategy, shape, dtype):
    m, k, n = shape
    size = comm.num_devices
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((k, n)).astype(dtype)
    a_block = a[slice(*block_range(m, size, rank))]
    if strategy == "dp":
        dp_rank(comm, rank, a_block, b, m_rows=m)
    else:
        fsdp_rank(comm, rank, a_block, b[:, slice(*block_range(n, size, rank))], (m, n))
    p = Problem(m, k, n, size, np.dtype(dtype).itemsize)
    traffic = comm.traffic(rank)
    assert traffic.bytes_sent() == bytes_sent(strategy, p, rank)
    assert traffic.bytes_received() == bytes_received(strategy, p, rank)
    ring_messages = sum(c for (_, tag), c in traffic.sent_messages.items() if tag == RING_TAG)
    assert ring_messages == (size - 1 if strategy == "fsdp" else 0)
    assert traffic.bytes_sent(RING_TAG) == (fsdp_ring_bytes_sent(p, rank) if strategy == "fsdp" else 0)
    gathered = sum(c for (_, tag), c in traffic.sent_messages.items() if tag == GATHER_TAG)
    assert gathered == (0 if rank == 0 else 1)
    if strategy == "fsdp" and size > 1:  # every shard goes to the right neighbour only
        assert {dst for dst, tag in traffic.sent_bytes if tag == RING_TAG} == {(rank + 1) % size}


@pytest.mark.parametrize("strategy", ["dp", "fsdp"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_measured_bytes_equal_the_model(world, strategy, shape, dtype):
    world.run(traffic_matches_model, strategy, shape, dtype)


def even_split_is_the_textbook_formula(comm, rank):
    """(D-1)/D K N s of B per rank for FSDP with even splits."""
    size = comm.num_devices
    m, k, n = 4 * size, 3, 8 * size
    p = Problem(m, k, n, size, 8)
    assert fsdp_ring_bytes_sent(p, rank) * size == (size - 1) * k * n * 8


def test_even_split_formula(world):
    world.run(even_split_is_the_textbook_formula)


def mpi_traffic_is_per_process(comm, rank):
    if comm.num_devices > 1 and hasattr(comm, "rank"):  # the MPI backend
        with pytest.raises(ValueError, match="cannot see the traffic of"):
            comm.traffic((rank + 1) % comm.num_devices)


def test_mpi_rank_sees_only_its_own_traffic(world):
    world.run(mpi_traffic_is_per_process)


def test_message_logs_are_identical_on_threads_and_under_mpiexec(mpiexec):
    """The same rank functions make the same ordered (event, peer, tag, bytes) log per rank on both backends."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    program = str(Path(__file__).parent / "programs" / "message_log.py")
    on_threads = subprocess.run([sys.executable, program, "threads", "3"], capture_output=True, text=True, timeout=60)
    on_mpi = subprocess.run([mpiexec, "-n", "3", sys.executable, program, "mpi"], capture_output=True, text=True,
                            timeout=60)
    assert on_threads.returncode == 0 and on_mpi.returncode == 0, on_threads.stderr + on_mpi.stderr
    logs = json.loads(on_threads.stdout)
    assert logs == json.loads(on_mpi.stdout)
    # and they are the ring's: rank 1 sends B shards right (tag 1) twice, then its C rows to rank 0 (tag 2)
    assert [event[:3] for event in logs["fsdp"][1]] == [
        ["send", 2, 1], ["recv", 0, 1], ["send", 2, 1], ["recv", 0, 1], ["send", 0, 2]]
