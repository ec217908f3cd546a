"""Every registered training strategy, one set of checks, on threads (1-4 ranks) and under mpiexec.

Each rank runs its strategy's steps of the MLP and checks: the loss and every
parameter it holds equal the single-device reference (bitwise with integer data,
within rounding with floats); bytes sent and received == the closed form to the
byte; the arrays it holds by kind == the closed form; the process's peak memory
== the closed form. A new preset in spmd.trainers.presets.PRESETS is checked with no new test code.
"""

import numpy as np
import pytest
from mlp_oracle import reference_train
from peak_check import assert_peak_matches, peak_of_steps

from spmd.model.config import Net
from spmd.trainers.presets import PRESETS
from spmd.transport.group import TAGS_PER_CONTEXT, Group
from spmd.transport.mesh import Mesh

MEMORY_SLACK = 128 * 1024  # Python objects beside the arrays (traffic counters, requests, collectives' steps):
# up to 74 KiB a rank seen (4 ranks on threads, the interleaved pipeline: the whole process over 4), and 102-104
# KiB for one rank on threads late in a long pytest worker (2 of about 10 full runs); every array is > 128 KiB


def mesh_for(trainer, size: int) -> Mesh | None:
    """The 1-D default, or for a 2-D strategy: the last axis 2 wide when the world is even."""
    if len(trainer.axes) == 1:
        return None
    inner = 2 if size % 2 == 0 else 1
    return Mesh({trainer.axes[0]: size // inner, trainer.axes[1]: inner})


def shapes(trainer, size: int, **fields) -> Net:
    """Uneven on purpose: 7 tokens, f = 5, h = 3 split over 2-4 ranks; 3 micro-batches for pipelines.
    Interleaved pipelines: 2 chunks a rank, so at least 2 x size layers, and 2 x size micro-batches (where a
    slot outlives its activations: schedules.executor_slots)."""
    base = dict(layers=4, hidden=3, ffn=5, batch=7, microbatches=3 if trainer.pipelined else 1)
    merged = {**base, **fields}
    if trainer.chunked:
        merged.update(
            chunks=2 if size > 1 else 1,
            microbatches=2 * size,
            layers=max(merged["layers"], 2 * size),
            batch=max(merged["batch"], 2 * size),
        )
        if merged.get("integers"):  # 8 layers of h 3, f 5 could pass 2^53 (MLP refuses): narrower layers
            merged.update(hidden=2, ffn=3)
    return trainer.net(**merged)


def train(comm, rank, name, mlp):
    """This rank's engine after mlp.steps steps, with the losses, the mesh and the reference."""
    trainer = PRESETS[name]
    world = Group.world(comm, rank)
    mesh = trainer.validate(mlp, world.size, mesh_for(trainer, world.size))
    engine = trainer.composition.build(world, mesh, mlp)
    losses = [engine.step(*mlp.batch_data(step)) for step in range(mlp.steps)]
    return engine, losses, mesh


def exact_step(comm, rank, name):
    mlp = shapes(PRESETS[name], comm.num_devices, integers=True, steps=1, lr=2.0**-6, momentum=0.5)
    engine, losses, mesh = train(comm, rank, name, mlp)
    ref_losses, ref_layers = reference_train(mlp)
    assert losses == ref_losses
    for layer, index, values in engine.owned():
        np.testing.assert_array_equal(values, ref_layers[layer][index], err_msg=f"layer {layer}")
    cost, traffic = PRESETS[name].composition.cost(mlp, mesh), comm.traffic(rank)
    assert traffic.bytes_sent() == cost.bytes_sent[rank]
    assert traffic.bytes_received() == cost.bytes_received[rank]
    for axis in mesh.names:  # each mesh axis's group sends in its own tag context
        context = mesh.context(axis)
        sent = sum(b for (_, tag), b in traffic.sent_bytes.items() if tag // TAGS_PER_CONTEXT == context)
        received = sum(b for (_, tag), b in traffic.received_bytes.items() if tag // TAGS_PER_CONTEXT == context)
        assert (sent, received) == (cost.traffic[rank].sent[axis], cost.traffic[rank].received[axis]), axis
    assert engine.arena.by_kind() == cost.memory[rank]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_one_step_is_exact_and_bytes_and_memory_equal_the_model(world, name):
    world.run(exact_step, name)


def float_steps(comm, rank, name, dtype):
    mlp = shapes(PRESETS[name], comm.num_devices, hidden=6, ffn=11, batch=13, steps=3, dtype=dtype)
    engine, losses, mesh = train(comm, rank, name, mlp)
    ref_losses, ref_layers = reference_train(mlp)
    rtol = 1e-4 if dtype == "float32" else 1e-11
    np.testing.assert_allclose(losses, ref_losses, rtol=rtol)
    assert ref_losses[-1] < ref_losses[0]  # it learns
    for layer, index, values in engine.owned():
        np.testing.assert_allclose(values, ref_layers[layer][index], rtol=rtol, atol=rtol, err_msg=f"layer {layer}")
    assert comm.traffic(rank).bytes_sent() == PRESETS[name].composition.cost(mlp, mesh).bytes_sent[rank] * mlp.steps


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_several_float_steps_match_the_reference(world, name, dtype):
    world.run(float_steps, name, dtype)


def peak_memory(comm, rank, name, one_rank_per_process):
    """tracemalloc's peak over the steps == the model (MPI: per rank; threads: the sum, every rank held)."""
    world = Group.world(comm, rank)
    # a layer's weights (192 KiB) and a whole batch's activations (192 KiB) > MEMORY_SLACK
    mlp = shapes(PRESETS[name], comm.num_devices, layers=4, hidden=64, ffn=192, batch=384, steps=1)
    batches = [mlp.batch_data(step) for step in range(mlp.steps)]
    trainer = PRESETS[name]
    mesh = trainer.validate(mlp, world.size, mesh_for(trainer, world.size))
    model = trainer.composition.cost(mlp, mesh).peak_bytes  # before the measure: it fills the layout's caches
    peak = peak_of_steps(world, lambda: trainer.composition.build(world, mesh, mlp), batches, one_rank_per_process)
    assert_peak_matches(world, peak, model, one_rank_per_process, MEMORY_SLACK)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_peak_memory_equals_the_model(world, name):
    world.run(peak_memory, name, world.one_rank_per_process)
