"""The command line shared by `python -m spmd.dp` and `python -m spmd.fsdp`.

Under an MPI launcher (`mpirun -n 4 python -m spmd.fsdp`) each process is one
rank; without one, the ranks are threads of this process (`--devices`).
"""

import argparse
import sys

from spmd.comm import RankFailure, failure_message
from spmd.job import JobConfig, Strategy, run_rank
from spmd.mpi import launched_by_mpirun
from spmd.threads import run_threads

DTYPES = ("float64", "float32", "complex128", "complex64", "int64", "int32")


def build_parser(strategy: Strategy) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"python -m spmd.{strategy.name}",
        description=f"C = A @ B with the {strategy.name} strategy, on MPI ranks or threads.",
    )
    size = p.add_argument_group("generated inputs (each rank makes only its own blocks)")
    size.add_argument("--m", type=int, help="rows of A and C (default 1024)")
    size.add_argument("--k", type=int, help="columns of A, rows of B (default 1024)")
    size.add_argument("--n", type=int, help="columns of B and C (default 1024)")
    size.add_argument("--dtype", choices=DTYPES, default="float64")
    size.add_argument("--seed", type=int, default=0)
    files = p.add_argument_group("file inputs (each rank memory-maps only its blocks)")
    files.add_argument("--a", dest="a_path", metavar="A.npy", help="matrix A as a .npy file")
    files.add_argument("--b", dest="b_path", metavar="B.npy", help="matrix B as a .npy file")
    p.add_argument("--out", dest="out_path", metavar="C.npy", help="rank 0 saves C here")
    p.add_argument(
        "--devices", type=int, help="ranks; threads default to 4, under mpirun it must equal -n"
    )
    p.add_argument("--backend", choices=("auto", "threads", "mpi"), default="auto",
                   help="auto: mpi when started by mpirun/mpiexec/srun, else threads")
    p.add_argument("--check", action="store_true",
                   help="rank 0 compares C with a @ b; exit status 1 on mismatch")
    p.add_argument("--json", action="store_true", help="print the report as one JSON line")
    return p


def parse(strategy: Strategy, argv=None) -> tuple[JobConfig, str, int | None]:
    """(job configuration, backend, devices) from the command line; exits 2 on bad usage."""
    parser = build_parser(strategy)
    args = parser.parse_args(argv)
    sizes = {name: getattr(args, name) for name in ("m", "k", "n") if getattr(args, name) is not None}
    if args.a_path is not None and sizes:
        parser.error("--m/--k/--n size generated inputs; with --a/--b the files give the shapes")
    if args.devices is not None and args.devices < 1:
        parser.error(f"--devices must be >= 1, got {args.devices}")
    try:
        config = JobConfig(
            strategy, dtype=args.dtype, seed=args.seed, a_path=args.a_path, b_path=args.b_path,
            out_path=args.out_path, check=args.check, json=args.json, **sizes,
        )
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
    backend = args.backend
    if backend == "auto":
        backend = "mpi" if launched_by_mpirun() else "threads"
    return config, backend, args.devices


def main(strategy: Strategy, argv=None) -> int:
    """Run one job; exit status 0 on success, 1 if a rank failed or the check did not pass."""
    config, backend, devices = parse(strategy, argv)
    if backend == "mpi":
        from spmd.mpi import run_mpi

        report = run_mpi(lambda comm, rank: _mpi_rank(comm, rank, config, devices))
    else:
        try:
            report = run_threads(devices or 4, lambda comm, rank: run_rank(comm, rank, config, backend))[0]
        except RankFailure as failure:
            sys.stderr.write(failure_message(failure.rank, devices or 4, failure.__cause__))
            return 1
    return 1 if report is not None and report.get("ok") is False else 0


def _mpi_rank(comm, rank: int, config: JobConfig, devices: int | None):
    if devices is not None and devices != comm.num_devices:
        raise ValueError(f"--devices {devices} disagrees with the {comm.num_devices} MPI ranks started")
    return run_rank(comm, rank, config, "mpi")
