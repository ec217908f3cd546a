"""The GPT-2-style model: its oracle checked on its own (every gradient against finite differences, the tied and
the position tables), one device against the oracle, GPT-2 124M's parameter count from the spec, the flags a
GPT-2 refuses, and generation with its key/value cache (the oracle's logits, seeded text, its positions' limit).
The layouts are test_composition's (gpt2 is in its model list)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from spmd.data.prepare import prepare
from spmd.model.config import Net
from spmd.model.decode import generate
from spmd.model.gpt2 import initial_unit
from spmd.model.gpt2_reference import block_views, loss_and_grads, reference_train
from spmd.model.registry import parameters
from spmd.model.shapes import PRESETS
from spmd.parallel.strategy import Composition
from spmd.plan.__main__ import main as plan_main
from spmd.transport.group import Group
from spmd.transport.mesh import Mesh
from spmd.transport.threads import run_threads

TINY = dict(model="gpt2", layers=2, hidden=8, heads=2, ffn=12, vocab=11, seq=5, batch=3)


def noisy_units(net: Net) -> list[np.ndarray]:
    """The initial units plus noise (the biases start at 0): every gradient large enough to resolve."""
    rng = np.random.default_rng(1)
    units = [initial_unit(net, u) for u in range(net.layers + 3)]
    return [u + 0.3 * rng.standard_normal(u.shape) for u in units]


def probes(net: Net, unit: int, rng: np.random.Generator) -> np.ndarray:
    """Two flat indices of each piece of a block; a few anywhere in the other units (positions included)."""
    index = np.arange(initial_unit(net, unit).size)
    if 1 <= unit <= net.layers:
        parts = block_views(index, net.hidden, net.ffn, net.hidden)
        return np.concatenate([rng.choice(part.ravel(), 2, replace=False) for part in parts])
    positions = index[net.vocab * net.hidden :]
    picks = rng.choice(index[: net.vocab * net.hidden] if unit else index, 6, replace=False)
    return np.concatenate([picks, rng.choice(positions, 3, replace=False)]) if positions.size else picks


def difference(net, units, ids, targets, unit: int, i: int, eps: float = 1e-6) -> float:
    values = []
    for sign in (1, -1):
        moved = [u.copy() for u in units]
        moved[unit][i] += sign * eps
        values.append(loss_and_grads(net, moved, ids, targets)[0])
    return (values[0] - values[1]) / (2 * eps)


@pytest.mark.parametrize("tied", [False, True])
def test_the_oracles_gradients_match_finite_differences(tied):
    """Each unit's own use: a tied head's gradient is its use as the head (its position rows 0)."""
    net = Net(**TINY, tie_embeddings=tied)
    units = noisy_units(net)
    ids, targets = net.batch_data(0)
    _, grads = loss_and_grads(net, units, ids, targets)
    rng = np.random.default_rng(2)
    for unit in range(net.layers + 3):
        index = probes(net, unit, rng)
        numeric = np.array([difference(net, units, ids, targets, unit, i) for i in index])
        analytic = grads[unit][index]
        assert np.linalg.norm(numeric - analytic) <= 1e-6 * np.linalg.norm(analytic) + 1e-9, f"unit {unit}"


def test_one_device_equals_the_oracle_and_the_loss_starts_at_log_vocab():
    net = Net(**TINY, steps=3, tie_embeddings=True, optimizer="adamw", clip_grad=0.05)
    ref_losses, ref_units = reference_train(net)
    assert abs(ref_losses[0] - np.log(net.vocab)) < 0.05 and ref_losses[-1] < ref_losses[0]

    def rank(comm, r):
        strategy = Composition()
        mesh = strategy.validate(net, 1, Mesh.parse("dp=1"))
        engine = strategy.build(Group.world(comm, r), mesh, net)
        losses = [engine.step(*net.batch_data(step)) for step in range(net.steps)]
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-10)
        for unit, index, values in engine.owned():
            np.testing.assert_allclose(values, ref_units[unit][index], rtol=1e-10, atol=1e-12)

    run_threads(1, rank, timeout=60)


def test_gpt2_124m_has_its_published_parameter_count():
    """124,439,808 with the head tied (OpenAI's GPT-2 small, as nanoGPT counts it with its position table)."""
    fields = PRESETS["gpt2-124m"][1]
    assert parameters(Net(**fields)) == 124_439_808
    assert parameters(Net(**{**fields, "tie_embeddings": False})) == 124_439_808 + 50257 * 768


def test_the_planner_prints_gpt2_124m(capsys):
    assert plan_main(["--model", "gpt2", "--preset", "gpt2-124m"]) == 0
    out = capsys.readouterr().out
    assert (
        "parameters: 124 M (124,439,808)" in out
        and "positions (seq x h)                                          786,432" in out
    )


@pytest.mark.parametrize(
    "fields, words",
    [
        (dict(kv_heads=1), "--kv-heads: the Llama's"),
        (dict(experts=4), "--experts: the Llama's"),
        (dict(rope_base=500000.0), "--rope-base: the Llama's"),
        (dict(hidden=9), "--hidden 9 must be a multiple of --heads 2"),
    ],
)
def test_a_gpt2_refuses_the_llamas_flags_naming_them(fields, words):
    with pytest.raises(ValueError, match=words):
        Net(**{**TINY, **fields})


def test_the_kv_cache_decoder_gives_the_oracles_loss_and_its_own_logits_token_by_token():
    """Read at once, the GPT-2 decoder's logits give the single-device oracle's loss on the same tokens (learned
    positions, LayerNorm, GELU, the tied head); read token by token through the cache, the same logits."""
    net = Net(**{**TINY, "seq": 9, "batch": 1})
    units = noisy_units(net)
    ids = np.random.default_rng(3).integers(0, net.vocab, 10)
    logits = net.spec.decoder(net, units).read(ids[:9])
    shifted = logits - logits.max(axis=1, keepdims=True)
    losses = np.log(np.exp(shifted).sum(axis=1)) - shifted[np.arange(9), ids[1:]]
    assert float(losses.mean()) == pytest.approx(loss_and_grads(net, units, ids[:9], ids[1:])[0], rel=1e-12)
    decoder = net.spec.decoder(net, units)
    stepped = [decoder.read(ids[:4])] + [decoder.read(ids[i : i + 1]) for i in range(4, 9)]
    np.testing.assert_allclose(np.concatenate(stepped), logits, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="the model has 9 positions"):
        decoder.read(ids[:1])  # a tenth position was never trained


def test_the_same_seed_gives_the_same_tokens_past_a_full_context():
    """30 tokens from a 5-position model: the context is started again from its newest half several times."""
    net = Net(**TINY)
    units = noisy_units(net)
    first = generate(net, units, np.array([1, 2]), 30, temperature=1.0, seed=5)
    assert first == generate(net, units, np.array([1, 2]), 30, temperature=1.0, seed=5)
    assert first != generate(net, units, np.array([1, 2]), 30, temperature=1.0, seed=6)
    assert all(0 <= t < net.vocab for t in first)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A GPT-2 trained 2 steps on a small prepared corpus (bytes: 257 tokens), saved."""
    text = tmp_path_factory.mktemp("text")
    for i in range(12):
        (text / f"doc{i:02d}.txt").write_text("the cat sat on the mat. " * (2 + i % 3))
    corpus = tmp_path_factory.mktemp("corpus")
    prepare([str(text)], str(corpus), val_fraction=0.2)
    ckpt = tmp_path_factory.mktemp("ckpt") / "ck"
    done = cli("train", "--model", "gpt2", "--data", str(corpus), *SMALL, "--steps", "2", "--save", str(ckpt))
    assert done.returncode == 0, done.stderr
    return ckpt


SMALL = ("--layers", "2", "--hidden", "16", "--ffn", "32", "--heads", "2", "--seq", "16", "--batch", "4", "--quiet")


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "spmd", *args], capture_output=True, text=True, timeout=300)


def test_generate_samples_a_gpt2_checkpoint_the_same_for_the_same_seed(checkpoint):
    flags = ("generate", "--load", str(checkpoint), "--prompt", "the ", "--max-tokens", "40", "--seed", "3")
    first, again = cli(*flags), cli(*flags)
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("the ") and len(first.stdout) > len("the \n") and first.stdout == again.stdout


def test_generate_refuses_a_prompt_longer_than_the_gpt2s_positions_in_one_line(checkpoint):
    done = cli("generate", "--load", str(checkpoint), "--prompt", "x" * 17)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().count("\n") == 0 and "17 tokens, more than the model's 16 positions" in done.stderr
