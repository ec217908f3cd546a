"""Generation routes a mixture of experts as training and validation did: the trained balancing bias chooses the
experts (DeepSeek-V3 keeps it at inference) and a capacity drops the pairs a validation sequence drops, so the
decoder's logits give the engine's validation loss, for every routing option."""

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import spmd
from spmd.data.loader import Corpus
from spmd.data.prepare import prepare
from spmd.harness.generate import load_units
from spmd.model.decode import Decoder
from spmd.trainers import checkpoint

SHAPE = {
    "layers": 2,
    "hidden": 8,
    "ffn": 12,
    "heads": 2,
    "seq": 8,
    "batch": 4,
    "experts": 4,
    "optimizer": "adamw",
    "lr": 0.05,
}
# the routing options, pairwise: the score, top-k, renormalized gates, capacity, the bias, the aux loss, the gate
ROUTINGS = [
    ("ep=2", {"router": "softmax", "top_k": 2, "bias_balance": 0.05}),
    ("dp=2", {"router": "sigmoid", "top_k": 1, "capacity_factor": 1.0, "bias_balance": 0.05}),
    (
        "fsdp=2",
        {
            "router": "softmax",
            "top_k": 2,
            "renormalize": False,
            "capacity_factor": 1.25,
            "aux_loss": 0.01,
            "expert_activation": "gelu",
        },
    ),
    (
        "ep=2,tp=2",
        {
            "router": "sigmoid",
            "top_k": 2,
            "capacity_factor": 1.0,
            "aux_loss": 0.01,
            "bias_balance": 0.1,
            "expert_activation": "gelu",
        },
    ),
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("text")
    for i in range(30):
        (root / f"doc{i:02d}.py").write_text(f"def f{i}(a, b):\n    return a * {i} + b\n" * (1 + i % 4))
    out = tmp_path_factory.mktemp("corpus")
    prepare([str(root)], str(out), val_fraction=0.25)
    return out


def decoded_loss(net, units, biases, corpus: Path, tokens: int) -> float:
    """The mean next-token loss of the validation batches as the decoder reads them, one sequence at a time."""
    losses = []
    for x, target in Corpus(corpus, net.seq, net.batch, net.seed).eval_batches(tokens):
        for ids, want in zip(np.asarray(x).reshape(-1, net.seq), np.asarray(target).reshape(-1, net.seq), strict=True):
            logits = Decoder(net, units, biases).read(ids)
            shifted = logits - logits.max(axis=1, keepdims=True)
            losses.append(np.log(np.exp(shifted).sum(axis=1)) - shifted[np.arange(len(ids)), want])
    return float(np.mean(losses))


@pytest.mark.parametrize("mesh, routing", ROUTINGS, ids=[m for m, _ in ROUTINGS])
def test_the_decoders_logits_give_the_validation_loss_for_every_routing_option(corpus, mesh, routing):
    """After 3 steps (the bias moved), the decoder's loss on the validation sequences is the engine's validation
    loss on the mesh (float64, 1e-12); with the bias or the capacity left out it is not; token by token through
    the cache, the same logits as the whole sequence at once."""
    run = spmd.train(
        model="llama",
        mesh=mesh,
        sp="tp" in mesh,
        data=str(corpus),
        steps=3,
        eval_every=3,
        eval_tokens=64,
        **SHAPE,
        **routing,
    )
    assert [step for step, _ in run.validation] == [3]
    decoded = decoded_loss(run.net, run.units, run.biases, corpus, 64)
    assert decoded == pytest.approx(run.validation[0][1], rel=1e-12)
    if routing.get("bias_balance"):
        assert sorted(run.biases) == [1, 2] and all(np.any(b != 0) for b in run.biases.values())
        assert decoded_loss(run.net, run.units, {}, corpus, 64) != pytest.approx(decoded, rel=1e-9)
    if routing.get("capacity_factor"):  # the capacity drops pairs here: routing without it gives other logits
        dropless = replace(run.net, capacity_factor=0.0)
        assert decoded_loss(dropless, run.units, run.biases, corpus, 64) != pytest.approx(decoded, rel=1e-9)
    ids = np.asarray(Corpus(corpus, 8, 4, 0).eval_batches(32)[0][0])[:8]
    whole = Decoder(run.net, run.units, run.biases).read(ids)
    decoder = Decoder(run.net, run.units, run.biases)
    stepped = [decoder.read(ids[:3])] + [decoder.read(ids[i : i + 1]) for i in range(3, len(ids))]
    np.testing.assert_allclose(np.concatenate(stepped), whole, rtol=1e-10, atol=1e-12)


def test_generate_reads_the_trained_bias_from_the_checkpoint(corpus, tmp_path):
    """python -m spmd train --bias-balance --save; the checkpoint's biases are the run's, and the decoder with them
    gives the report's last validation loss."""
    args = [
        "--model",
        "llama",
        "--data",
        str(corpus),
        "--mesh",
        "ep=2",
        "--steps",
        "3",
        "--eval-every",
        "3",
        "--eval-tokens",
        "64",
        "--layers",
        "2",
        "--hidden",
        "8",
        "--ffn",
        "12",
        "--heads",
        "2",
        "--seq",
        "8",
        "--batch",
        "4",
        "--experts",
        "4",
        "--top-k",
        "2",
        "--bias-balance",
        "0.05",
        "--optimizer",
        "adamw",
        "--lr",
        "0.05",
        "--capacity-factor",
        "1.0",
    ]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "spmd",
            "train",
            *args,
            "--save",
            str(tmp_path / "ck"),
            "--json",
            str(tmp_path / "run.json"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    net, units, biases, _ = load_units(checkpoint.latest(str(tmp_path / "ck")))
    assert sorted(biases) == [1, 2] and all(np.any(b != 0) for b in biases.values())
    report = json.loads((tmp_path / "run.json").read_text())
    assert decoded_loss(net, units, biases, corpus, 64) == pytest.approx(report["validation"][-1]["loss"], rel=1e-10)
