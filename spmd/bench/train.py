"""python -m spmd.bench.train --out DIR [--quick]: training steps at the speed of the hardware, measured.

Every row runs `python -m spmd train` (the MLP of 8 layers, h 512, f 2048, 1024 tokens a step, one token a
sequence, as the mlp-* presets run it) in a process of its own, on MPI or threads, and takes its step
times (the first step, which touches fresh memory, is left out); right before it, in this process, numpy
multiplies the step's own matmul shapes on all cores, and again right after it: the mean of the two is the
GEMM rate the row is compared with (one of them alone moved by up to 25% between rows on this machine). MFU = the
step's matmul flops (6 tokens h f a layer) / the median step time / that rate, per repetition pair; medians
with min-max. With JAX installed (an optional extra, never needed by the tests), the same model's step in
JAX (jit; on 2 or 4 simulated CPU devices with NamedSharding for data parallel) is a peer row.
Writes train.json and train.md (the table) into --out.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from spmd.bench.run import mpiexec
from spmd.harness.breakdown import timed
from spmd.harness.mfu import gemm_rate as mfu_gemm_rate
from spmd.usage import Parser, fail

MODEL = {"layers": 8, "hidden": 512, "ffn": 2048, "tokens": 1024}
QUICK_MODEL = {"layers": 8, "hidden": 64, "ffn": 256, "tokens": 256}  # 8 layers: interleaved on pp=4


def layouts(ranks: int) -> list[tuple[str, list[str]]]:
    """(name, train flags) of every strategy at `ranks` ranks."""
    if ranks == 1:
        return [("one rank", ["--mesh", "dp=1"])]
    rows = [
        ("dp", ["--mesh", f"dp={ranks}"]),
        ("zero1", ["--mesh", f"fsdp={ranks}", "--zero", "1"]),
        ("zero2", ["--mesh", f"fsdp={ranks}", "--zero", "2"]),
        ("fsdp", ["--mesh", f"fsdp={ranks}"]),
        ("tp", ["--mesh", f"tp={ranks}"]),
        ("tp+sp", ["--mesh", f"tp={ranks}", "--sp"]),
        ("pp 1f1b", ["--mesh", f"pp={ranks}", "--microbatches", str(4 * ranks)]),
        (
            "pp interleaved",
            ["--mesh", f"pp={ranks}", "--pipeline", "interleaved-1f1b", "--microbatches", str(4 * ranks)],
        ),
        ("pp zb-h1", ["--mesh", f"pp={ranks}", "--pipeline", "zb-h1", "--microbatches", str(4 * ranks)]),
        ("pp zbv", ["--mesh", f"pp={ranks}", "--pipeline", "zbv", "--microbatches", str(4 * ranks)]),
        ("pp dualpipev", ["--mesh", f"pp={ranks}", "--pipeline", "dualpipev", "--microbatches", str(4 * ranks)]),
    ]
    if ranks >= 4:
        rows.append(("fsdp x tp", ["--mesh", f"fsdp={ranks // 2},tp=2", "--sp"]))
    return rows


def step_flops(model: dict) -> int:
    return 6 * model["tokens"] * 2 * model["hidden"] * model["ffn"] * model["layers"]


def gemm_rate(model: dict, dtype: str, reps: int = 5) -> float:
    """FLOP/s of numpy's matmuls at one layer's forward and backward shapes, all cores (spmd.harness.mfu's)."""
    return mfu_gemm_rate(model["tokens"], model["hidden"], model["ffn"], dtype, reps)


def run_row(model: dict, flags: list[str], ranks: int, backend: str, dtype: str, overlap: bool, steps: int) -> dict:
    command = [
        sys.executable,
        "-m",
        "spmd",
        "train",
        "--model",
        "mlp",
        "--layers",
        str(model["layers"]),
        "--hidden",
        str(model["hidden"]),
        "--ffn",
        str(model["ffn"]),
        "--seq",
        "1",
        "--batch",
        str(model["tokens"]),
        "--dtype",
        dtype,
        "--steps",
        str(steps),
        "--json",
        "--quiet",
        *flags,
    ]
    if not overlap:
        command.append("--no-overlap")
    if backend == "mpi":
        command = [mpiexec(), "-n", str(ranks), *command]
    else:
        command += ["--devices", str(ranks), "--backend", "threads"]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=900, env={**os.environ, "OPENBLAS_THREAD_TIMEOUT": "4"}
    )
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def jax_row(model: dict, devices: int, dtype: str, steps: int) -> dict | None:
    """The same MLP step in JAX, in a process of its own (spmd/bench/jax_peer.py); None without JAX."""
    try:
        import jax  # noqa: F401
    except ImportError:
        return None
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "spmd.bench.jax_peer",
            json.dumps({**model, "devices": devices, "dtype": dtype, "steps": steps}),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the JAX peer failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summary(runs: list[tuple[list[float], float]], flops: int) -> dict:
    """Step time and MFU over the runs' timed steps; runs: (step seconds, the GEMM rate around that run)."""
    seconds = np.concatenate([np.asarray(s) for s, _ in runs])
    mfu = np.concatenate([flops / np.asarray(s) / rate for s, rate in runs])
    return {
        "step_median": float(np.median(seconds)),
        "step_min": float(seconds.min()),
        "step_max": float(seconds.max()),
        "mfu_median": float(np.median(mfu)),
        "mfu_min": float(mfu.min()),
        "mfu_max": float(mfu.max()),
    }


def rounds_of_runs(model: dict, chosen: list, ranks: int, backend: str, dtype: str, steps: int, rounds: int) -> dict:
    """Every chosen layout with overlap on, then off, round after round, so that the runs compared are minutes
    apart at most: {(layout, overlap): [(step seconds, the GEMM rate around the run, mesh)], one a round}."""
    runs: dict[tuple[str, bool], list] = {}
    for _ in range(rounds):
        for name, flags in chosen:
            for overlap in (True, False):
                before = gemm_rate(model, dtype)
                report = run_row(model, flags, ranks, backend, dtype, overlap, steps)
                rate = (before + gemm_rate(model, dtype)) / 2  # the rate around the run: less noise
                runs.setdefault((name, overlap), []).append((timed(report["step_seconds"]), rate, report["mesh"]))
                print(
                    f"{name} {report['mesh']} {backend} {dtype} overlap {overlap}: "
                    f"{np.median(np.asarray(report['step_seconds'])):.3f} s",
                    file=sys.stderr,
                    flush=True,
                )
    return runs


def per_round(runs: dict, name: str) -> dict:
    """Round by round, the median step of `name` with overlap on over its median without, and over DP's (both
    on): below 1, faster. Runs of one round are a moment apart, so the machine's drift mostly cancels."""

    def step(key, i):
        return float(np.median(np.asarray(runs[key][i][0])))

    count = len(runs[(name, True)])
    ratios = {"on_over_off": [step((name, True), i) / step((name, False), i) for i in range(count)]}
    if ("dp", True) in runs and name != "dp":
        ratios["over_dp"] = [step((name, True), i) / step(("dp", True), i) for i in range(count)]
    return ratios


def build_parser() -> Parser:
    parser = Parser(prog="python -m spmd.bench.train", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for train.json and train.md (created if missing)")
    parser.add_argument("--quick", action="store_true", help="a small model, 2 ranks, MPI, float32 only")
    parser.add_argument("--steps", type=int, default=5, help="steps a run (the first is left out)")
    parser.add_argument("--ranks", type=int, action="append", help="rank counts (default 1 2 4)")
    parser.add_argument("--backend", action="append", choices=("mpi", "threads"), help="default: both")
    parser.add_argument("--dtype", action="append", choices=("float32", "float64"), help="default: both")
    parser.add_argument("--only", action="append", metavar="LAYOUT", help="only these layouts (dp, fsdp, tp, ...)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="every layout with overlap on then off, this many times over (default 1): the table "
        "gives each round's on/off and against-DP step-time ratios, median [min-max]",
    )
    return parser


def jax_rows(model, r: int, dtype: str, steps: int, flops: int) -> list[dict]:
    """The same step in JAX (jit, NamedSharding dp) on r devices, as the table's row; [] without JAX."""
    peer = jax_row(model, r, dtype, steps)
    if peer is None:
        return []
    rate = gemm_rate(model, dtype)
    row = {
        "layout": "JAX (jit, NamedSharding dp)",
        "mesh": f"dp={r}",
        "ranks": r,
        "backend": "jax",
        "dtype": dtype,
        "overlap": True,
        "gemm_rate": rate,
        **summary([(peer["step_seconds"], rate)], flops),
    }
    print(json.dumps(row), flush=True)
    return [row]


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.steps < 2:
        fail(parser.prog, f"--steps must be >= 2 (the first is left out), got {args.steps}")
    if args.rounds < 1:
        fail(parser.prog, f"--rounds must be >= 1, got {args.rounds}")
    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as exc:
        fail(parser.prog, f"--out {args.out}: cannot be created ({exc.strerror})")
    model = QUICK_MODEL if args.quick else MODEL
    ranks = args.ranks or ([2] if args.quick else [1, 2, 4])
    backends = args.backend or (["mpi"] if args.quick else ["mpi", "threads"])
    dtypes = args.dtype or (["float32"] if args.quick else ["float32", "float64"])
    flops, rows = step_flops(model), []
    for dtype in dtypes:
        for r in ranks:
            for backend in backends:
                chosen = [(name, flags) for name, flags in layouts(r) if not args.only or name in args.only]
                runs = rounds_of_runs(model, chosen, r, backend, dtype, args.steps, args.rounds)
                for name, _ in chosen:
                    for overlap in (True, False):
                        mine = runs[(name, overlap)]
                        rows.append(
                            {
                                "layout": name,
                                "mesh": mine[0][2],
                                "ranks": r,
                                "backend": backend,
                                "dtype": dtype,
                                "overlap": overlap,
                                "gemm_rate": float(np.mean([rate for _, rate, _ in mine])),
                                **summary([(seconds, rate) for seconds, rate, _ in mine], flops),
                                **(per_round(runs, name) if overlap else {}),
                            }
                        )
                        print(json.dumps(rows[-1]), flush=True)
            if r > 1 or len(ranks) == 1:
                rows += jax_rows(model, r, dtype, args.steps, flops)
    (Path(args.out) / "train.json").write_text(
        json.dumps({"model": model, "step_flops": flops, "rows": rows}, indent=1)
    )
    (Path(args.out) / "train.md").write_text(table(model, flops, rows))
    print(table(model, flops, rows))
    return 0


def spread(ratios: list[float] | None) -> str:
    """median [min-max] (count) of per-round ratios, or - where there are none."""
    if not ratios:
        return "-"
    return f"{np.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}] ({len(ratios)})"


def table(model: dict, flops: int, rows: list[dict]) -> str:
    lines = [
        f"MLP {model['layers']} layers, h {model['hidden']}, f {model['ffn']}, {model['tokens']} tokens a step: "
        f"{flops / 1e9:.1f} GFLOP; MFU = flops / step / (numpy's GEMM rate at the step's shapes, same run)",
        "",
        "| layout | mesh | backend | dtype | overlap | step s, median [min-max] | tokens/s | MFU [min-max] "
        "| on / off, by round | / DP, by round |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        overlap = "on" if r["overlap"] else "off"
        lines.append(
            f"| {r['layout']} | {r['mesh']} | {r['backend']} | {r['dtype']} | {overlap} "
            f"| {r['step_median']:.3f} [{r['step_min']:.3f}-{r['step_max']:.3f}] "
            f"| {model['tokens'] / r['step_median']:,.0f} | {r['mfu_median']:.2f} [{r['mfu_min']:.2f}-"
            f"{r['mfu_max']:.2f}] | {spread(r.get('on_over_off'))} | {spread(r.get('over_dp'))} |"
        )
    above = [r["layout"] + f" ({r['mesh']}, {r['backend']}, {r['dtype']})" for r in rows if r["mfu_max"] > 1]
    if above:  # no step beats the machine's GEMM rate: a ratio past 1 is that rate, measured low, not the step
        lines += [
            "",
            f"MFU above 1 in {len(above)} of {len(rows)} rows ({'; '.join(above)}): the GEMM rate measured "
            "around those runs was lower than the cores deliver (other work shared them), so read those MFU "
            "figures as noise, not as a step faster than the hardware.",
        ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
