"""`python -m spmd <strategy>` (and the older `python -m spmd.dp` / `spmd.fsdp`), run as a user would."""

import dataclasses
import json
import os
import pickle
import re
import subprocess
import sys

import numpy as np
import pytest

from spmd import matmul as strategies
from spmd.harness import cli
from spmd.matmul.dp import DP
from spmd.matmul.problem import check_product

BACKENDS = ["threads", "mpi"]
STRATEGIES = sorted(strategies.STRATEGIES)


@pytest.fixture
def run(mpiexec):
    """run(backend, strategy, ranks, *args) -> CompletedProcess of the command line.

    On threads, ranks=None leaves --devices to the args (or its default).
    """

    def run(backend, strategy, ranks, *args):
        command = [sys.executable, "-m", "spmd", strategy, *args]
        if backend == "mpi":
            command = [mpiexec, "-n", str(ranks), *command]
        elif ranks is not None:
            command += ["--devices", str(ranks)]
        # A hung run fails the test here rather than blocking the suite.
        return subprocess.run(command, capture_output=True, text=True, timeout=120)

    return run


def report(done) -> dict:
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_check_passes_at_3_ranks_with_uneven_sizes(run, backend, strategy):
    got = report(run(backend, strategy, 3, "--m", "7", "--k", "5", "--n", "11", "--check", "--json"))
    assert got["strategy"] == strategy and got["backend"] == backend and got["ranks"] == 3
    assert (got["m"], got["k"], got["n"], got["dtype"]) == (7, 5, 11, "float64")
    assert got["ok"] is True and got["max_abs_error"] <= got["tolerance"]


@pytest.mark.parametrize("dtype", ["float32", "complex128", "int64"])
def test_dtypes_on_mpi(run, dtype):
    got = report(run("mpi", "fsdp", 2, "--m", "9", "--k", "300", "--n", "5", "--dtype", dtype, "--check", "--json"))
    assert got["dtype"] == dtype and got["ok"] is True


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_human_report(run, strategy):
    done = run("mpi", strategy, 4, "--m", "64", "--check")
    assert done.returncode == 0, done.stderr
    mesh = f"{strategies.get(strategy).axes[0]}=4"
    assert f"spmd {strategy}: 4 ranks (mesh {mesh}) on mpi, A 64x1024 @ B 1024x1024, float64" in done.stdout
    assert "GFLOP/s" in done.stdout and "OK" in done.stdout


def test_generated_inputs_do_not_depend_on_strategy_or_ranks(run, tmp_path):
    outs = []
    for i, (backend, strategy, ranks) in enumerate([("threads", "dp", 1), ("mpi", "fsdp", 3)]):
        out = tmp_path / f"c{i}.npy"
        assert (
            run(
                backend, strategy, ranks, "--m", "300", "--k", "20", "--n", "270", "--dtype", "int64", "--out", str(out)
            ).returncode
            == 0
        )
        outs.append(np.load(out, allow_pickle=False))
    np.testing.assert_array_equal(outs[0], outs[1])


def test_fsdp_ring_of_16_mb_shards_on_2_mpi_ranks_does_not_deadlock(run):
    got = report(run("mpi", "fsdp", 2, "--m", "2048", "--k", "2048", "--n", "2048", "--json"))
    assert got["ranks"] == 2


@pytest.fixture
def matrices(tmp_path):
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((10, 6)), rng.standard_normal((6, 7))
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    return a, b, tmp_path


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_file_inputs_and_output(run, matrices, backend, strategy):
    a, b, d = matrices
    got = report(
        run(
            backend,
            strategy,
            3,
            "--a",
            str(d / "a.npy"),
            "--b",
            str(d / "b.npy"),
            "--out",
            str(d / "c.npy"),
            "--check",
            "--json",
        )
    )
    assert (got["m"], got["k"], got["n"]) == (10, 6, 7) and got["ok"] is True
    np.testing.assert_allclose(np.load(d / "c.npy", allow_pickle=False), a @ b, rtol=1e-12)


def bad_file(kind, d):
    """Write a bad B file of the given kind; return its path and what the error must say."""
    path = d / f"bad-{kind}.npy"
    if kind == "missing":
        return path, "no such file"
    if kind == "not-npy":
        path.write_text("1 2 3\n")
        return path, "is not a .npy file"
    if kind == "pickle":
        path.write_bytes(pickle.dumps([[1.0, 2.0]]))
        return path, "is not a .npy file"
    if kind == "object-array":
        np.save(path, np.array([[1.0, None]], dtype=object), allow_pickle=True)
        return path, "holds Python objects, which would need unpickling"
    if kind == "truncated":
        np.save(path, np.ones((6, 7)))
        path.write_bytes(path.read_bytes()[:-8])
        return path, "cannot be read as a .npy array"
    if kind == "mismatched":
        np.save(path, np.ones((5, 7)))
        return path, "is 10x6 but --b .* is 5x7: A's columns must equal B's rows"
    if kind == "3-d":
        np.save(path, np.ones((6, 7, 1)))
        return path, "must hold a 2-D matrix, holds shape \\(6, 7, 1\\)"
    raise AssertionError(kind)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["missing", "not-npy", "pickle", "object-array", "truncated", "mismatched", "3-d"])
def test_bad_input_files_end_the_run_with_a_clear_error(run, matrices, backend, kind):
    _, _, d = matrices
    path, message = bad_file(kind, d)
    done = run(backend, "fsdp", 3, "--a", str(d / "a.npy"), "--b", str(path))
    # checked before any rank starts: one line, once per job (not once per MPI process), exit 2
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("python -m spmd: error: --"), done.stderr
    assert "Traceback" not in done.stderr
    assert re.search(message, done.stderr), done.stderr


def test_devices_must_match_the_mpi_world(run):
    done = run("mpi", "dp", 2, "--devices", "3", "--m", "8")
    assert done.returncode != 0
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "--devices 3 disagrees with the 2 MPI processes started" in done.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--m", "-1"], "--m must be >= 0, got -1"),
        (["--a", "x.npy"], "--a and --b go together"),
        (["--a", "x.npy", "--b", "y.npy", "--m", "3"], "with --a/--b the files give the shapes"),
        (["--devices", "0"], "--devices must be >= 1"),
        (["--dtype", "float16"], "invalid choice: 'float16'"),
    ],
)
def test_bad_usage_exits_2_naming_the_flag(run, args, message):
    done = run("threads", "fsdp", None, *args)
    assert done.returncode == 2
    assert message in done.stderr


def wrong_rank_fn(world, mesh, blocks, problem, workspace):
    """DP with a bug: rank 0 forgets its own rows."""
    c = DP.rank_fn(world, mesh, blocks, problem, workspace)
    return None if c is None else c * (np.arange(c.shape[0])[:, None] > 0)


def test_a_wrong_product_fails_the_check_with_status_1(capsys, monkeypatch):
    monkeypatch.setitem(
        strategies.STRATEGIES, "broken-dp", dataclasses.replace(DP, name="broken-dp", rank_fn=wrong_rank_fn)
    )
    assert cli.main(["broken-dp", "--devices", "2", "--m", "6", "--k", "4", "--n", "5", "--check"]) == 1
    assert "MISMATCH" in capsys.readouterr().out


@pytest.mark.parametrize("module", ["spmd.dp", "spmd.fsdp"])
def test_the_older_commands_still_work(mpiexec, module):
    done = subprocess.run(
        [mpiexec, "-n", "2", sys.executable, "-m", module, "--m", "9", "--check", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    got = report(done)
    assert got["strategy"] == module.split(".")[1] and got["ok"] is True and got["ranks"] == 2


@pytest.mark.parametrize(
    "args, message",
    [
        (["tp"], "unknown strategy 'tp'; did you mean"),
        (["mlp-fdsp"], "unknown strategy 'mlp-fdsp'; did you mean mlp-fsdp"),
        (["fsdp", "--mesh", "fsdp=3"], "mesh fsdp=3 has 3 ranks (3) but the world has 4"),
        (["fsdp", "--mesh", "dp=4"], "strategy 'fsdp' needs mesh axes fsdp, got dp=4"),
        (["fsdp", "--mesh", "fsdp"], "expected name=size parts like fsdp=2,tp=2, got 'fsdp'"),
    ],
)
def test_bad_strategy_or_mesh_exits_2_naming_it(args, message):
    done = subprocess.run(
        [sys.executable, "-m", "spmd", *args, "--devices", "4"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_check_product_bounds():
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((50, 40)), rng.standard_normal((40, 30))
    error, tolerance = check_product(a @ b, a, b)
    assert error == 0 and tolerance > 0
    wrong = a @ b
    wrong[3, 4] += 1e-6
    assert check_product(wrong, a, b)[0] > check_product(wrong, a, b)[1]
    ints = np.arange(6).reshape(2, 3)
    assert check_product(ints @ ints.T + 1, ints, ints.T) == (1.0, 0.0)


def test_a_rank_given_another_file_stops_the_job_naming_it(mpiexec, matrices):
    """MPMD launch: ranks 0-1 read b.npy, rank 2 a B of another shape and dtype."""
    _, _, d = matrices
    np.save(d / "other-b.npy", np.ones((6, 9), dtype=np.float32))
    command = [sys.executable, "-m", "spmd.fsdp", "--a", str(d / "a.npy")]
    done = subprocess.run(
        [
            mpiexec,
            "-n",
            "2",
            *command,
            "--b",
            str(d / "b.npy"),
            ":",
            "-n",
            "1",
            *command,
            "--b",
            str(d / "other-b.npy"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert (
        "ranks disagree on the inputs: rank 0 has A 10x6 float64, B 6x7 float64; "
        "rank 2 has A 10x6 float64, B 6x9 float32"
    ) in done.stderr


def test_chaos_on_the_command_line(run):
    got = report(run("threads", "fsdp", 5, "--m", "33", "--k", "8", "--n", "21", "--chaos", "7", "--check", "--json"))
    assert got["ok"] is True


def test_version_and_an_mpi_backend_without_a_launcher():
    """--version names the package's; --backend mpi outside mpirun would run one rank: refused, naming why."""
    from importlib.metadata import version

    done = subprocess.run([sys.executable, "-m", "spmd", "--version"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == f"spmd {version('spmd')}"
    done = subprocess.run(
        [sys.executable, "-m", "spmd", "train", "--backend", "mpi", "--devices", "4"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PMI_SIZE": ""},
    )
    assert done.returncode == 2 and "--backend mpi without an MPI launcher runs one rank, not 4" in done.stderr


@pytest.mark.parametrize("args", [["fsdp", "--devices", "512"], ["train", "--mesh", "dp=256", "--batch", "512"]])
def test_more_thread_ranks_than_one_process_can_run_are_refused_at_once(args):
    """Not a silent crawl: one line naming the limit and the launcher to use instead, before any rank starts."""
    run = subprocess.run([sys.executable, "-m", "spmd", *args], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "on threads: at most 128" in run.stderr and "mpiexec -n" in run.stderr
    assert "Traceback" not in run.stderr


def test_the_thread_limit_admits_its_own_count():
    from spmd.harness.cli import MAX_THREAD_RANKS, LaunchConfig
    from spmd.transport.mesh import Mesh

    assert LaunchConfig("threads", MAX_THREAD_RANKS).thread_ranks(None) == MAX_THREAD_RANKS
    assert LaunchConfig("threads").thread_ranks(Mesh({"dp": 2, "tp": 3})) == 6
    with pytest.raises(ValueError, match=f"{MAX_THREAD_RANKS + 1} ranks on threads"):
        LaunchConfig("threads").thread_ranks(Mesh({"dp": MAX_THREAD_RANKS + 1}))


@pytest.mark.parametrize(
    "args, hint",
    [
        (["fsdp", "--devics", "4"], "--devics: did you mean --devices?"),
        (["train", "--tie-embedings"], "did you mean --tie-embeddings or --no-tie-embeddings?"),
    ],
)
def test_a_mistyped_flag_gets_the_closest_names(args, hint):
    run = subprocess.run([sys.executable, "-m", "spmd", *args], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and hint in run.stderr and len(run.stderr.strip().splitlines()) == 1
