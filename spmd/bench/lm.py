"""python -m spmd.bench lm --out DIR [--quick] [--steps N] [--rounds R] [--no-torch]: the language model's training
step at the speed of the cores, against PyTorch eager on the same cores.

The Llama-style LM (RMSNorm, RoPE, SwiGLU, untied head, mean cross-entropy, AdamW, float32, vocabulary 257) at
four shapes (L, h, f, heads, seq, batch): spmd on 1 rank (threads: BLAS on every core), 2 MPI ranks under dp=2
(and 2 ranks on threads in one process: the same rank code) and fsdp=2, and 4 MPI ranks under fsdp=2,tp=2 (on 2
cores: oversubscribed); and where torch is importable the same model in PyTorch eager (spmd/bench/torch_peer.py):
one process of every core's threads, DDP and FSDP2 over gloo with a process a core. Each run is a process of its
own, `--steps` steps of which the first are left out (spmd.harness.breakdown.timed: fresh memory, and the steps
tracemalloc's peak is taken over; PyTorch's first); the runs of a shape take turns, `--rounds` times, so that the
rows compared are minutes apart at most.
Step seconds: median and min-max over every timed step of every round. MFU: the model's flops a step (6N + 12 L h
seq a token, spmd.harness.mfu) over the step, over the GEMM limit: numpy's matmuls at a layer's shapes on every
core, measured before each round of the shape. "over PyTorch's best": the median step over the fastest PyTorch
row on as many cores (1 rank: the single process; 2 and 4 ranks: any of them); below 1, spmd is faster.
Writes lm.json (every run's step times and its per-rank breakdown of where the step goes) and lm.md (the
table, printed too).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from spmd.bench.run import mpiexec
from spmd.harness.breakdown import timed
from spmd.harness.mfu import flops_per_token, gemm_rate
from spmd.model import Net
from spmd.transport.cores import available_cores
from spmd.usage import Parser, fail

SHAPES = [(4, 64, 192, 4, 64, 16), (4, 128, 384, 4, 128, 16), (4, 256, 768, 8, 256, 8), (4, 512, 1536, 8, 512, 4)]
QUICK_SHAPES = [(2, 32, 64, 4, 16, 8)]
VOCAB = 257
# (name, ranks, mesh, on threads): under mpiexec, but for 1 rank and the threads row (the same rank code)
SPMD_RUNS = [
    ("spmd 1 rank", 1, "dp=1", True),
    ("spmd dp=2", 2, "dp=2", False),
    ("spmd dp=2 threads", 2, "dp=2", True),
    ("spmd fsdp=2", 2, "fsdp=2", False),
    ("spmd fsdp=2,tp=2", 4, "fsdp=2,tp=2", False),
]
TORCH_RUNS = [("torch 1 process", 1, "single"), ("torch DDP", 2, "ddp"), ("torch FSDP2", 2, "fsdp")]


def shape_fields(shape: tuple, vocab: int = VOCAB) -> dict:
    layers, hidden, ffn, heads, seq, batch = shape
    return {"layers": layers, "hidden": hidden, "ffn": ffn, "heads": heads, "seq": seq, "batch": batch, "vocab": vocab}


def spmd_run(shape: tuple, ranks: int, mesh: str | None, steps: int, threads: bool = False) -> dict:
    """One spmd training run in processes of its own (`threads`: one process, a thread a rank): its step seconds
    and per-rank breakdown."""
    report = spmd_report(shape, ranks, mesh, steps, threads)
    return {"step_seconds": timed(report["step_seconds"]), "breakdown": report["breakdown"]}


def spmd_report(
    shape: tuple,
    ranks: int,
    mesh: str | None,
    steps: int,
    threads: bool = False,
    flags: tuple[str, ...] = (),
    vocab: int = VOCAB,
    timeout: float = 1800,
) -> dict:
    """The report (--json) of `python -m spmd train` at `shape` with `flags` added, in processes of its own."""
    fields = shape_fields(shape, vocab)
    command = [
        sys.executable,
        "-m",
        "spmd",
        "train",
        "--model",
        "llama",
        "--dtype",
        "float32",
        "--optimizer",
        "adamw",
        "--steps",
        str(steps),
        "--json",
        "-",
        "--quiet",
        *[a for k, v in fields.items() for a in (f"--{k}", str(v))],
        *flags,
    ]
    if threads:
        command += ["--mesh", str(mesh), "--devices", str(ranks)]
    else:
        command = [mpiexec(), "-n", str(ranks), *command, "--mesh", str(mesh)]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, env={**os.environ, "OPENBLAS_THREAD_TIMEOUT": "4"}
    )
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def threaded(shape: tuple, ranks: int, mesh: str | None, steps: int) -> dict:
    return spmd_run(shape, ranks, mesh, steps, threads=True)


def torch_run(shape: tuple, ranks: int, mode: str | None, steps: int) -> dict:
    """The same model's step in PyTorch eager (spmd/bench/torch_peer.py), in processes of its own."""
    assert mode is not None
    config = {**shape_fields(shape), "steps": steps - 1, "mode": mode, "ranks": ranks}
    return {"step_seconds": torch_peer("spmd.bench.torch_peer", config)["step_seconds"]}  # its first left out


def torch_peer(module: str, config: dict, timeout: float = 1800) -> dict:
    """python -m `module` CONFIG (a PyTorch peer, on every core) in processes of its own: its JSON line."""
    config = {"threads": available_cores(), **config}
    done = subprocess.run(
        [sys.executable, "-m", module, json.dumps(config)], capture_output=True, text=True, timeout=timeout
    )
    if done.returncode != 0:
        raise RuntimeError(f"the PyTorch peer {module} ({config['mode']}) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def missing_torch(shape: tuple) -> list[dict]:
    return [{"shape": shape, "run": name, "ranks": ranks} for name, ranks, _ in TORCH_RUNS]


def torch_importable() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def measure_shape(shape: tuple, runs: list, steps: int, rounds: int, log) -> dict:
    """Every run of one shape, round after round: {name: {"rounds": [...], "rates": [...]}}."""
    layers, hidden, ffn, heads, seq, batch = shape
    results: dict[str, dict] = {name: {"ranks": ranks, "rounds": []} for name, ranks, *_ in runs}
    rates = []
    for _ in range(rounds):
        rates.append(gemm_rate(batch * seq, hidden, ffn, "float32"))  # every core: what the machine can do
        for name, ranks, how, runner in runs:
            result = runner(shape, ranks, how, steps)
            results[name]["rounds"].append(result)
            log(f"{shape} {name}: median {np.median(result['step_seconds']):.4f} s")
    return {"runs": results, "gemm_rates": rates}


def summarize(shape: tuple, measured: dict) -> list[dict]:
    """The table's rows of one shape: step median and min-max, tokens/s, MFU, the ratio to PyTorch's best."""
    layers, hidden, ffn, heads, seq, batch = shape
    net = Net(model="llama", dtype="float32", **shape_fields(shape))
    flops, tokens = flops_per_token(net) * net.tokens, net.tokens
    rate = float(np.median(measured["gemm_rates"]))
    rows = []
    for name, run in measured["runs"].items():
        seconds = np.concatenate([r["step_seconds"] for r in run["rounds"]])
        median = float(np.median(seconds))
        rows.append(
            {
                "shape": shape,
                "run": name,
                "ranks": run["ranks"],
                "median": median,
                "min": float(seconds.min()),
                "max": float(seconds.max()),
                "tokens_per_s": tokens / median,
                "gemm_gflops": rate / 1e9,
                "mfu": flops / median / rate,
            }
        )
    torch_rows = [r for r in rows if r["run"].startswith("torch")]
    for row in rows:
        if row["run"].startswith("spmd") and torch_rows:
            peers = (
                [r for r in torch_rows if (r["ranks"] == 1) == (row["ranks"] == 1)] if row["ranks"] == 1 else torch_rows
            )
            row["over_torch"] = row["median"] / min(r["median"] for r in peers)
    return rows


CAPTION = (
    "spmd's LM step against PyTorch eager on the same cores; MFU: the model's flops over numpy's GEMM rate at the "
    "layer's shapes, measured in the same run"
)


def table(rows: list[dict]) -> str:
    """The markdown table (its caption free of the machine's name: README's copy is checked on any machine, its
    timed columns not compared). A PyTorch row with no torch to run is a row of dashes."""
    lines = [
        CAPTION,
        "| shape (L, h, f, heads, seq, batch) | run | step s, median (min-max) | tokens/s | GEMM limit GFLOP/s "
        "| MFU | over PyTorch's best |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        where = f"| {', '.join(map(str, r['shape']))} | {r['run']} |"
        if "median" not in r:
            lines.append(where + " - | - | - | - | - |")
            continue
        ratio = f"{r['over_torch']:.2f}" if "over_torch" in r else "-"
        lines.append(
            f"{where} {r['median']:.4f} ({r['min']:.4f}-{r['max']:.4f}) | {r['tokens_per_s']:,.0f} "
            f"| {r['gemm_gflops']:.0f} | {r['mfu']:.2f} | {ratio} |"
        )
    return "\n".join(lines) + "\n"


def machine() -> tuple[str, str]:
    """The processor's name and numpy's BLAS (library, kernel)."""
    processor = "unknown processor"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                processor = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        from threadpoolctl import threadpool_info

        blas = next(
            f"{i['internal_api']} {i['version']} ({i['architecture']} kernels)"
            for i in threadpool_info()
            if i["user_api"] == "blas"
        )
    except (ImportError, StopIteration, KeyError):
        blas = "unknown"
    return processor, blas


def main(argv=None) -> int:
    parser = Parser(prog="python -m spmd.bench lm", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for lm.json and lm.md")
    parser.add_argument("--quick", action="store_true", help="one small shape (the benchmark's plumbing)")
    parser.add_argument("--steps", type=int, default=6, help="steps a run, the first left out (default 6)")
    parser.add_argument("--rounds", type=int, default=2, help="turns each run takes (default 2)")
    parser.add_argument("--no-torch", action="store_true", help="leave the PyTorch peer out even if importable")
    args = parser.parse_args(argv)
    if args.steps < 2 or args.rounds < 1:
        parser.error("--steps must be at least 2 (the first is left out) and --rounds at least 1")
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        fail(parser.prog, f"--out {args.out}: cannot be made a folder: {exc.strerror}")
    runs: list[tuple[str, int, str | None, Callable[[tuple, int, str | None, int], dict]]] = [
        (name, ranks, mesh, threaded if on_threads else spmd_run) for name, ranks, mesh, on_threads in SPMD_RUNS
    ]
    with_torch = not args.no_torch and torch_importable()
    if with_torch:
        runs += [(name, ranks, mode, torch_run) for name, ranks, mode in TORCH_RUNS]
    started = time.perf_counter()

    def log(text: str) -> None:
        print(f"[{time.perf_counter() - started:5.0f} s] {text}", file=sys.stderr, flush=True)

    shapes = QUICK_SHAPES if args.quick else SHAPES
    measured = {shape: measure_shape(shape, runs, args.steps, args.rounds, log) for shape in shapes}
    rows = [row for shape in shapes for row in summarize(shape, measured[shape])]
    if not with_torch and not args.no_torch:  # the table keeps its rows: dashes where torch would be
        log("torch is not importable: its rows are dashes (pip install torch==2.13.0, an optional peer)")
        rows = [r for shape in shapes for r in [*(x for x in rows if x["shape"] == shape), *missing_torch(shape)]]
    processor, blas = machine()
    rates = [r for m in measured.values() for r in m["gemm_rates"]]
    meta = {
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "processor": processor,
        "blas": blas,
        "cores": available_cores(),
        "gemm_gflops": float(np.median(rates)) / 1e9,
        "command": "python -m spmd.bench lm" + (" --quick" if args.quick else ""),
    }
    log(f"{processor}, {meta['cores']} cores, numpy's BLAS {blas}; GEMM limit {meta['gemm_gflops']:.0f} GFLOP/s")
    text = table(rows)
    (out / "lm.json").write_text(
        json.dumps(
            {"meta": meta, "rows": rows, "runs": [{"shape": list(shape), **m} for shape, m in measured.items()]},
            indent=1,
        )
    )
    (out / "lm.md").write_text(text)
    print(text, end="")
    return 0
