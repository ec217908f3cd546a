"""The planner's predictions at small scale equal what runs measure: bytes per mesh axis and memory by kind."""

import dataclasses
import subprocess
import sys

import numpy as np
import pytest

from spmd.collectives import gather
from spmd.model.kernels import MEMORY_KINDS
from spmd.plan.estimate import Cluster, Model, inside_a_node, plan
from spmd.train import TRAINERS
from spmd.transport.group import TAGS_PER_CONTEXT, Group
from spmd.transport.mesh import Mesh

# float64 runs, so the planner's scaling from its float32 evaluation is exercised too
MODEL = Model(layers=4, hidden=6, ffn=10, tokens=11, element_bytes=8, microbatches=3)


def measured(comm, rank, estimate):
    """(max over ranks of bytes sent per axis, memory by kind of the rank holding the most), at rank 0."""
    trainer, world = TRAINERS[estimate.strategy], Group.world(comm, rank)
    mlp = dataclasses.replace(MODEL.mlp(trainer, estimate.mesh.size if trainer.microbatched else 1), dtype="float64",
                              steps=1)
    before = dict(comm.traffic(rank).sent_bytes)
    engine = trainer.build(world, estimate.mesh, mlp)
    engine.step(*mlp.batch(0))
    sent = {axis: 0 for axis in estimate.mesh.names}
    for (dst, tag), nbytes in comm.traffic(rank).sent_bytes.items():
        for axis in sent:
            if tag // TAGS_PER_CONTEXT == estimate.mesh.context(axis):
                sent[axis] += nbytes - before.get((dst, tag), 0)
    held = engine.arena.by_kind()
    rows = gather(world, np.array([*sent.values(), *held.values()]))
    if rows is None:
        return None
    rows = np.array(rows)
    axes = len(sent)
    fullest = int(np.argmax(rows[:, axes:].sum(axis=1)))
    return dict(zip(sent, map(int, rows[:, :axes].max(axis=0)), strict=True)), \
        dict(zip(MEMORY_KINDS, map(int, rows[fullest, axes:]), strict=True))


def predictions_hold(comm, rank):
    cluster = Cluster(comm.num_devices, 1e9, 2, 1e9, 1e8, 1e12)
    estimates, refused = plan(MODEL, cluster)
    chunked = {name for name, t in TRAINERS.items() if t.chunked}  # m a multiple of pp only: refused elsewhere
    assert {e.strategy for e in estimates} | {name for name, *_ in refused if name in chunked} == set(TRAINERS)
    for estimate in estimates:
        result = measured(comm, rank, estimate)
        if result is not None:
            sent, held = result
            assert sent == estimate.sent, (estimate.strategy, str(estimate.mesh))
            assert held == estimate.memory, (estimate.strategy, str(estimate.mesh))


def test_the_planner_predicts_measured_bytes_and_memory(world):
    world.run(predictions_hold)


def test_the_planner_flags_what_does_not_fit_and_ranks_the_rest():
    model = Model(layers=8, hidden=64, ffn=256, tokens=64, element_bytes=4)
    dp = plan(model, Cluster(4, 1e12, 4, 1e9, 1e8, 1e12), ["mlp-dp"])[0][0]
    tight = Cluster(4, dp.peak - 1, 4, 1e9, 1e8, 1e12)  # one byte short for DP
    estimates, _ = plan(model, tight)
    assert not next(e for e in estimates if e.strategy == "mlp-dp").fits
    fitting = [e for e in estimates if e.fits]
    assert fitting and all(e.peak <= tight.memory_bytes for e in fitting)
    assert estimates[:len(fitting)] == fitting  # fitting first
    assert [e.step_seconds for e in fitting] == sorted(e.step_seconds for e in fitting)


def test_mesh_axes_inside_a_node():
    mesh = Mesh({"fsdp": 8, "tp": 8})
    assert inside_a_node(mesh, "tp", 8) and not inside_a_node(mesh, "fsdp", 8)
    assert not inside_a_node(Mesh({"fsdp": 4, "tp": 16}), "tp", 8)


def test_the_command_answers_the_problem_statements_example():
    run = subprocess.run([sys.executable, "-m", "spmd.plan", "--layers", "93", "--hidden", "16384", "--seq", "4096",
                          "--batch", "8", "--devices", "64", "--memory-gb", "80"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "399 GB" in run.stdout  # the statement's 400 GB model
    assert "fastest: mlp-fsdp-tp on fsdp=8,tp=8" in run.stdout  # FSDP across nodes, TP inside one


@pytest.mark.parametrize("argv, words", [
    (["--layers", "2", "--hidden", "4", "--seq", "1", "--batch", "1", "--devices", "0"], "--devices must be >= 1"),
    (["--layers", "2", "--hidden", "4", "--seq", "1", "--batch", "1", "--devices", "4", "--memory-gb", "0"],
     "--memory-gb must be a number > 0"),
])
def test_bad_planner_input_is_refused(argv, words):
    run = subprocess.run([sys.executable, "-m", "spmd.plan", *argv], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and words in run.stderr
