"""The pieces that make it fast: BLAS threads per rank, reused workspaces, the benchmark's outputs.

No timing is asserted here: speed claims live in the benchmark (docs/benchmarks.md).
"""

import json
import subprocess
import sys

import numpy as np
import pytest
from threadpoolctl import threadpool_info

from spmd.bench import lm
from spmd.bench.run import QUICK, plan
from spmd.collectives import Workspace
from spmd.layout import block_range
from spmd.matmul.fsdp import fsdp_rank
from spmd.transport.cores import available_cores, blas_threads_per_rank
from spmd.transport.group import Group


@pytest.mark.parametrize("ranks, cores, expected", [(1, 2, 2), (2, 2, 1), (4, 2, 1), (3, 8, 2), (1, 1, 1)])
def test_blas_threads_share_the_cores(ranks, cores, expected):
    assert blas_threads_per_rank(ranks, cores) == expected


def blas_limited_to_a_share(comm, rank):
    openblas = [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]
    assert openblas and all(n == blas_threads_per_rank(comm.num_devices, available_cores()) for n in openblas)


def test_each_rank_gets_its_share_of_blas_threads(world):
    world.run(blas_limited_to_a_share)


def workspace_serves_calls_of_any_shape(comm, rank):
    size = comm.num_devices
    workspace = Workspace()
    cases = [(9, 4, 7, np.float64), (20, 6, 30, np.float64), (5, 3, 2, np.float32), (20, 6, 30, np.float64)]
    for m, k, n, dtype in cases:
        rng = np.random.default_rng(m)
        a, b = rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((k, n)).astype(dtype)
        a_block, b_shard = a[slice(*block_range(m, size, rank))], b[:, slice(*block_range(n, size, rank))]
        c = fsdp_rank(Group.world(comm, rank), a_block, b_shard, (m, n), workspace=workspace)
        if rank == 0:
            np.testing.assert_allclose(c, a @ b, rtol=1e-5)
            c[:] = 0  # the caller owns C: reusing the workspace must not touch it
            assert not np.shares_memory(c, workspace.array("ring0", (1,), dtype))


def test_a_workspace_is_reused_across_calls(world):
    world.run(workspace_serves_calls_of_any_shape)


@pytest.mark.slow
def test_quick_benchmark_writes_its_table_chart_and_results(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "spmd.bench", "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    assert {(r["backend"], r["strategy"], r["ranks"]) for r in results["rows"]} >= {
        ("threads", "dp", 2),
        ("mpi", "fsdp", 2),
        ("mpi", "dp", 1),
    }
    for row in results["rows"]:
        assert len(row["seconds"]) == len(row["numpy_seconds"]) == results["rows"][0]["reps"]
    table = (tmp_path / "benchmarks.md").read_text()
    assert "| mpi | fsdp no-overlap | 2 |" in table and "MISMATCH" not in table  # bytes sent == model
    assert (tmp_path / "benchmarks.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    steps = len(plan(QUICK))
    assert all(f"[{i}/{steps} " in done.stderr for i in range(1, steps + 1))  # progress, row by row


def test_an_explicit_blas_thread_count_overrides_the_share():
    from spmd.transport.threads import run_threads

    seen = run_threads(
        2, lambda comm, rank: [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"], blas=2
    )
    assert seen == [[2], [2]]


@pytest.mark.slow
def test_the_training_benchmark_writes_its_table_with_mfu(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "spmd.bench.train",
            "--quick",
            "--only",
            "dp",
            "--only",
            "fsdp",
            "--steps",
            "2",
            "--rounds",
            "2",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    results = json.loads((tmp_path / "train.json").read_text())
    rows = [r for r in results["rows"] if r["backend"] == "mpi"]
    assert [(r["layout"], r["overlap"]) for r in rows] == [("dp", True), ("dp", False), ("fsdp", True), ("fsdp", False)]
    assert all(r["mfu_median"] > 0 and r["gemm_rate"] > 0 and r["step_min"] <= r["step_median"] for r in rows)
    dp_on, _, fsdp_on, _ = rows
    assert len(dp_on["on_over_off"]) == 2 and "over_dp" not in dp_on  # one ratio a round
    assert len(fsdp_on["over_dp"]) == 2 and all(r > 0 for r in fsdp_on["over_dp"] + fsdp_on["on_over_off"])
    text = (tmp_path / "train.md").read_text()
    assert "| dp | dp=2 | mpi | float32 | on |" in text and " (2) |" in text


@pytest.mark.slow
def test_the_fresh_process_matmul_comparison_writes_its_table(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "spmd.bench.fresh", "--out", str(tmp_path), "--n", "96", "--reps", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    results = json.loads((tmp_path / "fresh.json").read_text())
    assert results["n"] == 96 and results["ranks"] == 2
    for strategy in ("dp", "fsdp"):
        pair = results["times"][strategy]
        assert len(pair["numpy"]) == len(pair["ours"]) == 1 and min(pair["numpy"] + pair["ours"]) > 0
        assert f"| {strategy} | " in (tmp_path / "fresh.md").read_text()
    bad = subprocess.run(
        [sys.executable, "-m", "spmd.bench.fresh", "--out", str(tmp_path), "--reps", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "--reps must be at least 1, got 0" in bad.stderr


def test_an_mfu_above_1_is_called_noise_in_the_table():
    """No step is faster than the machine: the table says which rows' GEMM rate was measured low."""
    from spmd.bench.train import table

    row = dict(
        layout="dp",
        mesh="dp=2",
        backend="mpi",
        dtype="float32",
        overlap=True,
        step_median=1.0,
        step_min=1.0,
        step_max=1.0,
        mfu_median=0.9,
        mfu_min=0.8,
        mfu_max=0.95,
    )
    model = {"layers": 1, "hidden": 2, "ffn": 3, "tokens": 4}
    assert "MFU above 1" not in table(model, 10, [row])
    assert "MFU above 1 in 1 of 2 rows (tp (tp=2, mpi, float32))" in table(
        model, 10, [row, {**row, "layout": "tp", "mesh": "tp=2", "mfu_max": 1.3}]
    )


@pytest.mark.slow
def test_the_lm_benchmark_writes_its_table_with_tokens_and_mfu(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "spmd.bench",
            "lm",
            "--out",
            str(tmp_path),
            "--quick",
            "--steps",
            "2",
            "--rounds",
            "1",
            "--no-torch",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    results = json.loads((tmp_path / "lm.json").read_text())
    assert [r["run"] for r in results["rows"]] == [name for name, *_ in lm.SPMD_RUNS]
    assert all(r["min"] <= r["median"] <= r["max"] and 0 < r["mfu"] < 1 for r in results["rows"])
    assert all(len(run["rounds"][0]["breakdown"]) == run["ranks"] for run in results["runs"][0]["runs"].values())
    assert (tmp_path / "lm.md").read_text() == done.stdout


def test_the_lm_table_keeps_pytorchs_rows_as_dashes_without_torch_and_names_no_machine():
    """README's copy is checked on any machine: the same lines with or without torch, no processor in them."""
    shape = lm.QUICK_SHAPES[0]
    spmd_row = {"shape": shape, "run": "spmd 1 rank", "ranks": 1, "median": 0.5, "min": 0.4, "max": 0.6}
    spmd_row |= {"tokens_per_s": 2048.0, "gemm_gflops": 100.0, "mfu": 0.5}
    text = lm.table([spmd_row, *lm.missing_torch(shape)])
    lines = text.splitlines()
    assert lines[0] == lm.CAPTION and "EPYC" not in text and "Xeon" not in text
    assert lines[3] == "| 2, 32, 64, 4, 16, 8 | spmd 1 rank | 0.5000 (0.4000-0.6000) | 2,048 | 100 | 0.50 | - |"
    assert lines[4:] == [f"| 2, 32, 64, 4, 16, 8 | {name} | - | - | - | - | - |" for name, *_ in lm.TORCH_RUNS]


def test_the_lm_benchmark_compares_each_spmd_row_with_pytorchs_best_on_as_many_cores():
    def run(ranks, *seconds):  # the timed steps (spmd_run and torch_run leave out the first)
        return {"ranks": ranks, "rounds": [{"step_seconds": list(seconds)}]}

    measured = {
        "gemm_rates": [1e9],
        "runs": {
            "spmd 1 rank": run(1, 1.0),
            "spmd dp=2": run(2, 0.6),
            "torch 1 process": run(1, 0.8),
            "torch DDP": run(2, 0.5, 0.7),
            "torch FSDP2": run(2, 0.9),
        },
    }
    rows = {r["run"]: r for r in lm.summarize(lm.QUICK_SHAPES[0], measured)}
    assert rows["spmd 1 rank"]["over_torch"] == pytest.approx(1.0 / 0.8)  # the single process only
    assert rows["spmd dp=2"]["over_torch"] == pytest.approx(0.6 / 0.6)  # DDP's median, the best of the three
    assert "over_torch" not in rows["torch DDP"] and rows["torch DDP"]["min"] == 0.5
