"""The same seconds on the same cores spent training on text, spmd against PyTorch eager: the lower validation loss.

python -m spmd.bench text --out DIR [--data DIR] [--seconds S] [--shape L,h,f,heads,seq,batch ...] [--quick].

The run: the LM at (L, h, f, heads, seq, batch) = (4, 128, 384, 4, 128, 16) on the default corpus (prepared into
DIR/corpus unless --data names one), AdamW at 3e-3 after 100 warmup steps, a cosine down to 3e-4 at the last
step, global-norm clipping at 1. Each contender (spmd dp=2 and fsdp=2 under mpiexec; PyTorch one process of every
core's threads and DDP over gloo, spmd/bench/torch_text.py) first runs CALIBRATION steps on the corpus: its median
step, the first left out (spmd.harness.breakdown.timed), says how many steps fit in --seconds. The faster of each
side then trains that many, its cosine ending at its own last step, from the same initial values on the same
batches (PyTorch's peer loads spmd's; their losses agree step by step to float32 rounding), and both are scored on
the same validation tokens. --shape (repeatable) races at other shapes: how a run's size is picked for a time.
Writes text.json and text.md (the table, printed too).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from spmd.bench.lm import machine, spmd_report, torch_importable, torch_peer
from spmd.harness.breakdown import timed
from spmd.usage import Parser, fail

SHAPE = (4, 128, 384, 4, 128, 16)
QUICK_SHAPE = (2, 32, 64, 4, 32, 8)
SCHEDULE: dict[str, float] = {"lr": 3e-3, "warmup": 100, "lr_min": 3e-4, "clip_grad": 1.0}
EVAL_TOKENS = 32768
CALIBRATION = 30
CAPTION = "each side's faster run for the steps its calibrated step fits"
# (shape, ranks, mesh or PyTorch's mode, steps, corpus, validation tokens) -> the run's record
Trainer = Callable[[tuple, int, str, int, str, int], dict]
SPMD_RUNS = [("spmd dp=2", 2, "dp=2"), ("spmd fsdp=2", 2, "fsdp=2")]
TORCH_RUNS = [("torch 1 process", 1, "single"), ("torch DDP", 2, "ddp")]


def spmd_train(shape: tuple, ranks: int, mesh: str, steps: int, data: str, eval_tokens: int) -> dict:
    """spmd's run on the corpus: its step seconds (all), the steps' sum and the validation at the last step."""
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in SCHEDULE.items()]
    flags += ["--lr-schedule", "cosine", "--data", data, "--eval-every", str(steps), "--eval-tokens", str(eval_tokens)]
    report = spmd_report(shape, ranks, mesh, steps, flags=tuple(flags))
    last = report["validation"][-1]
    seconds = report["step_seconds"]
    return {
        "steps": steps,
        "first_loss": report["losses"][0],
        "step_seconds": seconds,
        "train_seconds": float(sum(seconds)),
        "validation": {"loss": last["loss"], "bits_per_byte": last["bits_per_byte"]},
    }


def torch_train(shape: tuple, ranks: int, mode: str, steps: int, data: str, eval_tokens: int) -> dict:
    """The PyTorch peer's run on the corpus (spmd/bench/torch_text.py)."""
    from spmd.bench.lm import shape_fields

    config = {**shape_fields(shape), **SCHEDULE, "steps": steps, "data": data}
    result = torch_peer("spmd.bench.torch_text", {**config, "eval_tokens": eval_tokens, "mode": mode, "ranks": ranks})
    return {"steps": steps, **{k: result[k] for k in ("first_loss", "step_seconds", "train_seconds", "validation")}}


def prepared(data: str | None, out: Path, log) -> str:
    """The corpus folder: --data, or the default corpus prepared into out/corpus (once; its summary to the log,
    so that stdout is the table alone)."""
    if data is not None:
        return data
    folder = out / "corpus"
    if not (folder / "meta.json").exists():
        command = [sys.executable, "-m", "spmd", "data", "prepare", "--out", str(folder)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
        log(done.stdout.strip())
    return str(folder)


def race(shape: tuple, seconds: float, data: str, with_torch: bool, log) -> dict:
    """Calibrate every contender, then train the fastest of each side for as many steps as fit in `seconds`."""
    sides: dict[str, list[tuple[str, int, str, Trainer]]] = {"spmd": [(n, r, m, spmd_train) for n, r, m in SPMD_RUNS]}
    if with_torch:
        sides["torch"] = [(n, r, m, torch_train) for n, r, m in TORCH_RUNS]
    calibrated, raced = {}, {}
    for runs in sides.values():
        for name, ranks, how, train in runs:
            run = train(shape, ranks, how, CALIBRATION, data, shape[4] * shape[5])
            calibrated[name] = float(np.median(timed(run["step_seconds"])))
            log(f"{name}: calibrated at {calibrated[name]:.4f} s a step")
        name, ranks, how, train = min(runs, key=lambda r: calibrated[r[0]])
        steps = max(int(seconds / calibrated[name]), 1)
        log(f"{name}: {steps} steps in {seconds:g} s")
        raced[name] = train(shape, ranks, how, steps, data, EVAL_TOKENS)
        log(f"{name}: validation {raced[name]['validation']['loss']:.4f} nats a token")
    return {"shape": list(shape), "calibrated": calibrated, "raced": raced}


def table(results: list[dict], seconds: float) -> str:
    """Each shape's contenders: calibrated step, and for the raced ones the steps, time and validation."""
    lines = [
        f"{seconds:g} s of training on the same cores: " + CAPTION,
        "| shape (L, h, f, heads, seq, batch) | run | step s (calibration's median) | steps in the time "
        "| steps' seconds summed | first loss | validation nats a token | bits a byte |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for result in results:
        shape = ", ".join(map(str, result["shape"]))
        for name, step in result["calibrated"].items():
            run = result["raced"].get(name)
            if run is None:
                lines.append(f"| {shape} | {name} | {step:.4f} | not raced (its side's faster one is) |" + " - |" * 4)
                continue
            v = run["validation"]
            lines.append(
                f"| {shape} | {name} | {step:.4f} | {run['steps']:,} | {run['train_seconds']:.1f} "
                f"| {run['first_loss']:.6f} | {v['loss']:.4f} | {v['bits_per_byte']:.4f} |"
            )
    return "\n".join(lines) + "\n"


def shape_of(text: str) -> tuple[int, ...]:
    """--shape L,h,f,heads,seq,batch."""
    try:
        shape = tuple(int(x) for x in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 6 or min(shape) < 1:
        raise ValueError(f"--shape must be six positive integers L,h,f,heads,seq,batch, got {text!r}")
    return shape


def main(argv=None) -> int:
    parser = Parser(prog="python -m spmd.bench text", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for text.json and text.md")
    parser.add_argument("--data", help="a prepared corpus (default: the default corpus, prepared into OUT/corpus)")
    parser.add_argument("--seconds", type=float, help="the training time each side gets (150; 10 with --quick)")
    parser.add_argument(
        "--shape",
        action="append",
        help="L,h,f,heads,seq,batch (repeatable: a race at each; default 4,128,384,4,128,16)",
    )
    parser.add_argument("--quick", action="store_true", help="a small model (the benchmark's plumbing)")
    parser.add_argument("--no-torch", action="store_true", help="leave the PyTorch peer out even if importable")
    args = parser.parse_args(argv)
    seconds = args.seconds if args.seconds is not None else 10.0 if args.quick else 150.0
    if not (seconds > 0 and np.isfinite(seconds)):
        parser.error(f"--seconds must be a finite number > 0, got {args.seconds}")
    try:
        shapes = [shape_of(t) for t in args.shape] if args.shape else [QUICK_SHAPE if args.quick else SHAPE]
    except ValueError as exc:
        parser.error(str(exc))
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        fail(parser.prog, f"--out {args.out}: cannot be made a folder: {exc.strerror}")
    with_torch = not args.no_torch and torch_importable()
    started = time.perf_counter()

    def log(text: str) -> None:
        print(f"[{time.perf_counter() - started:5.0f} s] {text}", file=sys.stderr, flush=True)

    if not with_torch and not args.no_torch:
        log("torch is not importable: spmd alone (pip install torch==2.13.0, an optional peer)")
    data = prepared(args.data, out, log)
    results = [race(shape, seconds, data, with_torch, log) for shape in shapes]
    processor, blas = machine()
    meta = {"processor": processor, "blas": blas, "seconds": seconds, "eval_tokens": EVAL_TOKENS, **SCHEDULE}
    (out / "text.json").write_text(json.dumps({"meta": meta, "races": results}, indent=1))
    text = table(results, seconds)
    (out / "text.md").write_text(text)
    print(text, end="")
    return 0
