"""The sampler's controls (temperature, top-k, top-p) in float64 on hand-made logits, and the seeds of
several samples from one prompt."""

import numpy as np
import pytest

from spmd.model.decode import nucleus, probabilities, sample, sample_rng

RNG = np.random.default_rng(2024)
LOGITS = [RNG.normal(scale=3.0, size=257) for _ in range(20)]  # no ties: one argmax each


@pytest.mark.parametrize("logits", LOGITS[:5])
def test_top_p_tiny_top_k_one_and_temperature_zero_all_take_the_most_likely(logits):
    best = int(np.argmax(logits))
    for seed in range(20):
        assert sample(logits.copy(), 0.8, 0, 1e-9, sample_rng(seed)) == best
        assert sample(logits.copy(), 1.5, 1, 1.0, sample_rng(seed)) == best
        assert sample(logits.copy(), 0.0, 40, 0.5, sample_rng(seed)) == best


def test_top_p_keeps_exactly_the_nucleus_and_renormalizes_it():
    """p = .40 .25 .15 .10 .06 .04 (shuffled): top_p .75 keeps the first three (.80 >= .75 > .65), .30 one,
    .90 four; the ids drawn over many seeds are that set, every one of it."""
    p = np.array([0.04, 0.25, 0.10, 0.40, 0.06, 0.15])
    logits = np.log(p) + 7.0  # a shift changes nothing
    for top_p, want in ((0.75, {3, 1, 5}), (0.30, {3}), (0.90, {3, 1, 5, 2}), (1.0, set(range(6)))):
        q = probabilities(logits, 1.0, 0, top_p)
        assert set(np.flatnonzero(q)) == want
        np.testing.assert_allclose(q[list(want)], p[list(want)] / p[list(want)].sum(), rtol=1e-12)
        drawn = {sample(logits, 1.0, 0, top_p, sample_rng(seed)) for seed in range(400)}
        assert drawn == want


def test_the_nucleus_comes_after_temperature_and_top_k_and_breaks_ties_by_id():
    logits = np.log(np.array([0.5, 0.3, 0.2]))
    assert set(np.flatnonzero(probabilities(logits, 1.0, 0, 0.75))) == {0, 1}
    assert set(np.flatnonzero(probabilities(logits, 100.0, 0, 0.75))) == {0, 1, 2}  # nearly flat: all three
    assert set(np.flatnonzero(probabilities(logits, 100.0, 2, 0.75))) == {0, 1}  # top-k first, then p
    assert set(np.flatnonzero(nucleus(np.array([0.25, 0.5, 0.25]), 0.75))) == {0, 1}  # a sum of exactly P stops
    assert set(np.flatnonzero(nucleus(np.array([0.2, 0.2, 0.2, 0.2, 0.2]), 0.5))) == {0, 1, 2}


def test_temperature_and_top_k_are_todays_draws():
    """Without top-p, the same draws as before it existed: softmax(logits / T) over the top k, numpy's choice."""
    for logits in LOGITS:
        for seed in range(5):
            scaled = logits / 0.7
            scaled[scaled < np.sort(scaled)[-40]] = -np.inf
            p = np.exp(scaled - scaled.max())
            want = int(np.random.default_rng(seed).choice(257, p=p / p.sum()))
            assert sample(logits.copy(), 0.7, 40, 1.0, sample_rng(seed)) == want


def test_sample_zero_is_the_seeds_own_stream_and_other_samples_are_their_own():
    firsts = {seed: np.random.default_rng(seed).random(4).tolist() for seed in range(5)}
    streams = [tuple(sample_rng(seed, i).random(4)) for seed in range(5) for i in range(5)]
    assert len(set(streams)) == 25
    assert all(list(sample_rng(seed).random(4)) == firsts[seed] for seed in range(5))
    assert tuple(sample_rng(3, 2).random(4)) == tuple(sample_rng(3, 2).random(4))
