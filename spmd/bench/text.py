"""The same seconds on the same cores spent training on text, spmd against PyTorch eager: the lower validation loss.

python -m spmd.bench text --out DIR [--data DIR] [--seconds S] [--shape L,h,f,heads,seq,batch ...] [--quick].

The run: the LM at (L, h, f, heads, seq, batch) = (4, 128, 384, 4, 128, 16) on the default corpus (prepared into
DIR/corpus unless --data names one), AdamW at 3e-3 after 100 warmup steps, a cosine down to 3e-4 at the last
step, global-norm clipping at 1. Each contender (spmd dp=2 and fsdp=2 under mpiexec; PyTorch one process of every
core's threads and DDP over gloo, spmd/bench/torch_text.py) first runs CALIBRATION_STEPS on the corpus: its median
step, the first left out (spmd.harness.breakdown.timed), says how many steps fit in --seconds. The faster of each
side then trains that many, its cosine ending at its own last step, from the same initial values on the same
batches (PyTorch's peer loads spmd's; their losses agree step by step to float32 rounding), and both are scored on
the same validation tokens. --shape (repeatable) races at other shapes: how a run's size is picked for a time.
Writes text.json and text.md (the table, printed too).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from spmd.bench.lm import machine, shape_fields, spmd_report, torch_importable, torch_peer
from spmd.data.loader import Corpus
from spmd.data.prepare import prepare
from spmd.data.tokens import TokenFileError
from spmd.harness.breakdown import timed
from spmd.model import Net
from spmd.usage import Parser, fail

SHAPE = (4, 128, 384, 4, 128, 16)
QUICK_SHAPE = (2, 32, 64, 4, 32, 8)
SCHEDULE: dict[str, float] = {"lr": 3e-3, "warmup": 100, "lr_min": 3e-4, "clip_grad": 1.0}
EVAL_TOKENS = 32768
CALIBRATION_STEPS = 30
CALIBRATION_TIMEOUT = 1800.0  # s: a calibration's pace is what it measures, so its limit is fixed
AGREE = 1e-5  # the two sides' first losses, relative: the same initial values and batch
CAPTION = "each side's faster run for the steps its calibrated step fits"


@dataclass(frozen=True)
class Race:
    """What every run of one race shares: the model's shape and vocabulary, the corpus."""

    shape: tuple
    vocab: int
    data: str

    def timeout(self, steps: int, step: float) -> float:
        """A run's limit: its steps at 4x the calibrated pace, and start-up (a hung run fails, a slow one not)."""
        return 600 + 4 * steps * step


# (race, ranks, mesh or PyTorch's mode, steps, validation tokens, seconds allowed) -> the run's record
Trainer = Callable[[Race, int, str, int, int, float], dict]
SPMD_RUNS = [("spmd dp=2", 2, "dp=2"), ("spmd fsdp=2", 2, "fsdp=2")]
TORCH_RUNS = [("torch 1 process", 1, "single"), ("torch DDP", 2, "ddp")]


def spmd_train(race: Race, ranks: int, mesh: str, steps: int, eval_tokens: int, timeout: float) -> dict:
    """spmd's run on the corpus: its step seconds (all), the steps' sum and the validation at the last step."""
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in SCHEDULE.items()]
    flags += ["--lr-schedule", "cosine", "--data", race.data, "--eval-every", str(steps)]
    flags += ["--eval-tokens", str(eval_tokens)]
    report = spmd_report(race.shape, ranks, mesh, steps, flags=tuple(flags), vocab=race.vocab, timeout=timeout)
    last = report["validation"][-1]
    seconds = report["step_seconds"]
    return {
        "steps": steps,
        "first_loss": report["losses"][0],
        "step_seconds": seconds,
        "train_seconds": float(sum(seconds)),
        "validation": {"loss": last["loss"], "bits_per_byte": last["bits_per_byte"]},
    }


def torch_train(race: Race, ranks: int, mode: str, steps: int, eval_tokens: int, timeout: float) -> dict:
    """The PyTorch peer's run on the corpus (spmd/bench/torch_text.py)."""
    config = {**shape_fields(race.shape, race.vocab), **SCHEDULE, "steps": steps, "data": race.data}
    config.update(eval_tokens=eval_tokens, mode=mode, ranks=ranks)
    result = torch_peer("spmd.bench.torch_text", config, timeout)
    return {"steps": steps, **{k: result[k] for k in ("first_loss", "step_seconds", "train_seconds", "validation")}}


def prepared(data: str | None, out: Path, log) -> str:
    """The corpus folder: --data, or the default corpus prepared into out/corpus (once; its summary to the log,
    so that stdout is the table alone)."""
    if data is not None:
        return data
    folder = out / "corpus"
    if not (folder / "meta.json").exists():
        made = prepare([], str(folder))  # no inputs: the default corpus
        log(f"{folder}: the default corpus, {made['train_tokens']:,} + {made['val_tokens']:,} tokens")
    return str(folder)


def race(race: Race, seconds: float, with_torch: bool, log) -> dict:
    """Calibrate every contender, then train the fastest of each side for as many steps as fit in `seconds`."""
    sides: dict[str, list[tuple[str, int, str, Trainer]]] = {"spmd": [(n, r, m, spmd_train) for n, r, m in SPMD_RUNS]}
    if with_torch:
        sides["torch"] = [(n, r, m, torch_train) for n, r, m in TORCH_RUNS]
    one_batch = race.shape[4] * race.shape[5]
    calibrated, raced = {}, {}
    for runs in sides.values():
        for name, ranks, how, train in runs:
            run = train(race, ranks, how, CALIBRATION_STEPS, one_batch, CALIBRATION_TIMEOUT)
            calibrated[name] = float(np.median(timed(run["step_seconds"])))
            log(f"{name}: calibrated at {calibrated[name]:.4f} s a step")
        name, ranks, how, train = min(runs, key=lambda r: calibrated[r[0]])
        steps = max(int(seconds / calibrated[name]), 1)
        log(f"{name}: {steps} steps in {seconds:g} s")
        raced[name] = train(race, ranks, how, steps, EVAL_TOKENS, race.timeout(steps, calibrated[name]))
        log(f"{name}: validation {raced[name]['validation']['loss']:.4f} nats a token")
    first = [run["first_loss"] for run in raced.values()]
    if max(first) - min(first) > AGREE * abs(first[0]):  # not the same computation: the race would mean nothing
        raise RuntimeError(f"the sides' first losses differ: {dict(zip(raced, first, strict=True))}")
    return {"shape": list(race.shape), "calibrated": calibrated, "raced": raced}


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


def checked(shapes: list[tuple], data: str) -> list[Race]:
    """Each shape's race, refused before any run where the model or the corpus cannot be: a ValueError or
    TokenFileError naming the flag."""
    races = []
    for shape in shapes:
        corpus = Corpus(data, shape[4], shape[5], 0)  # its files checked once a shape; the vocabulary is its
        corpus.eval_batches(EVAL_TOKENS)
        fields = shape_fields(shape, corpus.vocab)
        named = f"--shape {','.join(map(str, shape))}"
        if shape[5] % 2:
            raise ValueError(f"{named}: the batch must be even (2 ranks take halves)")
        try:
            Net(model="llama", dtype="float32", **fields)  # every reason the sizes cannot work
        except ValueError as exc:
            raise ValueError(f"{named}: {exc}") from None
        races.append(Race(shape, corpus.vocab, data))
    return races


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
    try:
        races = checked(shapes, data)
    except (ValueError, TokenFileError) as exc:
        parser.error(str(exc))
    results = [race(r, seconds, with_torch, log) for r in races]
    processor, blas = machine()
    meta = {"processor": processor, "blas": blas, "seconds": seconds, "eval_tokens": EVAL_TOKENS, **SCHEDULE}
    (out / "text.json").write_text(json.dumps({"meta": meta, "races": results}, indent=1))
    text = table(results, seconds)
    (out / "text.md").write_text(text)
    print(text, end="")
    return 0
