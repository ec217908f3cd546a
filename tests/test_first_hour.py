"""A newcomer's first hour (issue 18): each mistake a new user makes gets one clear line, checks cannot pass on
NaN, the front takes every strategy with flags anywhere, and the collectives keep their promises.

Each test here failed on the main branch before that issue.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tomllib

from spmd.collectives import all_to_all, broadcast
from spmd.harness.train_job import max_relative_error
from spmd.trainers.presets import PRESETS
from spmd.transport.group import Group

ROOT = Path(__file__).resolve().parent.parent


def spmd(*args, mpi=None, module="spmd", env=None):
    command = [sys.executable, "-m", module, *args]
    if mpi is not None:
        command = [mpi[0], "-n", str(mpi[1]), *command]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)


def one_line_error(done, *needles):
    """Exit status 2 and exactly one line on stderr, holding every needle, no traceback."""
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    for needle in needles:
        assert needle in done.stderr, done.stderr


# 1. packaging -----------------------------------------------------------------------------------------------


def test_the_wheel_takes_every_subpackage_and_the_typing_marker():
    """`make test-install` builds and installs the wheel for real; this catches the config at once."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert isinstance(config["packages"], dict), "a fixed package list leaves subpackages out of the wheel"
    include = config["packages"]["find"]["include"]
    packages = {str(p.parent.relative_to(ROOT)).replace("/", ".") for p in (ROOT / "spmd").rglob("__init__.py")}
    assert len(packages) > 5
    for package in packages:
        assert any(re.fullmatch(pattern.replace(".", r"\.").replace("*", ".*"), package) for pattern in include)
    assert "py.typed" in config["package-data"]["spmd"]


# 2. checks that cannot pass on NaN -----------------------------------------------------------------------------


def test_training_that_diverges_fails_naming_the_step_rank_and_layer():
    done = spmd("mlp-dp", "--devices", "2", "--lr", "1e150", "--steps", "4", "--check")
    assert done.returncode == 1
    assert re.search(r"NonFiniteError: step \d: the loss is (nan|inf); rank \d's parameters of layer \d", done.stderr)
    assert "OK" not in done.stdout and "Traceback" not in done.stderr


def test_a_nan_error_is_never_within_tolerance():
    class Engine:
        def owned(self):
            return [(0, np.arange(3), np.array([1.0, np.nan, 2.0]))]

    mlp = PRESETS["mlp-dp"].net(layers=1, hidden=1, ffn=1, batch=2, steps=1)
    assert max_relative_error(Engine(), [float("nan")], mlp) == float("inf")


def test_the_matmul_check_names_a_nan_input(tmp_path):
    a = np.ones((6, 4))
    a[2, 3] = np.nan
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", np.ones((4, 5)))
    done = spmd("fsdp", "--devices", "2", "--a", str(tmp_path / "a.npy"), "--b", str(tmp_path / "b.npy"), "--check")
    assert done.returncode == 1
    assert "check: FAILED: input A has nan at row 2, column 3" in done.stdout and "RuntimeWarning" not in done.stderr


# 3. integer mode: exact where it promises, refused where it cannot be ------------------------------------------


def test_integer_mode_refuses_sizes_where_sums_could_round():
    one_line_error(spmd("mlp-dp", "--integers", "--check"), "--integers at these sizes is not exact", "2^53")
    one_line_error(
        spmd("mlp-dp", "--integers", "--layers", "2", "--hidden", "16", "--ffn", "32", "--steps", "2"),
        "not exact",
        "at step 2",
    )


def test_integer_mode_is_bitwise_where_accepted():
    done = spmd(
        "mlp-fsdp",
        "--integers",
        "--layers",
        "2",
        "--hidden",
        "16",
        "--ffn",
        "32",
        "--devices",
        "3",
        "--check",
        "--json",
    )
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["ok"] and report["max_relative_error"] == 0 and report["tolerance"] == 0


# 4. user mistakes: one line, once, before any rank starts ------------------------------------------------------


@pytest.mark.parametrize(
    "args, needle",
    [
        (["fsdp", "--seed", "-1"], "--seed must be >= 0, got -1"),
        (["mlp-dp", "--seed", "-1"], "--seed must be >= 0, got -1"),
        (["fsdp", "--out", "/no/such/folder/c.npy"], "--out /no/such/folder/c.npy: folder /no/such/folder does not"),
        (["fsdp", "--trace", "/no/such/folder/t.json"], "--trace /no/such/folder/t.json: folder"),
        (["mlp-tp", "--trace", "/no/such/folder/t.json"], "--trace /no/such/folder/t.json: folder"),
        (["mlp-dp", "--json", "/no/such/folder/r.json"], "--json /no/such/folder/r.json: folder"),
        (["mlp-dp", "--lr", "-1"], "--lr must be a finite number > 0"),
        (["mlp-dp", "--lr", "nan"], "--lr must be a finite number > 0"),
        (["mlp-dp", "--momentum", "5"], "--momentum must be in [0, 1)"),
        (["mlp-dp", "--steps", "0"], "steps must be >= 1"),
        # the default micro-batches derive from the batch (0 rows give 0): --tokens is named, not --microbatches
        (["mlp-pp-gpipe", "--tokens", "0"], "--tokens must be >= 1, got 0"),
        (["mlp-dp", "--log-every", "0"], "--log-every must be >= 1"),
        (["train", "--microbatches", "0"], "microbatches must be >= 1, got 0"),
        (
            ["train", "--mesh", "pp=2", "--pipeline", "interleaved-1f1b", "--chunks", "0"],
            "--chunks must be >= 1, got 0",
        ),
    ],
)
def test_usage_mistakes_are_one_line_naming_the_flag(args, needle):
    one_line_error(spmd(*args, "--devices", "2"), needle)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["fsdp", "--devices", "3"], "--devices 3 disagrees with the 2 MPI processes started"),
        (["mlp-dp", "--devices", "3"], "--devices 3 disagrees with the 2 MPI processes started"),
        (["mlp-dp", "--backend", "threads"], "--backend threads under an MPI launcher would run the whole job"),
        (["fsdp", "--a", "missing.npy", "--b", "missing.npy"], "--a missing.npy: no such file"),
        (["mlp-zero5"], "unknown strategy 'mlp-zero5'"),
    ],
)
def test_under_mpirun_a_mistake_is_printed_once(mpiexec, args, needle):
    one_line_error(spmd(*args, mpi=(mpiexec, 2)), needle)


def test_a_failure_inside_the_ranks_is_one_line_unless_debugging(mpiexec):
    args = ("mlp-dp", "--lr", "1e150", "--steps", "4")
    done = spmd(*args, mpi=(mpiexec, 2))
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert done.stderr.count("NonFiniteError") == 1, done.stderr  # not once per rank
    debug = spmd(*args, "--debug", mpi=(mpiexec, 2))
    assert "Traceback (most recent call last)" in debug.stderr


# 5. one front for every strategy ------------------------------------------------------------------------------


def test_help_lists_matmul_and_training_strategies():
    out = spmd("--help").stdout
    for name in ["dp", "fsdp", *PRESETS]:
        assert re.search(rf"^  {re.escape(name)} ", out, re.M), name


@pytest.mark.parametrize(
    "args",
    [
        ["--devices", "2", "mlp-dp", "--check"],
        ["mlp-zero3", "--devices", "2", "--check"],
        ["--devices", "2", "--check", "fsdp", "--m", "9"],
    ],
)
def test_flags_before_the_strategy_and_aliases(args):
    done = spmd(*args, "--quiet" if "fsdp" not in args else "--json")
    assert done.returncode == 0, done.stderr


def test_a_typo_gets_the_close_names():
    one_line_error(spmd("mlp-fdsp"), "did you mean mlp-fsdp")


# 6. the planner refuses nonsense --------------------------------------------------------------------------------

PLAN = ["--layers", "4", "--hidden", "64", "--seq", "16", "--batch", "2", "--devices", "4"]


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--bytes", "-2"], "--bytes: invalid choice: -2"),
        (["--layers", "0"], "--layers must be >= 1, got 0"),
        (["--mesh", "fsdp=2,tp=4"], "--mesh fsdp=2,tp=4 spans 8 devices but --devices is 4"),
        (["--memory-gb", "0"], "--memory-gb must be a number > 0"),
    ],
)
def test_the_planner_refuses_nonsense(args, needle):
    one_line_error(spmd(*PLAN, *args, module="spmd.plan"), needle)


def test_the_benchmark_refuses_a_bad_out_in_one_line(tmp_path):
    (tmp_path / "file").write_text("")
    one_line_error(spmd(module="spmd.bench"), "the following arguments are required: --out")
    one_line_error(
        spmd("--out", str(tmp_path / "file" / "results"), module="spmd.bench"), "results: cannot be made a folder"
    )


# 7. traces record compute for every training strategy ---------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_training_traces_hold_compute_on_every_rank(tmp_path, name):
    mesh = ["--mesh", "fsdp=2,tp=2"] if name == "mlp-fsdp-tp" else ["--layers", "8"] if PRESETS[name].chunked else []
    done = spmd(name, "--devices", "4", *mesh, "--steps", "1", "--quiet", "--trace", str(tmp_path / "t.json"))
    assert done.returncode == 0, done.stderr
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    compute = [e for e in events if e.get("cat") == "compute"]
    assert {e["pid"] for e in compute} == {0, 1, 2, 3}
    assert {e["name"][0] for e in compute} >= {"F", "B"}  # forward and backward, told apart by name


# 8. plots: errors name the file and the fix -------------------------------------------------------------------


def test_a_plot_given_the_wrong_file_says_which_flag_fits(tmp_path):
    report = tmp_path / "r.json"
    assert spmd("mlp-dp", "--devices", "2", "--quiet", "--json", str(report)).returncode == 0
    one_line_error(
        spmd(str(report), "--out", str(tmp_path / "x.png"), module="spmd.observe.plot"),
        str(report),
        "give it as --memory",
    )
    one_line_error(
        spmd("--memory", str(tmp_path / "none.json"), "--out", "x.png", module="spmd.observe.plot"),
        "none.json: cannot be read",
    )


def test_the_table_names_a_missing_or_foreign_file_and_both_tools_read_a_report_of_the_old_key(tmp_path):
    report = tmp_path / "r.json"
    assert spmd("mlp-dp", "--devices", "2", "--quiet", "--json", str(report)).returncode == 0
    one_line_error(spmd(str(tmp_path / "none.json"), module="spmd.observe.table"), "none.json: cannot be read")
    (tmp_path / "other.json").write_text("{}")
    one_line_error(spmd(str(tmp_path / "other.json"), module="spmd.observe.table"), "is no spmd output")
    old = json.loads(report.read_text().splitlines()[-1])
    old["mlp"] = old.pop("model")  # the key a training report had before it named every model
    (tmp_path / "old.json").write_text(json.dumps(old))
    for path in (report, tmp_path / "old.json"):
        done = spmd(str(path), module="spmd.observe.table")
        assert done.returncode == 0 and "| dp=2" in done.stdout, done.stderr
        drawn = spmd("--memory", str(path), "--out", str(tmp_path / "m.png"), module="spmd.observe.plot")
        assert drawn.returncode == 0, drawn.stderr


def test_forward_and_backward_compute_have_their_own_colours():
    from spmd.observe.plot import color_of

    assert color_of({"cat": "compute", "name": "F3"}) != color_of({"cat": "compute", "name": "B3"})
    assert color_of({"cat": "compute", "name": "B layer 1"}) == color_of({"cat": "compute", "name": "B0"})
    assert len({color_of({"cat": "compute", "name": f"{op} layer 1"}) for op in "FBIW"}) == 4


# 10. progress, units, pipelines that pipeline by default -------------------------------------------------------


def test_progress_lines_per_step_and_quiet():
    done = spmd("mlp-dp", "--devices", "2", "--steps", "4", "--log-every", "2")
    lines = re.findall(
        r"^step (\d)/4  loss \S+  lr \S+  \S+ s  [\d,]+ tokens/s \([\d,]+ a device\)  elapsed \d+s"
        r"(, about \d+s left)?$",
        done.stderr,
        re.M,
    )
    assert [(step, bool(left)) for step, left in lines] == [("2", True), ("4", False)]  # nothing left at the end
    assert len(re.findall("^step ", spmd("mlp-dp", "--devices", "2", "--steps", "25").stderr, re.M)) == 3  # 10, 20, 25
    assert "MiB" in done.stdout and "KiB" not in done.stdout  # one binary unit, chosen by size (was 3990.0 KiB)
    assert spmd("mlp-dp", "--devices", "2", "--quiet").stderr == ""


def test_a_pipeline_streams_micro_batches_by_default():
    report = json.loads(spmd("mlp-pp-1f1b", "--devices", "4", "--json", "--quiet").stdout.splitlines()[-1])
    assert report["model"]["microbatches"] == 8 and report["bubble_model"] == pytest.approx(3 / 11)


def test_out_dir_holds_the_report_and_the_trace(tmp_path):
    done = spmd("mlp-sp", "--devices", "2", "--quiet", "--out-dir", str(tmp_path / "run"))
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "run" / "report.json").read_text())["strategy"] == "mlp-sp"
    assert "traceEvents" in json.loads((tmp_path / "run" / "trace.json").read_text())


# 11. the collectives keep shape and refuse a root outside the group --------------------------------------------


def zero_d_round_trip(comm, rank):
    world = Group.world(comm, rank)
    got = broadcast(world, np.array(2.5) if rank == 0 else None, root=0)
    assert got.shape == () and got == 2.5
    blocks = all_to_all(world, [np.array(float(10 * rank + q)) for q in range(world.size)])
    assert [b.shape for b in blocks] == [()] * world.size
    assert [float(b) for b in blocks] == [10.0 * q + rank for q in range(world.size)]
    if world.size > 1:
        request = world.isend((rank + 1) % world.size, np.array(7, dtype=np.int32), tag=5)
        _, data = world.recv(src=(rank - 1) % world.size, tag=5)
        request.wait()
        assert data.shape == () and data.dtype == np.int32
    for root in (world.size, -1):
        with pytest.raises(ValueError, match=f"root {root} is not a rank of this group"):
            broadcast(world, np.array(1.0), root=root)


def test_zero_d_arrays_keep_their_shape_and_bad_roots_are_refused(world):
    world.run(zero_d_round_trip)


# a Python API for training, as for matmul --------------------------------------------------------------------


def test_train_mlp_from_python_equals_the_reference():
    from mlp_oracle import reference_train

    from spmd import train_mlp

    run = train_mlp("mlp-fsdp-tp", devices=4, mesh="fsdp=2,tp=2", layers=2, hidden=8, ffn=12, tokens=10, steps=2)
    losses, layers = reference_train(run.net)
    np.testing.assert_allclose(run.losses, losses, rtol=1e-12)
    for got, want in zip(run.units, layers, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    cost = PRESETS["mlp-fsdp-tp"].composition.cost(run.net, run.mesh)
    assert [sum(sent for sent, _ in t.values()) for t in run.traffic] == cost.bytes_sent and run.memory == cost.memory


def test_train_from_python_takes_a_preset_in_its_own_words():
    import spmd

    with pytest.raises(TypeError, match=r"mlp-dp takes no batch= \(its keywords: layers, hidden, ffn, tokens"):
        spmd.train(preset="mlp-dp", devices=2, batch=4)
    with pytest.raises(ValueError, match="--tokens 2 over 4 dp ranks leaves a rank no row"):
        spmd.train(preset="mlp-dp", devices=4, tokens=2)
    with pytest.raises(ValueError, match="preset='mlp-sp' sets the model and the layout"):
        spmd.train(preset="mlp-sp", devices=2, sp=True)


# Importing a module first imports the package spmd first: a module `import spmd` loads is then already loaded, so
# importing it first replays `import spmd` (checked once); each other module is imported first in turn. Each source
# is compiled once, its bytecode kept in the test's folder (compiling ~8000 times was two thirds of the test's time
# where PYTHONDONTWRITEBYTECODE is set).
IMPORT_EACH_FIRST = """
import importlib, pkgutil, sys
sys.dont_write_bytecode, sys.pycache_prefix = False, sys.argv[1]
import spmd
names = [m.name for m in pkgutil.walk_packages(spmd.__path__, "spmd.") if not m.name.endswith("__main__")]


def import_first(name):
    for key in [k for k in sys.modules if k == "spmd" or k.startswith("spmd.")]:
        del sys.modules[key]
    importlib.import_module(name)


import_first("spmd")
by_spmd = {k for k in sys.modules if k.startswith("spmd.")}
for name in names:
    if name not in by_spmd:
        import_first(name)
print(len(names), len(by_spmd))
"""


def test_every_module_imports_first_on_its_own(tmp_path):
    """A cycle shows only when its module is the first one imported (as an MPI test file can be); in a process
    of its own, so the modules imported twice never meet this one's."""
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_EACH_FIRST, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split()[0]) > 50


HELPED = [
    "spmd.harness.compose_cli",
    "spmd.harness.cli",
    "spmd.harness.generate",
    "spmd.harness.schedules_cli",
    "spmd.observe.plot",
    "spmd.observe.table",
    "spmd.plan.__main__",
    "spmd.data.prepare",
    "spmd.bench.fresh",
    "spmd.bench.run",
    "spmd.bench.train",
]


@pytest.mark.parametrize("module", HELPED)
def test_every_flag_of_every_command_says_what_it_does_and_its_default(module, monkeypatch):
    """--help in one style: each flag has a text, and a flag with a default (AdamW's learning rate included, in
    --lr's text) says it."""
    import argparse
    import importlib

    from spmd.usage import Parser

    class Captured(Exception):
        pass

    seen = []

    def capture(self, *args, **kwargs):
        seen.append(self)
        raise Captured

    monkeypatch.setattr(Parser, "parse_args", capture)
    with pytest.raises(Captured):
        importlib.import_module(module).main([])
    parser = seen[0]
    parser.format_help()
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS or "-h" in action.option_strings:
            continue
        assert action.help, f"{module}: {action.option_strings[0]} has no help text"
        if action.default is not None and action.default is not False and action.default != "" and action.nargs != 0:
            assert "default" in action.help, f"{module}: {action.option_strings[0]} hides its default"
