"""The Llama-style language model under the composed engine: what only an LM has.

The generic composition tests (test_composition.py) take the LM through the registry like every model: losses
and every parameter against the single-device reference, bytes per axis and memory by kind against the closed
form, on threads and under mpiexec. Here: every copy of a replicated parameter bitwise equal to the others
after every step (norm gains across tp, dense weights across data ranks, the tied weight across the first and
last stage: the class of bugs behind Megatron #1446, #619, torchtitan #2387), an uneven vocabulary over tp
(Megatron #1754: a loss 47 off), the global gradient norm counted once over the mesh, the loss falling on
learnable tokens, and refusals that name the flag.
"""

import json
import subprocess
import sys

import numpy as np
import pytest

from spmd.collectives import gather
from spmd.model import Net
from spmd.model.llama_reference import reference_run
from spmd.model.registry import spec_of
from spmd.parallel.context import core_named
from spmd.parallel.strategy import Composition
from spmd.transport.group import Group
from spmd.transport.mesh import Mesh
from spmd.transport.threads import run_threads

SMALL = dict(model="llama", layers=4, hidden=8, ffn=12, heads=4, kv_heads=2, vocab=11, seq=5, batch=5, steps=3)


def run_lm(mesh: str, layout: dict, net: Net, each_step=None):
    """Train `net` on `mesh` on threads; per rank (losses, each step's `each_step(engine)`, engine)."""

    def body(comm, rank):
        strategy, world = Composition(**layout), Group.world(comm, rank)
        m = strategy.validate(net, world.size, Mesh.parse(mesh))
        engine = strategy.build(world, m, net)
        losses, seen = [], []
        for step in range(net.steps):
            losses.append(engine.step(*net.batch_data(step)))
            if each_step is not None:
                seen.append(each_step(engine))
        return losses, seen, engine

    return run_threads(Mesh.parse(mesh).size, body, timeout=120)


def held_values(engine) -> np.ndarray:
    """Rows [unit, global index, value] of every parameter this rank holds (the compute copies: what the
    forward uses), a tied head's as its embedding's."""
    tied = {b: a for a, b in spec_of(engine.net).tied(engine.net)}
    rows = []
    for i, unit in enumerate(engine.layers):
        index = engine.layout.tensor_index(engine.net, engine.rank, unit)
        held = engine.units[i].take(index) if engine.sharding.params else index
        rows.append(
            np.stack(
                [np.full(held.size, tied.get(unit, unit)), held, engine.state.params[i].astype(np.float64)], axis=1
            )
        )
    return np.concatenate(rows)


def copies_agree(rows: list[np.ndarray], step: int) -> int:
    """Every (unit, index) held more than once has one value, bitwise; returns how many copies were compared."""
    seen: dict[tuple[int, int], float] = {}
    copies = 0
    for held in rows:
        for unit, index, value in held.tolist():
            key = (int(unit), int(index))
            if key in seen:
                copies += 1
                assert np.float64(seen[key]).tobytes() == np.float64(value).tobytes(), (
                    f"after step {step}: unit {key[0]} element {key[1]} differs between its copies"
                )
            seen[key] = value
    return copies


REPLICATED = [  # one or more cases at every world size the tests run (threads 1-4, mpiexec 2, 3, 4, 8)
    ("dp=1", {}, {"tie_embeddings": True}),  # embedding and head on one rank: one weight, two units
    ("tp=2", {"sp": True}, {}),  # gains over tp (their gradients summed over tp under SP)
    ("tp=2", {"sp": True}, {"experts": 4, "aux_loss": 0.01, "capacity_factor": 1.0}),  # the router over tp
    ("pp=2", {}, {"tie_embeddings": True, "microbatches": 2}),  # the tied weight on the first and last stage
    ("tp=3", {"sp": True}, {"heads": 3, "kv_heads": 3, "hidden": 6}),
    ("pp=3", {}, {"tie_embeddings": True, "microbatches": 3, "layers": 3}),
    ("dp=2,tp=2", {}, {}),  # everything across dp
    ("fsdp=2,tp=2", {"zero": 1}, {}),  # ZeRO-1: parameters whole on every fsdp rank, each updates its shard
    ("pp=2,tp=2", {"sp": True}, {"tie_embeddings": True, "microbatches": 2, "vocab": 7}),
    ("cp=2,tp=2", {"cp": core_named("ring")}, {"seq": 6}),  # every weight across cp
    ("dp=4", {}, {"tie_embeddings": True, "optimizer": "adamw", "precision": "bf16", "clip_grad": 0.1}),
    ("pp=2,fsdp=2,tp=2", {"sp": True, "zero": 2}, {"tie_embeddings": True, "microbatches": 2, "batch": 8}),
    ("ep=2", {}, {"experts": 4, "tie_embeddings": True}),  # the dense weights (router included) across ep
    ("ep=2,tp=2", {"sp": True}, {"experts": 4, "aux_loss": 0.01}),  # the router across ep and tp with SP
    ("pp=2,ep=2,tp=2", {"sp": True}, {"experts": 8, "microbatches": 2, "batch": 8}),
    ("fsdp=2,ep=2", {"zero": 2}, {"experts": 4, "batch": 8}),  # ZeRO-2: parameters whole across fsdp x ep
    ("fsdp=2,ep=2,tp=2", {"zero": 3, "sp": True}, {"experts": 8, "batch": 8}),  # FSDP over ep: gains across tp
]


def replicas_after_every_step(comm, rank, mesh, layout, fields):
    net = Net(**{**SMALL, **fields})
    strategy, world = Composition(**layout), Group.world(comm, rank)
    engine = strategy.build(world, strategy.validate(net, world.size, Mesh.parse(mesh)), net)
    copies = 0
    for step in range(net.steps):
        engine.step(*net.batch_data(step))
        every = gather(world, held_values(engine))
        if every is not None:
            copies += copies_agree(every, step + 1)
    assert rank != 0 or copies > 0  # the layout does replicate something


def test_every_copy_of_a_replicated_parameter_is_bitwise_equal_after_every_step(world):
    cases = [c for c in REPLICATED if Mesh.parse(c[0]).size == world.size]
    assert cases, f"no case of {world.size} ranks"
    for mesh, layout, fields in cases:
        world.run(replicas_after_every_step, mesh, layout, fields)


@pytest.mark.parametrize("mesh, vocab, heads, kv", [("tp=2", 7, 4, 2), ("tp=3", 257, 3, 3), ("tp=4", 5, 4, 4)])
def test_an_uneven_vocabulary_over_tp_gives_the_one_device_loss(mesh, vocab, heads, kv):
    """Megatron #1754: a vocabulary not divisible by tp made the loss 47 off. Here 7 over 2, 257 over 3, 5 over 4
    (a rank of one row): the losses and the final weights are one device's."""
    net = Net(**{**SMALL, "vocab": vocab, "heads": heads, "kv_heads": kv, "hidden": 2 * heads, "steps": 2})
    ref = reference_run(net)
    for losses, _, engine in run_lm(mesh, {"sp": True}, net):
        np.testing.assert_allclose(losses, ref.losses, rtol=1e-12)
        for unit, index, values in engine.owned():
            np.testing.assert_allclose(values, ref.units[unit][index], rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize(
    "mesh, layout",
    [
        ("pp=2,tp=2", {"sp": True}),
        ("dp=2,fsdp=2", {"zero": 2}),
        ("cp=2,tp=2", {"cp": core_named("ulysses")}),
        ("fsdp=2,ep=2", {"zero": 3}),
    ],
)
def test_the_global_gradient_norm_counts_every_parameter_once(mesh, layout):
    """Clipping's norm over the whole mesh equals one device's (a replicated gain summed tp times, or a weight
    summed over its data replicas, would not); with a tied weight across stages counted once."""
    experts = {"experts": 4} if "ep=" in mesh else {}  # over ep: the dense weights once, each expert once
    net = Net(
        **{**SMALL, "seq": 6, "batch": 8, "tie_embeddings": True, "clip_grad": 0.02, "microbatches": 2, **experts}
    )
    ref = reference_run(net)
    assert min(ref.grad_norms) > net.clip_grad  # every step is clipped
    for losses, norms, _ in run_lm(mesh, layout, net, lambda engine: engine.state.grad_norm):
        np.testing.assert_allclose(norms, ref.grad_norms, rtol=1e-12)
        np.testing.assert_allclose(losses, ref.losses, rtol=1e-12)


def test_the_loss_falls_on_learnable_tokens_under_a_real_layout():
    """The bigram chain has 3 successors a token: from log V toward log 3, here on fsdp x tp with AdamW, a
    warmup and a cosine schedule."""
    net = Net(
        **{
            **SMALL,
            "vocab": 16,
            "hidden": 16,
            "ffn": 32,
            "seq": 8,
            "batch": 8,
            "steps": 30,
            "optimizer": "adamw",
            "lr": 1e-2,
            "lr_schedule": "cosine",
            "warmup": 3,
        }
    )
    losses = run_lm("fsdp=2,tp=2", {"sp": True}, net)[0][0]
    assert losses[0] == pytest.approx(np.log(16), abs=0.05)
    assert np.mean(losses[-3:]) < np.log(16) - 0.6


@pytest.mark.parametrize(
    "fields, mesh, words",
    [
        ({"kv_heads": 2}, "tp=4", "--kv-heads 2 is fewer than tp=4"),
        ({"vocab": 3, "kv_heads": 4}, "tp=4", "--vocab 3 is smaller than tp=4"),
        ({"heads": 4, "kv_heads": 3}, "dp=1", "--kv-heads 3 must divide --heads 4"),
        ({"hidden": 12, "heads": 4}, "dp=1", "RoPE rotates pairs"),
        ({"rope_base": 0.0}, "dp=1", "--rope-base must be a number > 0"),
        ({"lr_schedule": "cosine", "lr_min": -0.1}, "dp=1", r"--lr-min must be in \[0, --lr"),
        ({"lr_min": 0.1}, "dp=1", "--lr-min is where --lr-schedule cosine ends"),
        ({"model": "transformer", "kv_heads": 2, "vocab": 64}, "dp=1", "--kv-heads: the language model's"),
        ({"model": "mlp", "tie_embeddings": True, "kv_heads": 0}, "dp=1", "--tie-embeddings: the language model's"),
    ],
)
def test_an_lm_that_cannot_be_split_is_refused_naming_the_flag(fields, mesh, words):
    with pytest.raises(ValueError, match=words):
        net = Net(**{**SMALL, **fields})
        Composition().validate(net, Mesh.parse(mesh).size, Mesh.parse(mesh))


def test_the_cli_trains_the_lms_uneven_tied_layout():
    """The issue's uneven-vocabulary command, tied weight across stages, on threads (the README runs it under
    mpirun)."""
    command = [
        sys.executable,
        "-m",
        "spmd",
        "train",
        "--model",
        "llama",
        "--mesh",
        "pp=2,tp=2",
        "--tie-embeddings",
        "--vocab",
        "257",
        "--kv-heads",
        "2",
        "--devices",
        "4",
        "--check",
        "--quiet",
        "--json",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["ok"] and report["bytes_match_model"] and report["memory_match_model"]


@pytest.mark.parametrize("unit", [0, 2, 6])
def test_a_nan_anywhere_in_the_lm_fails_the_run_naming_the_step(unit):
    """A NaN in the embedding, a block or the head makes the step's loss NaN on every rank (the loss is summed
    over the mesh), and check_finite ends the run there."""
    from spmd.harness.loop import NonFiniteError, check_finite

    net = Net(**{**SMALL, "steps": 1})

    def body(comm, rank):
        strategy, world = Composition(sp=True), Group.world(comm, rank)
        mesh = strategy.validate(net, world.size, Mesh.parse("pp=2,tp=2"))
        engine = strategy.build(world, mesh, net)
        if unit in engine.layers:
            engine.state.params[engine.layers.index(unit)][0] = np.nan
        loss = engine.step(*net.batch_data(0))
        with pytest.raises(NonFiniteError, match="step 1: the loss is nan"):
            check_finite(engine, loss, 1, rank)
        return loss

    assert all(np.isnan(loss) for loss in run_threads(4, body, timeout=60))


def test_the_python_api_trains_any_composition_and_returns_what_it_measured():
    """spmd.train(model=..., mesh=..., **config): losses and final units as one device's; per rank the bytes per
    mesh axis and the memory by kind the closed form gives; the gradient norms when clipping."""
    import spmd

    fields = {**SMALL, "tie_embeddings": True, "clip_grad": 0.05, "microbatches": 2, "vocab": 13}
    del fields["model"]
    run = spmd.train(model="llama", mesh="pp=2,tp=2", sp=True, **fields)
    ref = reference_run(run.net)
    np.testing.assert_allclose(run.losses, ref.losses, rtol=1e-12)
    np.testing.assert_allclose(run.grad_norms, ref.grad_norms, rtol=1e-12)
    for mine, theirs in zip(run.units, ref.units, strict=True):
        np.testing.assert_allclose(mine, theirs, rtol=1e-10, atol=1e-14)
    cost = Composition(sp=True).cost(run.net, run.mesh)
    for rank, (axes, held) in enumerate(zip(run.traffic, run.memory, strict=True)):
        assert held == cost.memory[rank]
        for axis in run.mesh.names:
            assert axes[axis] == (cost.traffic[rank].sent[axis], cost.traffic[rank].received[axis]), axis
        assert axes["world"] == (cost.traffic[rank].sent["world"], cost.traffic[rank].received["world"])


def test_a_run_that_cannot_fit_is_refused_before_any_rank_starts():
    """The exact memory model against the machine (or --memory-limit): one line, exit 2, no rank started."""
    big = run_cli(
        "train",
        "--model",
        "llama",
        "--hidden",
        "4096",
        "--layers",
        "8",
        "--ffn",
        "16384",
        "--heads",
        "32",
        "--devices",
        "2",
        "--memory-limit",
        "20",
    )
    net = Net(model="llama", hidden=4096, layers=8, ffn=16384, heads=32)
    fullest = max(sum(m.values()) for m in Composition().cost(net, Mesh.parse("dp=2")).memory) / 2**30
    assert big.returncode == 2 and f"needs {fullest:.2f} GiB on its fullest rank" in big.stderr, big.stderr
    assert "20.00 GiB is --memory-limit 20 GiB" in big.stderr and big.stderr.count("\n") == 1
    small = run_cli("train", "--model", "llama", "--devices", "2", "--memory-limit", "0.1", "--quiet")
    assert small.returncode == 0, small.stderr


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "spmd", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "model, flags",
    [
        ("mlp", ["--clip-grad", "0.001"]),
        ("transformer", ["--lr-schedule", "cosine", "--warmup", "2", "--steps", "4", "--clip-grad", "0.01"]),
    ],
)
def test_clipping_and_schedules_are_checked_on_every_model(model, flags):
    """The dense models' reference clips and schedules as the engine does: --check passes."""
    done = run_cli("train", "--model", model, "--mesh", "dp=2", "--devices", "2", *flags, "--check", "--quiet")
    assert done.returncode == 0, done.stdout + done.stderr


def test_ropes_angles_are_fp32_under_mixed_precision():
    """A bf16 angle at position 1000 would be 0.2 off: the angles are kept in the state dtype (fp32)."""
    net = Net(**{**SMALL, "seq": 1200, "batch": 1, "precision": "bf16", "layers": 1})

    def body(comm, rank):
        strategy, world = Composition(), Group.world(comm, rank)
        engine = strategy.build(world, strategy.validate(net, 1, Mesh.parse("dp=1")), net)
        _, _, scratch = engine.bind(0, 0, 0, net.batch_data(0))
        return scratch.cos.copy(), scratch.sin.copy()

    cos, sin = run_threads(1, body)[0]
    theta = net.rope_base ** (-2 * np.arange(net.head_size // 2) / net.head_size)
    angle = np.arange(1200)[:, None] * theta[None, :]
    assert cos.dtype == np.float32
    half = theta.size  # head 0's channels: cos on both halves, sin signed (-, +) for the half-split pairing
    for got, want in (
        (cos[:, :half], np.cos(angle)),
        (cos[:, half : 2 * half], np.cos(angle)),
        (sin[:, :half], -np.sin(angle)),
        (sin[:, half : 2 * half], np.sin(angle)),
    ):
        np.testing.assert_allclose(got, want, atol=2e-4)
