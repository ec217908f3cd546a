"""Training: bad input fails before any rank starts; pipeline schedules; messages tagged by direction."""

import contextlib
import itertools
import json
import re
import subprocess
import sys

import pytest

from spmd.collectives.tags import pipe_tag
from spmd.harness import compose_cli
from spmd.observe.schedule import format_schedule
from spmd.parallel.pipeline_sim import bubble, executor_slots, in_flight, simulate, stashed, timeline
from spmd.parallel.schedules import SCHEDULES, Action, _list_schedule, ideal_bubble, order, schedule_named
from spmd.trainers.presets import PRESETS
from spmd.transport.group import Group
from spmd.transport.mesh import Mesh

MLP = PRESETS["mlp-dp"].net  # the MLP run of these fields, one token a sequence, in the presets' words


@pytest.mark.parametrize(
    "name, mlp, size, mesh, words",
    [
        ("mlp-pp-gpipe", MLP(layers=3), 4, None, "pp=4 stages but only --layers 3"),
        ("mlp-pp-1f1b", MLP(batch=3, microbatches=4), 2, None, "--tokens 3 .* 3 rows, fewer than --microbatches 4"),
        ("mlp-tp", MLP(ffn=3), 4, None, "--ffn 3 is smaller than tp=4"),
        ("mlp-sp", MLP(batch=2), 3, None, "mlp-sp: --tokens 2 split over the tp=3 ranks between the matmuls"),
        ("mlp-dp", MLP(batch=2), 4, None, "--tokens 2 over 4 dp ranks leaves a rank no row"),
        ("mlp-fsdp-tp", MLP(batch=1), 4, Mesh({"fsdp": 2, "tp": 2}), "--tokens 1 over 2 fsdp ranks leaves a rank no"),
        ("mlp-fsdp-tp", MLP(ffn=1), 4, Mesh({"fsdp": 2, "tp": 2}), "--ffn 1 is smaller than tp=2"),
        ("mlp-dp", MLP(microbatches=2), 2, None, "micro-batches are for pipelines"),
        ("mlp-fsdp-tp", MLP(), 4, None, "give --mesh fsdp=N,tp=N"),
        ("mlp-fsdp-tp", MLP(), 4, Mesh({"tp": 2, "fsdp": 2}), "needs mesh axes fsdp,tp"),
        ("mlp-fsdp-tp", MLP(), 4, Mesh({"fsdp": 3, "tp": 2}), "has 6 ranks"),
    ],
)
def test_a_run_that_cannot_work_is_refused_naming_why(name, mlp, size, mesh, words):
    with pytest.raises(ValueError, match=words):
        PRESETS[name].validate(mlp, size, mesh)


BAD_SIZES = (
    [["--tokens", t] for t in ("0", "1", "2", "3", "5")]
    + [[f"--{k}", v] for k in ("hidden", "ffn", "layers") for v in ("0", "1", "3")]
    + [["--microbatches", m] for m in ("0", "3", "5", "16")]
    + [["--chunks", "0"], ["--chunks", "3"], ["--steps", "0"], ["--tokens", "3", "--microbatches", "2"], ["--lr", "-1"]]
)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_error_of_a_preset_names_only_flags_it_has(name, capsys):
    """The mlp-* commands run on the composed engine; its messages speak of --batch and --sp, which they do not
    have: each one a preset gives, at 2-8 ranks and sizes that are refused, names only flags of its command."""
    preset = PRESETS[name]
    flags = {s for action in compose_cli.build_parser(preset)._actions for s in action.option_strings}
    assert "--tokens" in flags and not {"--batch", "--sp", "--seq", "--heads", "--model", "--zero"} & flags
    refused = 0
    for devices, sizes in itertools.product(("2", "3", "4", "8"), BAD_SIZES):
        with contextlib.suppress(SystemExit):
            compose_cli.main(["--devices", devices, *sizes, "--schedule", "--backend", "threads"], preset)
        out = capsys.readouterr()
        named = set(re.findall(r"--[a-z][a-z-]*", out.err))
        assert named <= flags, (sizes, devices, out.err)
        refused += bool(out.err)
    assert refused >= len(BAD_SIZES)  # the sizes are refused somewhere: the messages were seen


def test_a_preset_refuses_a_checkpoint_of_another_run_in_its_own_flags(tmp_path, capsys):
    """train's checkpoints differ from a preset's run in fields the preset does not have (--seq, --model): the
    refusal names them as the preset's fixed ones, and --batch as --tokens."""
    tiny = ["--layers", "2", "--hidden", "4", "--ffn", "6", "--lr", "0.01", "--devices", "2", "--quiet"]
    for name, run in (
        ("seq", ["--model", "mlp", "--batch", "64", "--seq", "2"]),
        ("model", ["--model", "transformer"]),
    ):
        assert compose_cli.main([*tiny, *run, "--heads", "2", "--save", str(tmp_path / name)]) == 0
    capsys.readouterr()
    preset = PRESETS["mlp-dp"]
    flags = {s for action in compose_cli.build_parser(preset)._actions for s in action.option_strings}
    for name, says in (("seq", "mlp-dp's fixed seq differs"), ("model", "mlp-dp's fixed model transformer")):
        with pytest.raises(SystemExit):
            compose_cli.main([*tiny, "--tokens", "64", "--steps", "3", "--load", str(tmp_path / name)], preset)
        err = capsys.readouterr().err
        assert says in err and set(re.findall(r"--[a-z][a-z-]*", err)) <= flags, err


@pytest.mark.parametrize(
    "field, value, flag",
    [("layers", 0, "layers"), ("hidden", 0, "hidden"), ("steps", 0, "steps"), ("microbatches", 0, "microbatches")]
    + [("batch", 0, "tokens")],
)
def test_model_sizes_must_be_positive(field, value, flag):
    with pytest.raises(ValueError, match=f"--{flag} must be >= 1"):
        MLP(**{field: value})


def test_the_command_line_refuses_before_starting_ranks():
    run = subprocess.run(
        [sys.executable, "-m", "spmd", "mlp-pp-gpipe", "--devices", "5", "--layers", "4"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2
    assert "pp=5 stages but only --layers 4" in run.stderr


def schedule_cases():
    """Every registered schedule over stages 1-4 and the micro-batch and chunk counts it takes."""
    for kind, sched in SCHEDULES.items():
        for p in (1, 2, 3, 4):
            for v in (1, 2, 3):
                for m in sorted({1, 2, 3, 5, 8, p, 2 * p, 3 * p}):
                    try:
                        sched.check(p, m, v)
                    except ValueError:
                        continue
                    yield kind, p, m, v


def test_a_preset_runs_blocking_with_no_overlap():
    """--no-overlap on a preset: the same losses, and one layer-gradient buffer fewer (none reducing meanwhile)."""
    reports = []
    for flags in ([], ["--no-overlap"]):
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "spmd",
                "mlp-zero2",
                "--devices",
                "2",
                "--layers",
                "2",
                "--hidden",
                "8",
                "--ffn",
                "16",
                "--tokens",
                "10",
                "--json",
                "--check",
                *flags,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert run.returncode == 0, run.stderr
        reports.append(json.loads(run.stdout.strip().splitlines()[-1]))
        assert reports[-1]["ok"] and reports[-1]["bytes_match_model"] and reports[-1]["memory_match_model"]
    overlapped, blocking = reports
    assert overlapped["losses"] == blocking["losses"]
    layer = 2 * 8 * 16 + 8  # W1, W2 and the gain of one layer, float64
    assert [m["grads"] for m in overlapped["memory"]] == [m["grads"] + layer * 8 for m in blocking["memory"]]


def check_orders(kind: str, p: int, m: int, v: int) -> None:
    """Each micro-batch through each chunk forward then backward once (whole, B, or split: I then W; a split
    schedule may mix them), each after what it needs on its rank; activations (F to B or I) and stashes (I to W)
    within the schedule's declared bounds."""
    sched = schedule_named(kind)
    for r in range(p):
        actions = order(kind, p, m, r, v)
        backwards = {(a.microbatch, a.chunk): a.op for a in actions if a.op in "BI"}
        assert sorted(backwards) == [(k, c) for k in range(m) for c in range(v)]
        assert sched.split or set(backwards.values()) == {"B"}
        assert sorted(actions) == sorted(
            [Action("F", k, c) for k in range(m) for c in range(v)]
            + [Action(op, k, c) for (k, c), b in backwards.items() for op in (("I", "W") if b == "I" else ("B",))]
        )
        live, kept, peak, most = 0, 0, 0, 0
        for a in actions:
            if a.op != "F":  # after what it needs on this rank: its forward, and a W its I
                before = "I" if a.op == "W" else "F"
                assert actions.index(Action(before, a.microbatch, a.chunk)) < actions.index(a)
            live += 1 if a.op == "F" else -1 if a.op in "BI" else 0
            kept += 1 if a.op == "I" else -1 if a.op == "W" else 0
            peak, most = max(peak, live), max(most, kept)
        assert peak == in_flight(kind, p, m, r, v) <= sched.held(p, m, v, r)
        assert most == stashed(kind, p, m, r, v) <= sched.stashes(p, m, v, r)


@pytest.mark.parametrize("kind, stages, microbatches, chunks", list(schedule_cases()))
def test_pipeline_schedule(kind, stages, microbatches, chunks):
    """Each micro-batch through each chunk forward then backward once (split: I then W); activations (F to B or I)
    and stashes (I to W) within the schedule's declared bounds, the activations' reached on the fullest rank; the
    simulated idle time of every rank equal to the schedule's formula at T_F = T_B = T_W."""
    p, m, v = stages, microbatches, chunks
    sched = SCHEDULES[kind]
    check_orders(kind, p, m, v)
    assert max(in_flight(kind, p, m, r, v) for r in range(p)) == max(sched.held(p, m, v, r) for r in range(p))
    grid = simulate(kind, p, m, v)  # raises if the order could deadlock
    idle = sched.idle(p, m, v, 1, 1, 1)
    span, idles = timeline(kind, p, m, v, 1, 1, 1)
    assert idles == [idle] * p and span == idle + 3 * v * m
    ops = {a.op for r in range(p) for a in order(kind, p, m, r, v)}
    if ops in ({"F", "I", "W"}, {"F", "B"}):  # a grid step is one action: the same time only if none mixes B with I
        kinds = len(ops)
        assert len(grid) == kinds * v * m + idle * kinds / 3
        assert bubble(grid) == pytest.approx(ideal_bubble(kind, p, m, v))


@pytest.mark.parametrize("times", [(2, 3, 2), (1, 2, 1), (3, 2, 1), (2, 2, 1), (1, 1, 1)])
@pytest.mark.parametrize("kind", ["1f1b", "gpipe", "zb-h1"])
def test_the_bubble_formulas_hold_at_unequal_times(kind, times):
    """1F1B's and GPipe's (p-1)(T_F+T_B+T_W) and ZB-H1's (p-1)(T_F+T_B-T_W), simulated with those durations."""
    for p, m in ((2, 4), (3, 6), (4, 8), (4, 5)):
        span, idles = timeline(kind, p, m, 1, *times)
        assert idles == [pytest.approx(SCHEDULES[kind].idle(p, m, 1, *times))] * p


@pytest.mark.parametrize("times", [(1, 2, 1), (1, 1, 0.5), (5.7, 9.3, 3.9), (1, 1.5, 0.5), (1, 1, 2), (2, 1, 1)])
@pytest.mark.parametrize("p, m", [(2, 4), (3, 6), (4, 8), (4, 12), (8, 16)])
def test_zbv_made_for_given_times_idles_no_more_there_than_the_equal_times_order(times, p, m):
    """zbv:T_F,T_B,T_W: a valid order within ZB-V's bounds, deadlock-free, whose simulated idle at those times is
    at most the equal-times order's (much less where T_B or T_W differ from T_F); zbv:1,1,1 is zbv."""
    kind = "zbv:" + ",".join(map(str, times))
    check_orders(kind, p, m, 2)
    simulate(kind, p, m, 2)
    executor_slots(kind, p, m, 2)
    made, equal = (max(timeline(k, p, m, 2, *times)[1]) for k in (kind, "zbv"))
    assert made <= equal + 1e-9
    assert [order("zbv:1,1,1", p, m, r, 2) for r in range(p)] == [order("zbv", p, m, r, 2) for r in range(p)]


def test_zbv_made_for_times_where_forwards_first_deadlocks_keeps_a_place_for_chunk_1():
    """pp=2, 8 micro-batches, T_W small: chunk 0's forwards fill every place while their I's wait on this rank's
    chunk-1 forwards. Those rules get stuck; keeping the last place for chunk 1 finishes, and is what is made."""
    times = (1.0, 1.5, 0.1)
    assert all(_list_schedule(2, 8, times, first, spare=False) is None for first in ("FIW", "IFW"))
    check_orders("zbv:1,1.5,0.1", 2, 8, 2)
    simulate("zbv:1,1.5,0.1", 2, 8, 2)
    assert max(timeline("zbv:1,1.5,0.1", 2, 8, 2, *times)[1]) <= max(timeline("zbv", 2, 8, 2, *times)[1])


def test_zbv_made_for_the_times_a_run_measured_shrinks_its_bubble():
    """The README's run (pp=4, 8 micro-batches, T_F, T_B, T_W about 5.7, 9.3, 3.9 ms): 0.31 made for equal times,
    0.11 made for these."""
    share = {
        kind: max(idle / span for span, idles in [timeline(kind, 4, 8, 2, 5.7, 9.3, 3.9)] for idle in idles)
        for kind in ("zbv", "zbv:5.7,9.3,3.9")
    }
    assert share["zbv"] > 0.3 and share["zbv:5.7,9.3,3.9"] < 0.12


def test_zero_bubble_schedules_hold_what_1f1b_holds_at_its_peak():
    """ZB-H1: 1F1B's activations on every rank, and r + 1 stashes on rank r; ZB-V: 2p half-stage chunks (1F1B's
    peak); and the bubble: a third of 1F1B's for ZB-H1, (p-1) chunk forwards for ZB-V, at equal times."""
    p, m = 4, 8
    assert [in_flight("zb-h1", p, m, r) for r in range(p)] == [in_flight("1f1b", p, m, r) for r in range(p)]
    assert [stashed("zb-h1", p, m, r) for r in range(p)] == [1, 2, 3, 4]
    assert [in_flight("zbv", p, m, r, 2) for r in range(p)] == [2 * p] * p
    assert timeline("zb-h1", p, m, 1, 1, 1, 1)[1][0] * 3 == timeline("1f1b", p, m, 1, 1, 1, 1)[1][0]
    assert timeline("zbv", p, m, 2, 1, 1, 1)[1] == [p - 1] * p


def test_interleaving_shrinks_the_bubble_by_the_chunks():
    """Megatron's (p-1)/(v m) of the ideal time: with p = 4, m = 8 the bubble takes 3/16 of the ideal at v = 2."""
    plain, interleaved = simulate("1f1b", 4, 8), simulate("interleaved-1f1b", 4, 8, 2)
    ideal = 2 * 8  # one rank's work in units of one full stage's forward
    assert (len(plain) - ideal) / ideal == pytest.approx(3 / 8)
    assert (len(interleaved) / 2 - ideal) / ideal == pytest.approx(3 / 16)  # actions of half a stage each


@pytest.mark.parametrize(
    "kind, p, m, v, words",
    [
        ("1f1b", 2, 4, 2, "--chunks 2: pipeline schedule 1f1b runs one model chunk per rank"),
        ("interleaved-1f1b", 4, 6, 2, "--microbatches 6 must be a multiple of 4"),
        ("zero-bubble", 2, 2, 1, "unknown pipeline schedule 'zero-bubble'"),
        ("zb-h1", 4, 3, 1, "at least 4 micro-batches on pp=4"),
        ("zbv", 2, 3, 2, "at least 4 micro-batches on pp=2"),
        ("zbv", 2, 4, 3, "places 2 chunks a rank in a V"),
    ],
)
def test_a_schedule_refuses_sizes_it_cannot_run(kind, p, m, v, words):
    with pytest.raises(ValueError, match=words):
        order(kind, p, m, 0, v)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_strategy_prints_a_schedule_table(name):
    trainer = PRESETS[name]
    mesh = Mesh({trainer.axes[0]: 2, trainer.axes[1]: 2}) if len(trainer.axes) == 2 else Mesh({trainer.axes[0]: 4})
    mlp = MLP(layers=8, microbatches=4 if trainer.pipelined else 1, chunks=2 if trainer.chunked else 1)
    table = format_schedule(trainer.composition.schedule(mlp, mesh))
    assert "rank 3" in table and len(table.splitlines()) > 4


def pipeline_tags(comm, rank):
    """Two stages: activations go 0 -> 1 only with forward tags, gradients 1 -> 0 only with backward tags."""
    mlp = MLP(layers=2, hidden=4, ffn=6, batch=8, microbatches=4, steps=1)
    trainer = PRESETS["mlp-pp-1f1b"]
    world = Group.world(comm, rank)
    mesh = trainer.validate(mlp, world.size)
    trainer.composition.build(world, mesh, mlp).step(*mlp.batch_data(0))
    pp = mesh.group(world, "pp")
    sent = {tag for (dst, tag) in comm.traffic(rank).sent_messages if tag >= pp.wire_tag(pipe_tag(False, 0))}
    direction = rank == 1  # rank 0 sends forwards, rank 1 backwards
    assert sent == {pp.wire_tag(pipe_tag(direction, k, 0, 2)) for k in range(mlp.microbatches)}  # boundary 0|1


def test_a_two_stage_pipeline_tags_messages_by_direction_and_microbatch():
    from spmd.transport.threads import run_threads

    run_threads(2, pipeline_tags, timeout=30)


def interleaved_tags(comm, rank):
    """Two ranks, two chunks each (rank 0 stages 0 and 2, rank 1 stages 1 and 3): rank 0 sends forward across
    boundaries 0|1 and 2|3, backward across 1|2 (from its stage 2); every (direction, boundary, micro-batch) apart."""
    mlp = MLP(layers=4, hidden=4, ffn=6, batch=8, microbatches=2, chunks=2, steps=1)
    trainer = PRESETS["mlp-pp-interleaved"]
    world = Group.world(comm, rank)
    mesh = trainer.validate(mlp, world.size)
    trainer.composition.build(world, mesh, mlp).step(*mlp.batch_data(0))
    pp = mesh.group(world, "pp")
    sent = sorted(tag for (dst, tag) in comm.traffic(rank).sent_messages if tag >= pp.wire_tag(pipe_tag(False, 0)))
    boundaries = [(False, 0), (False, 2), (True, 1)] if rank == 0 else [(False, 1), (True, 0), (True, 2)]
    want = sorted(pp.wire_tag(pipe_tag(back, k, b, 4)) for back, b in boundaries for k in range(2))
    assert sent == want and len(set(want)) == 6


def test_an_interleaved_pipeline_tags_messages_by_direction_chunk_and_microbatch():
    from spmd.transport.threads import run_threads

    run_threads(2, interleaved_tags, timeout=30)


@pytest.mark.parametrize(
    "argv",
    [
        ["mlp-fsdp-tp", "--mesh", "fsdp=2,tp=2"],
        ["mlp-pp-1f1b", "--microbatches", "3"],
        ["mlp-sp", "--integers", "--lr", "0.0078125", "--layers", "2"],  # 4 layers could pass 2^53 (refused)
    ],
)
def test_the_main_training_commands_pass_their_check_under_mpiexec(mpiexec, argv):
    args = ["--layers", "4", "--hidden", "8", "--ffn", "12", "--tokens", "10", "--check"]
    run = subprocess.run(
        [mpiexec, "-n", "4", sys.executable, "-m", "spmd", *args, *argv], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "on mpi" in run.stdout and "OK" in run.stdout
    assert "bytes == model: True, held memory == model: True" in run.stdout


def test_schedule_and_json_from_the_command_line():
    schedule = subprocess.run(
        [sys.executable, "-m", "spmd", "mlp-pp-1f1b", "--schedule", "--devices", "2", "--microbatches", "3"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert schedule.returncode == 0, schedule.stderr
    assert (
        "Idle share 0.250; the schedule's, idle (p-1)(T_F+T_B+T_W) a rank, at equal times: 0.250" in schedule.stdout
        and "B2" in schedule.stdout
    )
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "spmd",
            "mlp-zero2",
            "--devices",
            "3",
            "--layers",
            "2",
            "--hidden",
            "8",
            "--ffn",
            "16",
            "--tokens",
            "10",
            "--json",
            "--check",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["ok"] and report["bytes_match_model"] and report["memory_match_model"]
    assert report["ranks"] == 3 and len(report["memory"]) == 3 and len(report["losses"]) == 2


@pytest.mark.parametrize("kind, stages, microbatches, chunks", list(schedule_cases()))
def test_the_executor_slots_cover_the_live_activations(kind, stages, microbatches, chunks):
    """At least in_flight a rank; more only for interleaved orders with m > p and DualPipeV (one: a gradient still
    leaving a slot)."""
    slots = executor_slots(kind, stages, microbatches, chunks)
    live = [in_flight(kind, stages, microbatches, r, chunks) for r in range(stages)]
    assert all(s >= n for s, n in zip(slots, live, strict=True))
    if kind == "dualpipev":
        assert all(s <= n + 1 for s, n in zip(slots, live, strict=True))
    elif kind != "interleaved-1f1b" or microbatches == stages:
        assert slots == live, (slots, live)
