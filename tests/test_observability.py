"""Seeing the communication: the schedule, traces, their plots, and the per-rank report."""

import json
import re
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest

from spmd.collectives import ring_allgather
from spmd.collectives.reference import ring_allgather_ref
from spmd.harness.breakdown import TRACED_STEPS, timed
from spmd.harness.memory import start_peak_memory, stop_peak_memory
from spmd.harness.train_job import Measures
from spmd.matmul import STRATEGIES
from spmd.observe.schedule import format_schedule
from spmd.observe.trace import chrome_trace, hidden_fraction
from spmd.transport.group import Group
from spmd.transport.mesh import Mesh
from spmd.transport.threads import run_threads


def fsdp_multiplies(size: int) -> list[list[int]]:
    """Per step, per rank: whose B shard the FSDP schedule says the rank multiplies (read from its text)."""
    steps = STRATEGIES["fsdp"].schedule(Mesh({"fsdp": size})).steps
    return [
        [int(re.match(r"A\d+ x B(\d+)", cell.text).group(1)) for cell in cells]
        for label, cells in steps
        if label != "end"
    ]


@pytest.mark.parametrize("size", [1, 2, 3, 4, 6])
def test_schedule_is_the_rings_reference(size):
    ref = ring_allgather_ref(list(range(size)))
    steps = fsdp_multiplies(size)
    schedule = STRATEGIES["fsdp"].schedule(Mesh({"fsdp": size}))
    for rank in range(size):
        assert [steps[s][rank] for s in range(size)] == [owner for owner, _ in ref[rank]]
        for s in range(size - 1):  # what arrives is what the next step multiplies, from the left
            assert f"B{steps[s + 1][rank]}<-{(rank - 1) % size}" in schedule.steps[s][1][rank].text
        assert schedule.sends(rank) == [(rank + 1) % size] * (size - 1) + ([0] if rank else [])


def ring_follows_the_schedule(comm, rank):
    shapes = lambda owner: (2,)  # noqa: E731
    owners = [owner for owner, _, _ in ring_allgather(Group.world(comm, rank), np.zeros(2), shapes)]
    assert owners == [step[rank] for step in fsdp_multiplies(comm.num_devices)]


def test_the_real_ring_follows_the_schedule(world):
    world.run(ring_follows_the_schedule)


def test_schedule_table():
    table = format_schedule(STRATEGIES["fsdp"].schedule(Mesh({"fsdp": 3}))).splitlines()
    assert re.match(r"0\s+\| A0 x B0, B0->1, B2<-2 \| A1 x B1, B1->2, B0<-0 \| A2 x B2, B2->0, B1<-1$", table[6])
    assert re.match(r"2\s+\| A0 x B1\s+\| A1 x B2\s+\| A2 x B0$", table[8])
    assert "A1 x all of B" in format_schedule(STRATEGIES["dp"].schedule(Mesh({"dp": 2})))


def test_hidden_fraction_counts_transfer_time_under_compute():
    spans = [
        (0, "A0 x B0", "compute", 0.0, 10.0, {}),
        (0, "transfer from 1", "transfer", 5.0, 15.0, {}),  # half of it under compute
        (1, "transfer from 0", "transfer", 0.0, 10.0, {}),  # none: rank 1 computed nothing meanwhile
    ]
    assert hidden_fraction(spans) == pytest.approx(5 / 20)
    assert hidden_fraction(spans[:1]) is None
    nested = [*spans, (0, "F ring step 0", "compute", 6.0, 9.0, {})]  # inside the layer's span: counted once
    assert hidden_fraction(nested) == pytest.approx(5 / 20)
    trace = chrome_trace(spans)
    assert {e["pid"] for e in trace["traceEvents"]} == {0, 1}
    assert [e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"] == ["rank 0", "rank 1"]


def test_a_training_run_with_a_trace_reports_the_share_of_transfers_under_compute(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "spmd",
            "train",
            "--model",
            "mlp",
            "--mesh",
            "fsdp=2",
            "--devices",
            "2",
            "--trace",
            str(tmp_path / "t.json"),
            "--json",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert 0.0 < report["hidden_fraction"] <= 1.0


# ids avoid the bare word "mpi", which pytest-mpi takes for its marker and skips without --with-mpi
@pytest.mark.parametrize("backend", ["threads", "mpi"], ids=["threads", "mpiexec"])
def test_a_traced_run_writes_every_ranks_timeline(mpiexec, tmp_path, backend):
    trace = tmp_path / "t.json"
    command = [
        sys.executable,
        "-m",
        "spmd.fsdp",
        "--m",
        "300",
        "--k",
        "200",
        "--n",
        "100",
        "--json",
        "--trace",
        str(trace),
    ]
    command = [mpiexec, "-n", "3", *command] if backend == "mpi" else [*command, "--devices", "3"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["trace"] == str(trace) and 0.0 <= report["hidden_fraction"] <= 1.0
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    for rank in range(3):
        mine = [e for e in events if e["pid"] == rank]
        computed = sorted(int(e["name"].split("x B")[1]) for e in mine if e["cat"] == "compute")
        assert set(computed) == {0, 1, 2}  # every owner's shard, in one or more panels
        assert sum(e["cat"] == "transfer" and e["args"]["tag"] == 1 for e in mine) == 2  # D - 1 shards in
        assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in mine)
    plot = subprocess.run(
        [sys.executable, "-m", "spmd.observe.plot", str(trace), "--out", str(tmp_path / "t.png")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert plot.returncode == 0, plot.stderr
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"


def test_reports_plot_and_bad_plot_input(tmp_path):
    for strategy in ("dp", "fsdp"):
        done = subprocess.run(
            [sys.executable, "-m", f"spmd.{strategy}", "--devices", "4", "--m", "64", "--json"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        (tmp_path / f"{strategy}.json").write_text(done.stdout)
    plot = subprocess.run(
        [
            sys.executable,
            "-m",
            "spmd.observe.plot",
            "--reports",
            str(tmp_path / "dp.json"),
            str(tmp_path / "fsdp.json"),
            "--out",
            str(tmp_path / "m.png"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert plot.returncode == 0, plot.stderr
    assert (tmp_path / "m.png").read_bytes()[:4] == b"\x89PNG"
    (tmp_path / "bad.json").write_text("not json")
    bad = subprocess.run(
        [sys.executable, "-m", "spmd.observe.plot", str(tmp_path / "bad.json"), "--out", str(tmp_path / "x.png")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "bad.json: is not JSON written by spmd" in bad.stderr


def test_schedule_flag_prints_and_runs_nothing():
    done = subprocess.run(
        [sys.executable, "-m", "spmd.fsdp", "--schedule", "--devices", "2"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0
    assert "A0 x B0, B0->1, B1<-1" in done.stdout and "multiply:" not in done.stdout


def test_report_shows_bytes_and_memory_against_the_model():
    done = subprocess.run(
        [sys.executable, "-m", "spmd.fsdp", "--devices", "4", "--m", "512", "--k", "512", "--n", "512", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    report = json.loads(done.stdout)
    assert report["bytes_sent"] == report["model_bytes_sent"]
    assert report["peak_bytes"] is None  # threads share one process: per rank only the model ...
    total = sum(report["model_peak_bytes"])  # ... and the measured total of all ranks
    assert total <= report["peak_bytes_all_ranks"] < total + 256 * 1024
    assert report["model_peak_bytes"][1] < report["model_peak_bytes"][0]  # rank 0 also holds all of C


def test_a_trace_window_keeps_the_spans_that_overlap_it_and_refuses_an_empty_or_bad_one():
    from spmd.observe.plot import in_window
    from spmd.usage import UsageError

    def span(ts, dur):
        return {"ph": "X", "ts": ts * 1e3, "dur": dur * 1e3, "pid": 0, "cat": "compute", "name": "F layer 1"}

    trace = {"traceEvents": [span(0, 5), span(10, 5), span(20, 5), {"ph": "M", "name": "meta"}]}
    assert [e["ts"] / 1e3 for e in in_window(trace, "12:21")["traceEvents"] if e["ph"] == "X"] == [10, 20]
    assert len(in_window(trace, ":4")["traceEvents"]) == 2  # the first span and the metadata
    for bad in ("21:12", "x:3", "30:40", "5"):
        with pytest.raises(UsageError, match="--window"):
            in_window(trace, bad)


def test_a_trace_step_range_is_the_window_from_one_steps_last_update_to_anothers():
    from spmd.observe.plot import steps_window
    from spmd.usage import UsageError

    span = lambda name, ts, pid=0: {"ph": "X", "ts": ts * 1e3, "dur": 1e3, "pid": pid, "name": name}  # noqa: E731
    steps = [
        span("F layer 0", 0),
        span("B layer 0", 2),
        span("update", 4),
        span("update", 6),  # step 1 ends at 7
        span("update", 30, pid=1),
        span("F layer 0", 10),
        span("update", 14),
        span("update", 16),  # 17
        span("F layer 0", 20),
        span("update", 24),
    ]  # 25
    trace = {"traceEvents": steps}
    assert steps_window(trace, "1:1") == ":7.0" and steps_window(trace, "2:3") == "7.0:25.0"
    assert steps_window(trace, "3:") == "17.0:25.0" and steps_window(trace, ":2") == ":17.0"
    for bad in ("0:1", "2:1", "1:4", "x", "3"):
        with pytest.raises(UsageError, match=r"--steps takes A:B, steps 1 <= A <= B <= 3"):
            steps_window(trace, bad)


def test_a_transfer_is_coloured_by_the_mesh_axis_joining_its_ranks():
    from spmd.observe.plot import AXIS_COLORS, color_of, label_of
    from spmd.transport.mesh import Mesh

    mesh = Mesh({"pp": 2, "tp": 2})  # rank = 2 pp + tp
    transfer = lambda pid, peer: {"cat": "transfer", "name": f"transfer from {peer}", "pid": pid}  # noqa: E731
    assert label_of(transfer(0, 1), mesh) == "transfer over tp" and label_of(transfer(3, 1), mesh) == "transfer over pp"
    assert label_of(transfer(0, 3), mesh) == "transfer over world"
    assert color_of(transfer(0, 1), mesh) == AXIS_COLORS["tp"] != color_of(transfer(0, 2), mesh) == AXIS_COLORS["pp"]
    assert label_of(transfer(0, 1)) == "transfer"  # a trace without its mesh: one colour


class _StillEngine:
    """What Measures reads of an engine, for a step that does nothing."""

    busy = 0.0
    op_seconds: dict = {}
    order: list = []

    def exchanged(self) -> np.ndarray:
        return np.zeros(2)

    def routing(self) -> None:
        return None


def _traced_steps(comm, rank) -> tuple[list[bool], int]:
    """Four steps, each holding an array while it runs (a larger one in each later step): whether tracemalloc
    traced each, and the peak Measures kept."""
    world = Group.world(comm, rank)
    measures = Measures(world, _StillEngine(), Mesh({"dp": 1}), start_peak_memory(world, True))
    tracing = []
    for step in range(1, 5):
        measures.before_step(step)
        held = np.ones(step * 1 << 18)  # 2, 4, 6, 8 MiB
        tracing.append(tracemalloc.is_tracing())
        measures.after_step(step, 0.0, 1.0)
        del held
    stop_peak_memory(True)
    return tracing, measures.steps_peak


def test_the_measured_peak_is_of_the_first_steps_and_the_later_ones_run_untraced():
    tracing, peak = run_threads(1, _traced_steps)[0]
    assert tracing == [True] * TRACED_STEPS + [False] * (4 - TRACED_STEPS)
    assert TRACED_STEPS * 2 << 20 <= peak < (TRACED_STEPS * 2 + 1) << 20  # the last traced step's array


def test_the_times_reported_leave_out_the_traced_steps_and_keep_one_where_a_run_has_no_more():
    steps = list(range(1, 7))
    assert timed(steps) == steps[TRACED_STEPS:]  # tracemalloc slowed those
    assert timed(steps[:TRACED_STEPS]) == steps[1:TRACED_STEPS]  # the first touches fresh memory
    assert timed([1]) == [1]
