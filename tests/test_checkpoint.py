"""Checkpoints that reshard and a restart that loses nothing: save under one mesh, kill a rank, load under
another mesh or world size, finish; bitwise where integer mode's proof allows, within the bound otherwise."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from spmd.model import Net
from spmd.parallel.strategy import Composition
from spmd.trainers import checkpoint
from spmd.transport.group import Group
from spmd.transport.mesh import Mesh
from spmd.transport.threads import run_threads

# The largest sizes integer mode proves exact for 2 steps (spmd/model/exact.py): a save after step 1,
# a kill, a resume for step 2 on another mesh, bitwise.
EXACT = [
    "--model",
    "mlp",
    "--layers",
    "3",
    "--hidden",
    "2",
    "--ffn",
    "2",
    "--batch",
    "4",
    "--seq",
    "1",
    "--integers",
    "--lr",
    "0.25",
    "--steps",
    "2",
]


def train(*args, mpi=None, env=None):
    command = [sys.executable, "-m", "spmd", "train", *args]
    if mpi is not None:
        command = [mpi[0], "-n", str(mpi[1]), *command]
    return subprocess.run(command, capture_output=True, text=True, timeout=180, env={**os.environ, **(env or {})})


def report(done) -> dict:
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def steps_with_a_save(comm, rank, root, mesh, net, until, load=False):
    strategy, world = Composition(), Group.world(comm, rank)
    mesh = strategy.validate(net, world.size, Mesh.parse(mesh))
    engine = strategy.build(world, mesh, net)
    first = checkpoint.load(engine, root) if load else 0
    losses = []
    for step in range(first, until):
        losses.append(engine.step(*net.batch_data(step)))
        if step + 1 == 2 and not load:
            checkpoint.save(engine, root, step + 1)
    return losses, [(layer, index.copy(), values.copy()) for layer, index, values in engine.owned()]


@pytest.mark.parametrize("mesh", ["fsdp=2,tp=2", "pp=2,dp=2"])
def test_resumed_on_the_same_mesh_the_run_is_bitwise_the_uninterrupted_one_even_in_bf16(tmp_path, mesh):
    net = Net(
        model="transformer",
        layers=2,
        hidden=16,
        ffn=32,
        heads=4,
        seq=4,
        batch=4,
        steps=4,
        optimizer="adamw",
        precision="bf16",
        microbatches=2 if "pp" in mesh else 1,
    )
    whole = run_threads(4, lambda c, r: steps_with_a_save(c, r, tmp_path, mesh, net, 4))
    resumed = run_threads(4, lambda c, r: steps_with_a_save(c, r, tmp_path, mesh, net, 4, load=True))
    for (losses, owned), (again, owned_again) in zip(whole, resumed, strict=True):
        assert again == losses[2:]  # bitwise: the same floats
        for (layer, index, values), (layer2, index2, values2) in zip(owned, owned_again, strict=True):
            assert layer == layer2 and np.array_equal(index, index2) and np.array_equal(values, values2)


@pytest.mark.parametrize(
    "saved_on, resumed_on, bias",
    [
        ("ep=2", "fsdp=2", 0.0),
        ("dp=2", "ep=2", 0.0),
        ("fsdp=2", "ep=2", 0.05),
        ("fsdp=2,ep=2", "ep=2", 0.05),  # FSDP over ep: the dense weights in fsdp x ep shards, the experts in fsdp's
        ("fsdp=2", "fsdp=2,ep=2", 0.05),
    ],
)
def test_a_mixture_of_experts_saved_over_ep_resumes_without_it_and_back(tmp_path, saved_on, resumed_on, bias):
    """Experts split over ep in the checkpoint's one layout (each expert whole, by unit): steps 3-4 on the other
    mesh give the uninterrupted run's losses and weights (float64, to 1e-12); with --bias-balance the bias is in
    the checkpoint (without it the resumed run would choose experts differently)."""
    net = Net(model="llama", experts=4, layers=2, hidden=8, heads=2, ffn=8, seq=4, batch=4, steps=4, bias_balance=bias)
    saving, resuming = Mesh.parse(saved_on).size, Mesh.parse(resumed_on).size
    whole = run_threads(saving, lambda c, r: steps_with_a_save(c, r, tmp_path, saved_on, net, 4))
    resumed = run_threads(resuming, lambda c, r: steps_with_a_save(c, r, tmp_path, resumed_on, net, 4, load=True))
    np.testing.assert_allclose(resumed[0][0], whole[0][0][2:], rtol=1e-12)
    final = {layer: np.zeros(net.initial_layer(layer).size) for layer, _, _ in whole[0][1]}
    for _, owned in whole:
        for layer, index, values in owned:
            final[layer][index] = values
    for _, owned in resumed:
        for layer, index, values in owned:
            np.testing.assert_allclose(values, final[layer][index], rtol=1e-10, atol=1e-14)


def test_killed_on_threads_then_resumed_on_another_mesh_the_run_is_bitwise(tmp_path):
    """A rank dies as step 2 starts (after the save of step 1): the job fails fast, naming it; restarted on
    pp=3 (3 ranks) and on one device, each finishes bitwise equal to the single-device run (--check with
    integer mode's tolerance 0)."""
    died = train(
        *EXACT,
        "--mesh",
        "fsdp=2,tp=2",
        "--devices",
        "4",
        "--save",
        str(tmp_path),
        "--save-every",
        "1",
        env={"SPMD_FAULT": "1:1"},
    )
    assert died.returncode == 1 and "SPMD_FAULT=1:1: rank 1 dies as step 1 starts" in died.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000001"]
    for mesh, more in (("pp=3", ["--microbatches", "3"]), ("dp=1", [])):
        done = report(
            train(
                *EXACT,
                "--mesh",
                mesh,
                *more,
                "--devices",
                str(Mesh.parse(mesh).size),
                "--load",
                str(tmp_path),
                "--check",
                "--json",
            )
        )
        assert done["first_step"] == 1 and done["ok"] and done["tolerance"] == 0 and done["max_relative_error"] == 0


def test_killed_under_mpi_then_resumed_on_fewer_ranks_the_run_is_bitwise(tmp_path, mpiexec):
    """The rank's process is SIGKILLed (as a lost node): mpiexec ends the job at once; 3 processes finish it."""
    died = train(
        *EXACT,
        "--mesh",
        "fsdp=2,tp=2",
        "--save",
        str(tmp_path),
        "--save-every",
        "1",
        mpi=(mpiexec, 4),
        env={"SPMD_FAULT": "1:1"},
    )
    assert died.returncode != 0
    done = report(
        train(
            *EXACT,
            "--mesh",
            "pp=3",
            "--microbatches",
            "3",
            "--load",
            str(tmp_path),
            "--check",
            "--json",
            mpi=(mpiexec, 3),
        )
    )
    assert done["backend"] == "mpi" and done["first_step"] == 1 and done["ok"] and done["max_relative_error"] == 0


def test_the_issues_bf16_run_resumed_on_a_pipeline_matches_the_uninterrupted_one_within_the_bound(tmp_path):
    """AdamW in bf16: 4 steps under fsdp=2,tp=2 (saving at 2 and 4), then steps 5-6 under pp=3 with 3
    micro-batches: the same losses as one uninterrupted 6-step run, within the stated bound."""
    model = ["--model", "transformer", "--layers", "6", "--optimizer", "adamw", "--precision", "bf16", "--quiet"]
    saved = report(
        train(
            *model,
            "--mesh",
            "fsdp=2,tp=2",
            "--devices",
            "4",
            "--steps",
            "4",
            "--save-every",
            "2",
            "--save",
            str(tmp_path),
            "--json",
        )
    )
    pipeline = ["--mesh", "pp=3", "--microbatches", "3", "--devices", "3", "--steps", "6", "--json"]
    resumed = report(train(*model, *pipeline, "--load", str(tmp_path), "--check"))
    whole = report(train(*model, *pipeline))
    assert saved["losses"] == whole["losses"][:4] or len(saved["losses"]) == 4
    assert resumed["first_step"] == 4 and resumed["ok"]
    np.testing.assert_allclose(resumed["losses"], whole["losses"][4:], rtol=resumed["tolerance"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002", "step-00000004"]


def corrupt(folder, name):
    path = next(folder.glob(name))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "change, words, status",
    [
        (lambda d: None, None, 0),
        # a corrupted file is found by the rank that reads it (hashing every file up front would read them all)
        (lambda d: corrupt(d / "step-00000001", "rank0-layer0-params.npy"), "rank0-layer0-params.npy is corrupted", 1),
        # a missing or partial one before any rank starts: a usage error
        (lambda d: (d / "step-00000001" / "rank1-layer2-params.npy").unlink(), "rank1-layer2-params.npy is missing", 2),
        (lambda d: (d / "step-00000001").rename(d / "step-00000001.partial"), "holds no complete checkpoint", 2),
    ],
)
def test_a_damaged_checkpoint_is_refused_naming_the_file(tmp_path, change, words, status):
    report(train(*EXACT, "--steps", "1", "--mesh", "fsdp=2", "--devices", "2", "--save", str(tmp_path), "--json"))
    change(tmp_path)
    done = train(*EXACT, "--mesh", "dp=1", "--devices", "1", "--load", str(tmp_path), "--quiet")
    assert done.returncode == status, done.stderr
    if words is not None:
        assert words in done.stderr.splitlines()[-1] or words in done.stderr.splitlines()[0], done.stderr
        assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "args, words",
    [
        (["--layers", "4"], "a checkpoint of another model: --layers 3 (this run: 4)"),
        (["--optimizer", "adamw", "--precision", "fp64"], "holds sgd state; this run asks for --optimizer adamw"),
        (["--steps", "1"], "is at step 1, and --steps 1 is no later"),
    ],
)
def test_a_checkpoint_of_another_run_is_refused_before_the_ranks_start(tmp_path, args, words):
    report(train(*EXACT, "--steps", "1", "--mesh", "fsdp=2", "--devices", "2", "--save", str(tmp_path), "--json"))
    base = [a for a in EXACT if a != "--integers"] if "--optimizer" in args else EXACT
    done = train(*base, *args, "--mesh", "dp=1", "--devices", "1", "--load", str(tmp_path))
    assert done.returncode == 2 and words in done.stderr, done.stderr


def test_save_every_without_save_is_refused():
    done = train(*EXACT, "--save-every", "2", "--devices", "1")
    assert done.returncode == 2 and "--save-every needs --save DIR" in done.stderr
