"""Traffic accounting: the textbook formula, ring direction, per-process counters, identical logs on both backends.

(Measured bytes == each strategy's cost, for every strategy: test_strategies.py.)"""

import numpy as np
import pytest

from spmd.collectives import Tag
from spmd.matmul.fsdp import FSDP
from spmd.matmul.problem import Problem
from spmd.transport.mesh import Mesh
from strategy_run import run_strategy


def fsdp_even_split_is_the_textbook_formula(comm, rank):
    """(D-1)/D K N s of B per rank for FSDP with even splits, plus its C rows to rank 0."""
    size = comm.num_devices
    m, k, n = 4 * size, 3, 8 * size
    cost = FSDP.cost(Problem(m, k, n, 8), Mesh({"fsdp": size}))
    c_rows = 0 if rank == 0 else 4 * n * 8
    assert (cost.bytes_sent[rank] - c_rows) * size == (size - 1) * k * n * 8


def test_even_split_formula(world):
    world.run(fsdp_even_split_is_the_textbook_formula)


def fsdp_ring_goes_right_only(comm, rank):
    size = comm.num_devices
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((7, 5)), rng.standard_normal((5, 11))
    run_strategy(comm, rank, FSDP, a, b)
    traffic = comm.traffic(rank)
    ring_messages = sum(c for (_, tag), c in traffic.sent_messages.items() if tag == Tag.RING)
    assert ring_messages == size - 1
    if size > 1:
        assert {dst for dst, tag in traffic.sent_bytes if tag == Tag.RING} == {(rank + 1) % size}


def test_fsdp_ring_sends_to_the_right_neighbour_only(world):
    world.run(fsdp_ring_goes_right_only)


def mpi_traffic_is_per_process(comm, rank, one_rank_per_process):
    if comm.num_devices > 1 and one_rank_per_process:  # the counters of other ranks are in their processes
        with pytest.raises(ValueError, match="cannot see the traffic of"):
            comm.traffic((rank + 1) % comm.num_devices)


def test_mpi_rank_sees_only_its_own_traffic(world):
    world.run(mpi_traffic_is_per_process, world.one_rank_per_process)


def test_message_logs_are_identical_on_threads_and_under_mpiexec(mpiexec):
    """The same rank functions make the same ordered (event, peer, tag, bytes) log per rank on both backends."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    program = str(Path(__file__).parent / "programs" / "message_log.py")
    on_threads = subprocess.run([sys.executable, program, "threads", "3"], capture_output=True, text=True, timeout=60)
    on_mpi = subprocess.run(
        [mpiexec, "-n", "3", sys.executable, program, "mpi"], capture_output=True, text=True, timeout=60
    )
    assert on_threads.returncode == 0 and on_mpi.returncode == 0, on_threads.stderr + on_mpi.stderr
    logs = json.loads(on_threads.stdout)
    assert logs == json.loads(on_mpi.stdout)
    # and they are the ring's: rank 1 sends B shards right (tag 1) twice, then its C rows to rank 0 (tag 2)
    assert [event[:3] for event in logs["fsdp"][1]] == [
        ["send", 2, 1],
        ["recv", 0, 1],
        ["send", 2, 1],
        ["recv", 0, 1],
        ["send", 0, 2],
    ]
