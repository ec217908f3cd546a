"""Training: bad input fails before any rank starts; pipeline schedules; messages tagged by direction."""

import json
import subprocess
import sys

import pytest

from spmd.collectives.tags import pipe_tag
from spmd.observe.schedule import format_schedule
from spmd.train import TRAINERS
from spmd.train.pipeline_schedule import bubble, in_flight, order, simulate
from spmd.transport.group import Group
from spmd.transport.mesh import Mesh
from spmd.workloads.mlp import MLP


@pytest.mark.parametrize("name, mlp, size, mesh, words", [
    ("mlp-pp-gpipe", MLP(layers=3), 4, None, "4 pipeline stages but only 3 layers"),
    ("mlp-pp-1f1b", MLP(tokens=3, microbatches=4), 2, None, "4 micro-batches but only 3 tokens"),
    ("mlp-tp", MLP(ffn=3), 4, None, "ffn size f=3 is smaller than the tp axis"),
    ("mlp-sp", MLP(tokens=2), 3, None, "tokens=2 is fewer than the tp axis"),
    ("mlp-fsdp-tp", MLP(ffn=1), 4, Mesh({"fsdp": 2, "tp": 2}), "ffn size f=1"),
    ("mlp-dp", MLP(microbatches=2), 2, None, "micro-batches are for pipelines"),
    ("mlp-fsdp-tp", MLP(), 4, None, "give --mesh fsdp=N,tp=N"),
    ("mlp-fsdp-tp", MLP(), 4, Mesh({"tp": 2, "fsdp": 2}), "needs mesh axes fsdp,tp"),
    ("mlp-fsdp-tp", MLP(), 4, Mesh({"fsdp": 3, "tp": 2}), "has 6 ranks"),
])
def test_a_run_that_cannot_work_is_refused_naming_why(name, mlp, size, mesh, words):
    with pytest.raises(ValueError, match=words):
        TRAINERS[name].validate(mlp, size, mesh)


@pytest.mark.parametrize("field, value", [("layers", 0), ("hidden", 0), ("steps", 0), ("microbatches", 0)])
def test_model_sizes_must_be_positive(field, value):
    with pytest.raises(ValueError, match=f"{field} must be >= 1"):
        MLP(**{field: value})


def test_the_command_line_refuses_before_starting_ranks():
    run = subprocess.run([sys.executable, "-m", "spmd", "mlp-pp-gpipe", "--devices", "5", "--layers", "4"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "5 pipeline stages but only 4 layers" in run.stderr


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("microbatches", [1, 2, 3, 5, 8])
def test_pipeline_schedule(kind, stages, microbatches):
    """Each micro-batch forward then backward once per stage; in-flight bound; the bubble formula."""
    p, m = stages, microbatches
    for r in range(p):
        actions = order(kind, p, m, r)
        assert sorted(actions) == sorted([("F", k) for k in range(m)] + [("B", k) for k in range(m)])
        live = peak = 0
        for action, k in actions:
            if action == "B":
                assert actions.index(("F", k)) < actions.index(("B", k))
            live += 1 if action == "F" else -1
            peak = max(peak, live)
        assert peak == in_flight(kind, p, m, r)
    grid = simulate(kind, p, m)
    assert len(grid) == 2 * (m + p - 1)
    assert bubble(grid) == pytest.approx((p - 1) / (m + p - 1))


def test_1f1b_holds_fewer_activations_than_gpipe():
    assert [in_flight("1f1b", 4, 8, r) for r in range(4)] == [4, 3, 2, 1]
    assert [in_flight("gpipe", 4, 8, r) for r in range(4)] == [8] * 4


@pytest.mark.parametrize("name", sorted(TRAINERS))
def test_every_strategy_prints_a_schedule_table(name):
    trainer = TRAINERS[name]
    mesh = Mesh({trainer.axes[0]: 2, trainer.axes[1]: 2}) if len(trainer.axes) == 2 else Mesh({trainer.axes[0]: 4})
    mlp = MLP(layers=4, microbatches=4 if trainer.microbatched else 1)
    table = format_schedule(trainer.schedule(mlp, mesh))
    assert "rank 3" in table and len(table.splitlines()) > 4


def pipeline_tags(comm, rank):
    """Two stages: activations go 0 -> 1 only with forward tags, gradients 1 -> 0 only with backward tags."""
    mlp = MLP(layers=2, hidden=4, ffn=6, tokens=8, microbatches=4, steps=1)
    trainer = TRAINERS["mlp-pp-1f1b"]
    world = Group.world(comm, rank)
    mesh = trainer.validate(mlp, world.size)
    trainer.start(world, mesh, mlp).step(*mlp.batch(0))
    pp = mesh.group(world, "pp")
    sent = {tag for (dst, tag) in comm.traffic(rank).sent_messages if tag >= pp.wire_tag(pipe_tag(False, 0))}
    direction = rank == 1  # rank 0 sends forwards, rank 1 backwards
    assert sent == {pp.wire_tag(pipe_tag(direction, k)) for k in range(mlp.microbatches)}


def test_a_two_stage_pipeline_tags_messages_by_direction_and_microbatch():
    from spmd.transport.threads import run_threads

    run_threads(2, pipeline_tags, timeout=30)


@pytest.mark.parametrize("argv", [
    ["mlp-fsdp-tp", "--mesh", "fsdp=2,tp=2"],
    ["mlp-pp-1f1b", "--microbatches", "3"],
    ["mlp-sp", "--integers", "--lr", "0.0078125", "--layers", "2"],  # 4 layers could pass 2^53 (refused)
])
def test_the_main_training_commands_pass_their_check_under_mpiexec(mpiexec, argv):
    args = ["--layers", "4", "--hidden", "8", "--ffn", "12", "--tokens", "10", "--check"]
    run = subprocess.run([mpiexec, "-n", "4", sys.executable, "-m", "spmd", *args, *argv],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "on mpi" in run.stdout and "OK" in run.stdout
    assert "bytes == model: True, held memory == model: True" in run.stdout


def test_schedule_and_json_from_the_command_line():
    schedule = subprocess.run([sys.executable, "-m", "spmd", "mlp-pp-1f1b", "--schedule", "--devices", "2",
                               "--microbatches", "3"], capture_output=True, text=True, timeout=60)
    assert schedule.returncode == 0, schedule.stderr
    assert "Idle share 0.250 = (p-1)/(m+p-1) = 0.250" in schedule.stdout and "B2" in schedule.stdout
    run = subprocess.run([sys.executable, "-m", "spmd", "mlp-zero2", "--devices", "3", "--layers", "2", "--hidden",
                          "8", "--ffn", "16", "--tokens", "10", "--json", "--check"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["ok"] and report["bytes_match_model"] and report["memory_match_model"]
    assert report["ranks"] == 3 and len(report["memory"]) == 3 and len(report["losses"]) == 2
