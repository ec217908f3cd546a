"""The single-device Llama oracle checked on its own: hand-written gradients against finite differences, RoPE's
relative-position property, a loss that starts at log V and falls, clipping, the learning-rate schedule, NaNs."""

from __future__ import annotations

import math

import numpy as np
import pytest

from spmd.model.config import Net
from spmd.model.llama import initial_unit
from spmd.model.llama_reference import (
    combined_grads,
    global_norm,
    loss_and_grads,
    reference_run,
    reference_train,
    rope,
    rope_tables,
    views,
)

TINY = {
    "model": "llama",
    "layers": 2,
    "hidden": 8,
    "heads": 4,
    "kv_heads": 2,
    "ffn": 12,
    "vocab": 11,
    "seq": 5,
    "batch": 3,
    "dtype": "float64",
}
BLOCK_KINDS = ("g1", "wq", "wk", "wv", "wo", "g2", "w1", "w3", "w2")


def tiny(**changes) -> Net:
    return Net(**{**TINY, **changes})


def initial_units(net: Net) -> list[np.ndarray]:
    return [initial_unit(net, u) for u in range(net.layers + 3)]


def noisy_units(net: Net, seed: int = 1) -> list[np.ndarray]:
    """The initial units plus noise: gradients large enough for finite differences to resolve every one."""
    rng = np.random.default_rng(seed)
    return [u + 0.3 * rng.standard_normal(u.shape) for u in initial_units(net)]


def probe_coordinates(net: Net, unit: int, ids: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A handful of flat indices of a unit: two of each block kind, embedding rows the batch uses, any others."""
    if unit == 0:
        rows = rng.choice(np.unique(ids), 4)
        return rows * net.hidden + rng.integers(0, net.hidden, 4)
    if 1 <= unit <= net.layers:
        index = np.arange(initial_unit(net, unit).size)
        parts = views(index, net, moe=False)
        return np.concatenate([rng.choice(part.ravel(), 2, replace=False) for part in parts])
    return rng.choice(initial_unit(net, unit).size, 4, replace=False)


def finite_difference(net, units, ids, targets, changed: list[int], index: int, eps: float = 1e-6) -> float:
    """Central difference of the loss in coordinate `index` of the units `changed` (moved together)."""
    values = []
    for sign in (1, -1):
        moved = [u.copy() for u in units]
        for unit in changed:
            moved[unit][index] += sign * eps
        values.append(loss_and_grads(net, moved, ids, targets)[0])
    return (values[0] - values[1]) / (2 * eps)


def relative_error(numeric: np.ndarray, analytic: np.ndarray) -> float:
    return float(np.linalg.norm(numeric - analytic) / np.linalg.norm(analytic))


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_gradients_match_finite_differences(kv_heads):
    net = tiny(kv_heads=kv_heads)
    units = noisy_units(net)
    ids, targets = net.batch_data(0)
    _, grads = loss_and_grads(net, units, ids, targets)
    rng = np.random.default_rng(2)
    for unit in range(net.layers + 3):
        index = probe_coordinates(net, unit, ids, rng)
        numeric = np.array([finite_difference(net, units, ids, targets, [unit], i) for i in index])
        assert relative_error(numeric, grads[unit][index]) < 1e-6, f"unit {unit}"


def test_tied_embedding_gradient_is_the_sum_of_both_uses():
    net = tiny(tie_embeddings=True)
    units = noisy_units(net)
    units[-1] = units[0].copy()  # the head is the embedding
    ids, targets = net.batch_data(0)
    _, grads = loss_and_grads(net, units, ids, targets)
    tied = combined_grads(net, grads)[0]
    assert len(combined_grads(net, grads)) == net.layers + 2  # the head is not a unit of its own
    index = probe_coordinates(net, 0, ids, np.random.default_rng(3))
    numeric = np.array([finite_difference(net, units, ids, targets, [0, net.layers + 2], i) for i in index])
    assert relative_error(numeric, tied[index]) < 1e-6
    np.testing.assert_allclose(tied, grads[0] + grads[-1])


def test_rope_scores_depend_only_on_relative_positions():
    d, seq, shift = 8, 6, 37
    rng = np.random.default_rng(4)
    q, k = rng.standard_normal((seq, d)), rng.standard_normal((seq, d))

    def scores(start: int) -> np.ndarray:
        cos, sin = rope_tables(np.arange(start, start + seq), d, 10000.0)
        return rope(q, cos, sin) @ rope(k, cos, sin).T

    np.testing.assert_allclose(scores(shift), scores(0), rtol=1e-12, atol=1e-12)
    # the half-split pairing: channel 0 turns into channel d/2 by angle position x base^0
    cos, sin = rope_tables(np.arange(seq), d, 10000.0)
    np.testing.assert_allclose(rope(rope(q, cos, sin), cos, -sin), q)  # the backward undoes it
    cos, sin = rope_tables(np.array([1.0]), 4, 10000.0)
    np.testing.assert_allclose(rope(np.array([[1.0, 0, 0, 0]]), cos, sin), [[math.cos(1), 0, math.sin(1), 0]])


def test_loss_starts_at_log_vocab_and_falls():
    net = tiny(optimizer="adamw", lr=1e-2, steps=60, seq=8, batch=8)
    ids, targets = net.batch_data(0)
    loss, _ = loss_and_grads(net, initial_units(net), ids, targets)
    assert abs(loss - math.log(net.vocab)) < 0.05
    losses, units = reference_train(net)
    assert losses[0] == pytest.approx(loss)
    assert np.mean(losses[-5:]) < math.log(net.vocab) - 0.5
    assert len(units) == net.layers + 3


def test_clipping_scales_the_update_and_norms_count_the_tied_weight_once():
    net = tiny(tie_embeddings=True, optimizer="sgd", momentum=0.0, lr=0.3, clip_grad=1e-3, steps=1)
    start = initial_units(net)
    _, grads = loss_and_grads(net, start, *net.batch_data(0))
    applied = combined_grads(net, grads)
    norm = float(np.sqrt(sum(np.sum(g * g) for g in applied)))
    assert global_norm(applied) == pytest.approx(norm, rel=1e-12)
    run = reference_run(net)
    assert run.grad_norms[0] == pytest.approx(norm, rel=1e-12)
    assert norm > net.clip_grad  # the clip acts
    scale = net.clip_grad / (norm + 1e-6)
    for unit, grad in zip([0, *range(1, net.layers + 2)], applied, strict=True):
        np.testing.assert_allclose(start[unit] - run.units[unit], net.rate_at(1) * scale * grad, rtol=1e-9, atol=1e-15)
    np.testing.assert_array_equal(run.units[0], run.units[-1])


def test_learning_rate_schedule():
    net = tiny(lr=1.0, lr_schedule="cosine", warmup=2, lr_min=0.1, steps=10)
    assert net.rate_at(1) == pytest.approx(0.5)
    assert net.rate_at(2) == pytest.approx(1.0)
    assert net.rate_at(6) == pytest.approx(0.55)  # half way down the cosine
    assert net.rate_at(10) == pytest.approx(0.1)
    # the run steps with the scheduled rate: SGD without momentum moves by rate_at(1) x g
    one = tiny(lr=0.8, warmup=4, momentum=0.0, steps=1)
    _, grads = loss_and_grads(one, initial_units(one), *one.batch_data(0))
    moved = initial_unit(one, 1) - reference_run(one).units[1]
    np.testing.assert_allclose(moved, 0.2 * grads[1], rtol=1e-9)


@pytest.mark.parametrize("unit", [0, 1, 4])
def test_a_nan_weight_makes_the_loss_nan(unit):
    net = tiny()
    units = initial_units(net)
    ids, targets = net.batch_data(0)
    units[unit][int(ids[0]) * net.hidden if unit == 0 else units[unit].size - 1] = np.nan
    loss, _ = loss_and_grads(net, units, ids, targets)
    assert math.isnan(loss)


def test_mixed_precision_follows_float64():
    losses64, _ = reference_train(tiny(optimizer="adamw", lr=1e-2, steps=3))
    run = reference_run(tiny(optimizer="adamw", lr=1e-2, steps=3, precision="bf16"))
    assert all(u.dtype == np.float32 for u in run.units)  # the fp32 master weights
    np.testing.assert_allclose(run.losses, losses64, atol=0.05)
