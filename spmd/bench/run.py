"""The benchmark: numpy's `a @ b` against DP and FSDP on threads and on MPI, in one run.

    python -m spmd.bench --out results/          # full: n = 1024, 2048, 4096 (about 7 minutes on 2 cores)
    python -m spmd.bench --out results/ --quick  # small sizes, for CI

Writes results.json, benchmarks.md (table) and benchmarks.png (chart) to --out.
Every time is a median with its min-max over repetitions; every ratio is the
median of per-repetition ratios against numpy timed in the same job a moment
before (the machine is shared and noisy).

Each measurement runs in a process of its own (`python -m spmd.bench.measure`,
under mpiexec for MPI) with OPENBLAS_THREAD_TIMEOUT=4: after numpy's
multi-threaded multiply, OpenBLAS's idle worker threads otherwise slow the
run timed next in the same process by 20-100% at n=2048 (measured here).
"""

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

from spmd.bench.collectives import COLLECTIVES
from spmd.bench.measure import Measure
from spmd.bench.report import collective_lines, write_chart, write_table
from spmd.transport.cores import available_cores, blas_threads
from spmd.usage import Parser, fail

FULL: dict[str, Any] = {
    "sizes": [(1024, "float64"), (2048, "float64"), (4096, "float64"), (4096, "float32")],
    "ranks": [1, 2, 4],
    "reps": 5,
}
QUICK: dict[str, Any] = {"sizes": [(256, "float64"), (512, "float32")], "ranks": [1, 2], "reps": 2}
COLLECTIVE_BYTES = 64 * 2**20  # each collective check moves a 64 MB matrix's worth


def mpiexec() -> str:
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else "mpiexec"


def measure(m: Measure) -> dict:
    """Run one measurement in its own process(es); its results dict."""
    command = [sys.executable, "-m", "spmd.bench.measure", json.dumps(asdict(m))]
    if m.backend == "mpi":
        command = [mpiexec(), "-n", str(m.ranks), *command]
    env = {**os.environ, "OPENBLAS_THREAD_TIMEOUT": os.environ.get("OPENBLAS_THREAD_TIMEOUT", "4")}
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def one_core_seconds(n: int, dtype: str, reps: int) -> list[float]:
    """numpy's `a @ b` on one BLAS thread: the base of parallel efficiency."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((n, n)).astype(dtype), rng.standard_normal((n, n)).astype(dtype)
    times = []
    with blas_threads(1):
        a @ b
        for _ in range(reps):
            start = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - start)
    return times


def shard_split_ratios(n: int, reps: int) -> list[float]:
    """One BLAS thread: (two n/2 x n @ n x n/2 multiplies into C's column halves) / (one n/2 x n @ n x n).

    What FSDP at 2 ranks computes per rank against what DP does, with no communication at all:
    each shard's multiply packs all of A again.
    """
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((n // 2, n)), rng.standard_normal((n, n))
    shards = [np.ascontiguousarray(b[:, : n // 2]), np.ascontiguousarray(b[:, n // 2 :])]
    c, ratios = np.empty((n // 2, n)), []
    with blas_threads(1):
        np.matmul(a, b, out=c)
        for _ in range(reps):
            start = time.perf_counter()
            np.matmul(a, b, out=c)
            whole = time.perf_counter() - start
            start = time.perf_counter()
            np.matmul(a, shards[0], out=c[:, : n // 2])
            np.matmul(a, shards[1], out=c[:, n // 2 :])
            ratios.append((time.perf_counter() - start) / whole)
    return ratios


def statement_case_seconds(calls: int) -> dict:
    """One call each of the problem statement's 2-device case (8x6 @ 6x4), `calls` times, on threads."""
    from spmd import dp_mat_mul, fsdp_mat_mul

    rng = np.random.default_rng(42)
    a, b = rng.standard_normal((8, 6)), rng.standard_normal((6, 4))
    times: dict[str, list[float]] = {}
    for mat_mul in (dp_mat_mul, fsdp_mat_mul):
        mat_mul(a, b, 2)
        times[mat_mul.__name__] = []
        for _ in range(calls):
            start = time.perf_counter()
            mat_mul(a, b, 2)
            times[mat_mul.__name__].append(time.perf_counter() - start)
    return times


def plan(config: dict) -> list[Measure]:
    """Every row's measurement, in the order they run."""
    rows = []
    for n, dtype in config["sizes"]:
        for backend in ("threads", "mpi"):
            for ranks in config["ranks"]:
                for strategy in ("dp", "fsdp"):
                    m = Measure(strategy, n, dtype, config["reps"], backend=backend, ranks=ranks)
                    rows.append(m)
                    if strategy == "fsdp" and backend == "mpi" and ranks > 1:
                        rows.append(replace(m, overlap=False))
    return rows


def collective_rows(config: dict, quick: bool) -> list[dict]:
    """Each collective of ours against MPI's own, at 2 and 4 ranks (MPI backend)."""
    n = int(np.sqrt(COLLECTIVE_BYTES // 8)) if not quick else 512
    rows = []
    for name in COLLECTIVES:
        for ranks in (2,) if quick else (2, 4):
            result = measure(Measure(name, n, "float64", config["reps"], ranks=ranks))
            rows.append(result)
            print(
                f"{name} {ranks} ranks: median {np.median(result['seconds']):.4f} s vs "
                f"MPI {np.median(result['mpi_seconds']):.4f} s",
                file=sys.stderr,
                flush=True,
            )
    return rows


def main(argv=None) -> int:
    parser = Parser(prog="python -m spmd.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for results.json, benchmarks.md, benchmarks.png")
    parser.add_argument("--quick", action="store_true", help="small sizes and few repetitions (CI)")
    parser.add_argument(
        "--collectives", action="store_true", help="only our collectives against MPI's own, written to collectives.md"
    )
    args = parser.parse_args(argv)
    config = QUICK if args.quick else FULL
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)  # before minutes of measuring, not after
    except OSError as exc:
        fail(parser.prog, f"--out {args.out}: cannot be made a folder: {exc.strerror}")
    if args.collectives:
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        lines = collective_lines(collective_rows(config, args.quick))
        (out / "collectives.md").write_text(
            f"{when}, {os.uname().machine}, {available_cores()} cores.\n\n" + "\n".join(lines) + "\n"
        )
        print(f"wrote {out / 'collectives.md'}", file=sys.stderr)
        return 0
    rows, started = [], time.perf_counter()
    one_core = {(n, d): one_core_seconds(n, d, config["reps"]) for n, d in config["sizes"]}
    todo = plan(config)
    for i, m in enumerate(todo, 1):
        result = measure(m)
        result.update(one_core_seconds=one_core[(m.n, m.dtype)])
        rows.append(result)
        ratio = np.median(np.array(result["seconds"]) / np.array(result["numpy_seconds"]))
        print(
            f"[{i}/{len(todo)} {time.perf_counter() - started:5.0f} s] {m.backend} {m.ranks} ranks "
            f"{m.strategy}{'' if m.overlap else ' (no overlap)'} n={m.n} {m.dtype}: "
            f"median {np.median(result['seconds']):.4f} s, {ratio:.2f}x numpy",
            file=sys.stderr,
            flush=True,
        )
    ring = collective_rows(config, args.quick)
    small = statement_case_seconds(200 if not args.quick else 20)
    split_n = max(n for n, _ in config["sizes"])
    split = {"n": split_n, "ratios": shard_split_ratios(split_n, config["reps"])}
    meta = {
        "cores": available_cores(),
        "command": "python -m spmd.bench" + (" --quick" if args.quick else ""),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": os.uname().machine,
    }
    results = {"meta": meta, "rows": rows, "ring": ring, "small": small, "split": split}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    write_table(out / "benchmarks.md", meta, rows, ring, small, split)
    write_chart(out / "benchmarks.png", rows)
    print(f"wrote {out / 'benchmarks.md'}, {out / 'benchmarks.png'}, {out / 'results.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
