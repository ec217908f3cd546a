"""The matmul end to end, as a user runs it once: fresh processes, a fresh result array, against numpy.

    python -m spmd.bench.fresh --out bench-results          # n = 4096 float64, 2 ranks, 5 pairs
    python -m spmd.bench.fresh --out bench-results --n 1024 --reps 2

Each repetition is a pair, numpy first: `python -m spmd.bench.fresh --numpy N DTYPE` in a new process
makes A and B as the CLI does and times its first `a @ b` (into memory C never touched before); then
`mpiexec -n R python -m spmd STRATEGY --json` in new processes reports its own seconds, from a barrier
after every rank holds its inputs to C whole at rank 0 (C and every buffer fresh too). Neither counts
process start or making the inputs; both pay the first touch of C's pages, which is what the
in-process benchmark (spmd.bench, warm buffers) cannot show. The ratio is per pair, then the median.
"""

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from spmd.bench.run import mpiexec
from spmd.matmul.inputs import GeneratedInputs
from spmd.usage import Parser, fail

STRATEGIES = ("dp", "fsdp")


def numpy_first_multiply(n: int, dtype: str) -> float:
    """Seconds of the first `a @ b` in this process, on the CLI's inputs (all cores, numpy's default)."""
    inputs = GeneratedInputs(n, n, n, np.dtype(dtype), seed=0)
    a, b = inputs.block(0, (0, n), (0, n)), inputs.block(1, (0, n), (0, n))
    start = time.perf_counter()
    a @ b
    return time.perf_counter() - start


def fresh_numpy(n: int, dtype: str) -> float:
    done = subprocess.run(
        [sys.executable, "-m", "spmd.bench.fresh", "--numpy", str(n), dtype],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    return float(done.stdout.split()[-1])


def fresh_ours(strategy: str, n: int, dtype: str, ranks: int) -> float:
    command = [
        mpiexec(),
        "-n",
        str(ranks),
        sys.executable,
        "-m",
        "spmd",
        strategy,
        "--m",
        str(n),
        "--k",
        str(n),
        "--n",
        str(n),
        "--dtype",
        dtype,
        "--json",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr}")
    return float(json.loads(done.stdout.strip().splitlines()[-1])["seconds"])


def pairs(n: int, dtype: str, ranks: int, reps: int) -> dict[str, dict[str, list[float]]]:
    """{strategy: {"numpy": [...], "ours": [...]}}, each repetition numpy then ours, strategies interleaved."""
    times: dict[str, dict[str, list[float]]] = {s: {"numpy": [], "ours": []} for s in STRATEGIES}
    for rep in range(reps):
        for strategy in STRATEGIES:
            times[strategy]["numpy"].append(fresh_numpy(n, dtype))
            times[strategy]["ours"].append(fresh_ours(strategy, n, dtype, ranks))
            print(
                f"[{rep + 1}/{reps}] {strategy}: numpy {times[strategy]['numpy'][-1]:.3f} s, "
                f"ours {times[strategy]['ours'][-1]:.3f} s",
                file=sys.stderr,
                flush=True,
            )
    return times


def spread(values) -> str:
    return f"{np.median(values):.3g} [{np.min(values):.3g}-{np.max(values):.3g}]"


def table(n: int, dtype: str, ranks: int, times: dict) -> str:
    lines = [
        f"End to end, fresh processes, n = {n} {dtype}, {ranks} MPI ranks "
        f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; median [min-max] of {len(times['dp']['ours'])}"
        " pairs):",
        "",
        "| strategy | numpy `a @ b` s | ours s | ours / numpy (per pair) |",
        "|---|---|---|---|",
    ]
    for strategy, pair in times.items():
        ratios = np.array(pair["ours"]) / np.array(pair["numpy"])
        lines.append(f"| {strategy} | {spread(pair['numpy'])} | {spread(pair['ours'])} | {spread(ratios)} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--numpy"]:  # the child: one fresh numpy multiply
        print(numpy_first_multiply(int(argv[1]), argv[2]))
        return 0
    parser = Parser(prog="python -m spmd.bench.fresh", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for fresh.md and fresh.json")
    parser.add_argument("--n", type=int, default=4096, help="matrix size (default 4096)")
    parser.add_argument("--dtype", default="float64", choices=["float64", "float32"])
    parser.add_argument("--ranks", type=int, default=2, help="MPI ranks (default 2)")
    parser.add_argument("--reps", type=int, default=5, help="pairs of runs (default 5)")
    args = parser.parse_args(argv)
    for flag in ("n", "ranks", "reps"):
        if getattr(args, flag) < 1:
            fail(parser.prog, f"--{flag} must be at least 1, got {getattr(args, flag)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    times = pairs(args.n, args.dtype, args.ranks, args.reps)
    (out / "fresh.json").write_text(
        json.dumps({"n": args.n, "dtype": args.dtype, "ranks": args.ranks, "times": times}, indent=1)
    )
    (out / "fresh.md").write_text(table(args.n, args.dtype, args.ranks, times))
    print((out / "fresh.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
