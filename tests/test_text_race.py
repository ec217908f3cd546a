"""python -m spmd.bench text: the same seconds of training on text, each side's faster run for as many steps as its
calibrated step fits (PyTorch's side is optional and not run here: torch is never a test dependency)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

import spmd
from spmd.bench import text
from spmd.data.prepare import prepare


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("corpus")
    prepare([str(Path(spmd.__file__).parent / "model")], str(out), val_fraction=0.2)
    return out


def race(*flags: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "spmd.bench", "text", "--no-torch", *flags]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def test_the_faster_spmd_run_trains_the_steps_its_calibration_fits_in_the_time(corpus, tmp_path):
    done = race("--out", str(tmp_path), "--data", str(corpus), "--quick", "--seconds", "1")
    assert done.returncode == 0, done.stderr
    (result,) = json.loads((tmp_path / "text.json").read_text())["races"]
    calibrated = result["calibrated"]
    assert list(calibrated) == [name for name, *_ in text.SPMD_RUNS]
    (name, run) = result["raced"].popitem()
    assert name == min(calibrated, key=calibrated.get)
    assert run["steps"] == max(int(1 / calibrated[name]), 1) == len(run["step_seconds"])
    assert abs(run["first_loss"] - math.log(257)) < 0.2  # near uniform at step 0 (initial std 0.02)
    assert run["validation"]["loss"] < run["first_loss"] and math.isfinite(run["validation"]["bits_per_byte"])
    assert (tmp_path / "text.md").read_text() == done.stdout
    assert "not raced" in done.stdout and f"| {run['steps']:,} |" in done.stdout


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--seconds", "0"], "--seconds must be a finite number > 0"),
        (["--shape", "4,128"], "--shape must be six"),
        (["--shape", "2,32,64,4,x,8"], "--shape must be six positive integers"),
        (["--shape", "2,30,64,4,32,8"], "--shape 2,30,64,4,32,8: --hidden 30 must be a multiple of --heads 4"),
        (["--shape", "2,32,64,4,32,7"], "the batch must be even"),
        (["--shape", "2,32,64,4,65536,8"], "hold no validation batch"),
    ],
)
def test_a_bad_budget_shape_or_corpus_is_one_line_naming_it_before_any_run(flags, named, corpus, tmp_path):
    done = race("--out", str(tmp_path), "--data", str(corpus), *flags)
    assert done.returncode == 2 and named in done.stderr and done.stderr.count("\n") == 1, done.stderr
    assert not (tmp_path / "text.json").exists()


def test_a_folder_that_is_no_corpus_is_named(tmp_path):
    done = race("--out", str(tmp_path), "--data", str(tmp_path / "none"))
    assert done.returncode == 2 and "none: not a prepared corpus" in done.stderr and "Traceback" not in done.stderr
