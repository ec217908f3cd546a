"""Attention's batched kernel (spmd.model.attention): query blocks against only the keys they see, sequences and
heads a group at a time, P packed. Checked against attention written the plain way, one (sequence, head) at a
time in float64, at block sizes and score limits that make uneven blocks and groups; its scratch is all it
holds (no ufunc temporaries beyond numpy's small buffers); and the whole LM at tiny blocks equals the oracle."""

from __future__ import annotations

import tracemalloc
from types import SimpleNamespace

import numpy as np
import pytest

from spmd.model import Net, attention
from spmd.model.attention import SoftmaxAttention
from spmd.model.llama_reference import reference_run
from spmd.parallel.context import core_named
from tests.test_lm import SMALL, run_lm


def plain(q, k, v, do, seq: int, d: int):
    """O, dQ, dK, dV of causal softmax attention, one sequence and head at a time."""
    outs = [np.zeros_like(q) for _ in range(4)]
    mask = np.triu(np.full((seq, seq), -np.inf), 1)
    for b in range(q.shape[0] // seq):
        for j in range(q.shape[1] // d):
            rows, cols = slice(b * seq, (b + 1) * seq), slice(j * d, (j + 1) * d)
            qb, kb, vb, dob = q[rows, cols], k[rows, cols], v[rows, cols], do[rows, cols]
            s = qb @ kb.T / np.sqrt(d) + mask
            p = np.exp(s - s.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            dp = dob @ vb.T
            ds = p * (dp - (dp * p).sum(axis=1, keepdims=True)) / np.sqrt(d)
            for out, value in zip(outs, (p @ vb, ds @ kb, ds.T @ qb, p.T @ dob), strict=True):
                out[rows, cols] = value
    return outs


def batched(math: SoftmaxAttention, sequences: int, q, k, v, do):
    """O, dQ, dK, dV from the kernel, in arrays of its own shapes; and the bytes numpy took beyond them."""
    s = SimpleNamespace(**{name: np.zeros(shape) for name, shape in math.scratch_shapes(sequences).items()})
    math.prepare(s)
    probs = np.zeros(math.probs_shape(sequences)["p"]) if math.keep_probs else None
    o, dq, dk, dv = (np.zeros_like(q) for _ in range(4))
    tracemalloc.start()
    try:
        math.attend(q, k, v, o, probs, s)
        math.attend_backward(q, k, v, do, dq, dk, dv, probs, s)
        extra = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return (o, dq, dk, dv), extra


@pytest.mark.parametrize(
    "sequences, heads, seq, d, block, limit, keep",
    [
        (3, 2, 7, 4, 3, 1 << 21, True),  # blocks of 3, 3, 1 rows
        (3, 2, 7, 4, 3, 1 << 21, False),
        (5, 3, 6, 2, 6, 40, True),  # one block; a step of 1 head and 1 sequence (the limit)
        (4, 4, 9, 3, 4, 80, False),  # 2 heads a step, uneven blocks, P recomputed
        (2, 1, 1, 5, 128, 1 << 21, True),  # one token
    ],
)
def test_the_batched_kernel_equals_attention_one_head_at_a_time(
    monkeypatch, sequences, heads, seq, d, block, limit, keep
):
    monkeypatch.setattr(attention, "SCORE_LIMIT", limit)
    rng = np.random.default_rng(seq * heads + block)
    q, k, v, do = (rng.standard_normal((sequences * seq, heads * d)) for _ in range(4))
    got, _ = batched(SoftmaxAttention(heads, d, seq, keep, block), sequences, q, k, v, do)
    for name, mine, want in zip(("O", "dQ", "dK", "dV"), got, plain(q, k, v, do, seq, d), strict=True):
        np.testing.assert_allclose(mine, want, rtol=1e-12, atol=1e-13, err_msg=name)


def test_the_kept_probabilities_hold_only_the_causal_blocks():
    """P packed: a block of queries against the keys up to its last row, not seq^2."""
    math = SoftmaxAttention(heads=4, head_size=8, seq=256, keep_probs=True, block=64)
    assert math.probs_shape(2)["p"] == (2, 4 * 64 * (64 + 128 + 192 + 256))
    assert math.packed < 4 * 256**2 * 0.7


@pytest.mark.parametrize("keep", [True, False])
def test_the_kernel_allocates_nothing_the_memory_model_does_not_see(keep):
    """Every step's elementwise work is on contiguous scratch; what numpy takes beyond it is its small ufunc
    buffers (the composed runs' peak slack), not a step's scores."""
    sequences, heads, seq, d = 4, 4, 300, 16
    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((sequences * seq, heads * d)) for _ in range(4))
    math = SoftmaxAttention(heads, d, seq, keep)
    _, extra = batched(math, sequences, q, k, v, do)
    assert extra < 256 * 1024 < 8 * math.tiles.score_size(sequences), extra


@pytest.mark.parametrize(
    "mesh, layout",
    [
        ("dp=1", {}),
        ("dp=1", {"recompute": "selective"}),
        ("cp=2,tp=2", {"cp": core_named("ulysses")}),
        ("fsdp=2", {"zero": 3}),
    ],
)
def test_the_lm_at_tiny_query_blocks_equals_the_oracle(monkeypatch, mesh, layout):
    """Blocks of 2 query rows in sequences of 5 (blocks 2, 2, 1) and one head a step: the whole LM's losses and
    weights are the single-device oracle's."""
    monkeypatch.setattr(attention, "QUERY_BLOCK", 2)
    monkeypatch.setattr(attention, "SCORE_LIMIT", 10)
    net = Net(**{**SMALL, "steps": 2})
    ref = reference_run(net)
    for losses, _, engine in run_lm(mesh, layout, net):
        np.testing.assert_allclose(losses, ref.losses, rtol=1e-12)
        for unit, index, values in engine.owned():
            np.testing.assert_allclose(values, ref.units[unit][index], rtol=1e-10, atol=1e-14)
