"""Property-based: every shape, rank count, dtype and message order gives a @ b.

Runs the rank functions on threads, with and without chaos (random delivery
delays that shuffle the order of messages between senders).
"""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from spmd import run_threads
from spmd.matmul import STRATEGIES
from spmd.transport.threads import Chaos
from strategy_run import run_strategy

DTYPES = [np.float32, np.float64, np.complex128, np.int64]


def product_on_threads(name, a, b, devices, chaos):
    return run_threads(devices, lambda comm, rank: run_strategy(comm, rank, STRATEGIES[name], a, b)[0], chaos=chaos)[0]


@st.composite
def cases(draw):
    m, k, n = (draw(st.integers(0 if i else 1, 12)) for i in range(3))
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind == "i":
        a, b = rng.integers(-50, 50, (m, k)).astype(dtype), rng.integers(-50, 50, (k, n)).astype(dtype)
    else:
        a, b = rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((k, n)).astype(dtype)
    chaos = draw(st.sampled_from([None, Chaos(seed=seed, max_delay=0.0005)]))
    return draw(st.sampled_from(sorted(STRATEGIES))), a, b, draw(st.integers(1, 8)), chaos


@settings(max_examples=400, deadline=None)
@given(cases())
def test_any_case_gives_the_product(case):
    strategy, a, b, devices, chaos = case
    c, want = product_on_threads(strategy, a, b, devices, chaos), a @ b
    assert c.shape == want.shape and c.dtype == want.dtype
    if want.dtype.kind == "i":
        np.testing.assert_array_equal(c, want)
    else:
        tolerance = 10 * np.finfo(want.dtype).eps * max(1, a.shape[1])
        np.testing.assert_allclose(c, want, rtol=tolerance, atol=tolerance)


def test_chaos_shuffles_senders_but_keeps_each_pairs_order():
    orders = set()
    for seed in range(20):

        def rank_fn(comm, rank):
            if rank > 0:
                for i in range(5):
                    comm.send(rank, 0, np.array([rank, i]))
                return None
            return [tuple(comm.recv(0)[1]) for _ in range(5 * (comm.num_devices - 1))]

        got = run_threads(4, rank_fn, chaos=Chaos(seed=seed, max_delay=0.002))[0]
        for sender in (1, 2, 3):
            assert [i for s, i in got if s == sender] == list(range(5))  # pair order kept
        orders.add(tuple(s for s, _ in got))
    assert len(orders) > 1  # but senders interleave differently from run to run
