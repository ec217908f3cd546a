"""Where a step goes (spmd.stopwatch): every second in exactly one part, the innermost open; a training run's
breakdown per rank adds up to its step, finds the GEMMs, the attention and the waits where they are, and is drawn."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from spmd import stopwatch
from spmd.harness.breakdown import timed
from spmd.stopwatch import PARTS


def test_a_nested_part_is_taken_out_of_its_parent():
    watch = stopwatch.start()
    try:
        with stopwatch.part("elementwise"):
            time.sleep(0.02)
            with stopwatch.part("gemm"):
                time.sleep(0.03)
        laps = watch.lap(0.1)
    finally:
        stopwatch.stop()
    assert 0.03 <= laps["gemm"] < 0.045 and 0.02 <= laps["elementwise"] < 0.035
    assert laps["rest"] == pytest.approx(0.1 - laps["gemm"] - laps["elementwise"])
    assert watch.lap(1.0) == {**dict.fromkeys(PARTS, 0.0), "rest": 1.0}  # a lap starts again from nothing


def test_without_a_stopwatch_a_part_counts_nothing():
    with stopwatch.part("gemm"):
        pass  # no watch started on this thread: nothing to count, nothing raised


def train_json(tmp_path, *args) -> dict:
    out = tmp_path / "run.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "spmd",
            "train",
            "--model",
            "llama",
            "--layers",
            "2",
            "--hidden",
            "32",
            "--ffn",
            "64",
            "--heads",
            "4",
            "--seq",
            "16",
            "--batch",
            "8",
            "--vocab",
            "61",
            "--steps",
            "3",
            "--quiet",
            "--json",
            str(out),
            *args,
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return json.loads(out.read_text())


def test_the_train_report_splits_each_ranks_step_and_the_plot_draws_it(tmp_path):
    report = train_json(tmp_path, "--mesh", "fsdp=2", "--devices", "2")
    kept = timed(report["step_seconds"])  # rank 0's; the breakdown's mean step leaves the traced ones out
    step = sum(kept) / len(kept)
    assert sum(report["breakdown"][0].values()) == pytest.approx(step, rel=1e-6)
    for parts in report["breakdown"]:
        assert set(parts) == set(PARTS)
        assert min(parts["gemm"], parts["attention"], parts["elementwise"], parts["comm"], parts["optimizer"]) > 0
    png = tmp_path / "breakdown.png"
    done = subprocess.run(
        [sys.executable, "-m", "spmd.observe.plot", "--breakdown", str(tmp_path / "run.json"), "--out", str(png)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    from PIL import Image

    drawn = Image.open(png).info["Description"]  # what the bars show (spmd.observe.plot.drawn_data)
    assert "rank 1: gemm" in drawn and len(drawn.splitlines()) == 2
    table = done.stdout.splitlines()[1:]  # after "wrote ...": the bars as a table, ms a step
    assert table[0] == "| rank | GEMMs | attention | elementwise | comm waits | optimizer | rest | step ms |"
    for rank, line in enumerate(table[2:]):
        cells = [float(c) for c in line.strip("|").split("|")[1:]]
        assert line.startswith(f"| fsdp=2 (threads) rank {rank} |")
        assert sum(cells[:-1]) == pytest.approx(cells[-1], abs=0.3)  # the parts add up to the step
        assert cells[-1] == pytest.approx(1e3 * sum(report["breakdown"][rank].values()), abs=0.1)
