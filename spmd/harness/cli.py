"""The command line: `python -m spmd <strategy> [--mesh fsdp=2,tp=2] [flags]`.

`python -m spmd.dp` and `python -m spmd.fsdp` are the same with the strategy
fixed. Under an MPI launcher (`mpirun -n 4 python -m spmd fsdp`) each process
is one rank; without one, the ranks are threads of this process (`--devices`).
"""

import argparse
import sys
from dataclasses import dataclass

from spmd.harness.job import JobConfig, run_rank
from spmd.matmul import STRATEGIES
from spmd.observe.schedule import format_schedule
from spmd.trainers.presets import PRESETS
from spmd.transport.comm import DEFAULT_TIMEOUT, RankFailure, failure_message
from spmd.transport.group import Group
from spmd.transport.mesh import Mesh
from spmd.transport.mpi import launched_by_mpirun, world_size
from spmd.transport.threads import Chaos, run_threads
from spmd.usage import Parser, UsageError, at_least, debugging, fail, readable, writable

DTYPES = ("float64", "float32", "complex128", "complex64", "int64", "int32")


def build_parser(fixed: str | None = None) -> argparse.ArgumentParser:
    """The parser of `python -m spmd` (strategy as first argument), or of `python -m spmd.<fixed>`."""
    p = Parser(
        prog=f"python -m spmd.{fixed}" if fixed else "python -m spmd",
        description=f"C = A @ B with the {fixed} strategy"
        if fixed
        else "C = A @ B with a parallel strategy" + ", on MPI ranks or threads.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=None if fixed else commands_epilog(),
    )
    if fixed is None:
        p.add_argument("strategy", choices=sorted(STRATEGIES), help="which strategy (listed below)")
    p.add_argument(
        "--mesh",
        metavar="AXIS=N,...",
        help="named mesh axes over the ranks, last fastest (default: the strategy's one axis over all)",
    )
    add_input_flags(p)
    p.add_argument("--out", dest="out_path", metavar="C.npy", help="rank 0 saves C here")
    p.add_argument("--devices", type=int, help="ranks; threads default to 4, under mpirun it must equal -n")
    add_backend_flag(p)
    p.add_argument("--check", action="store_true", help="rank 0 compares C with a @ b; exit status 1 on mismatch")
    add_json_flag(p)
    p.add_argument(
        "--trace",
        dest="trace_path",
        metavar="TRACE.json",
        help="rank 0 writes a Chrome trace of every rank's compute, sends, transfers and waits "
        "(open it in ui.perfetto.dev); draw it with python -m spmd.observe.plot",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        metavar="SECONDS",
        help=f"a rank waiting longer than this for a message fails the run "
        f"(default {DEFAULT_TIMEOUT:g}; 0: wait forever)",
    )
    p.add_argument(
        "--blas-threads",
        type=int,
        metavar="N",
        help="BLAS threads per rank (default: the host's cores / its ranks, at least 1)",
    )
    add_diagnostic_flags(p)
    add_debug_flag(p)
    return p


def add_diagnostic_flags(p: argparse.ArgumentParser) -> None:
    """--schedule (print the plan, run nothing) and --chaos (shuffled, delayed messages on threads)."""
    p.add_argument(
        "--schedule",
        action="store_true",
        help="print which B block each rank holds, multiplies, sends and receives at each step, and exit",
    )
    p.add_argument(
        "--chaos",
        type=int,
        metavar="SEED",
        help="threads only: deliver messages after random delays, shuffled between senders",
    )


def commands_epilog() -> str:
    """`python -m spmd --help`'s list of the strategies and the mlp-* training commands."""
    return (
        "strategies:\n"
        + "\n".join(f"  {s.name:<10} {s.summary}" for s in STRATEGIES.values())
        + "\n\ntraining an MLP (see python -m spmd mlp-dp --help for its flags):\n"
        + "\n".join(f"  {t.name:<14} {t.summary}" for t in PRESETS.values())
    )


def add_input_flags(p: argparse.ArgumentParser) -> None:
    """A and B: generated (their sizes, dtype, seed) or read from .npy files."""
    size = p.add_argument_group("generated inputs (each rank makes only its own blocks)")
    size.add_argument("--m", type=int, help="rows of A and C (default 1024)")
    size.add_argument("--k", type=int, help="columns of A, rows of B (default 1024)")
    size.add_argument("--n", type=int, help="columns of B and C (default 1024)")
    size.add_argument("--dtype", choices=DTYPES, default="float64")
    size.add_argument("--seed", type=int, default=0, help="the generated matrices'")
    files = p.add_argument_group("file inputs (each rank memory-maps only its blocks)")
    files.add_argument("--a", dest="a_path", metavar="A.npy", help="matrix A as a .npy file")
    files.add_argument("--b", dest="b_path", metavar="B.npy", help="matrix B as a .npy file")


def add_backend_flag(p: argparse.ArgumentParser) -> None:
    """--backend: threads here or MPI ranks (auto: as the job was started)."""
    p.add_argument(
        "--backend",
        choices=("auto", "threads", "mpi"),
        default="auto",
        help="auto: mpi when started by mpirun/mpiexec/srun, else threads",
    )


def add_json_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--json", nargs="?", const="-", metavar="FILE", help="the report as one JSON line: on stdout, or into FILE"
    )


def add_debug_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--debug", action="store_true", help="a failing rank prints its Python traceback (also: SPMD_DEBUG=1)"
    )


def resolve_backend(requested: str, devices: int | None) -> str:
    """threads or mpi; refuses what would silently run the job once per MPI process."""
    started = world_size() if launched_by_mpirun() else None
    if requested == "threads" and started:
        raise UsageError(
            f"--backend threads under an MPI launcher would run the whole job in each of the "
            f"{started} processes; drop --backend (or run without mpirun)"
        )
    backend = requested if requested != "auto" else ("mpi" if started else "threads")
    if backend == "mpi" and started is None and (devices or 1) > 1:
        raise UsageError(
            f"--backend mpi without an MPI launcher runs one rank, not {devices or 'the mesh'}: start "
            "it as mpirun -n N python -m spmd ... (or drop --backend for threads)"
        )
    if backend == "mpi" and devices is not None and started is not None and devices != started:
        raise UsageError(
            f"--devices {devices} disagrees with the {started} MPI processes started (mpirun -n "
            f"{started}); drop --devices or make them equal"
        )
    return backend


MAX_THREAD_RANKS = 128  # more threads than this in one process slow to a crawl (measured: 64 in 3 s, 128 in 16 s)


@dataclass(frozen=True)
class LaunchConfig:
    """How to start the ranks, checked on creation."""

    backend: str  # "threads" or "mpi"
    devices: int | None = None  # threads: how many (None: 4); MPI: must match the world
    timeout: float | None = DEFAULT_TIMEOUT  # seconds one recv may wait
    chaos: Chaos | None = None  # threads only: random delivery delays
    blas: int | None = None  # BLAS threads per rank (None: the cores / ranks on the host)
    debug: bool = False  # a failing rank prints its traceback, not one line

    def __post_init__(self):
        if self.devices is not None and self.devices < 1:
            raise ValueError(f"--devices must be >= 1, got {self.devices}")
        if self.timeout is not None and not self.timeout > 0:
            raise ValueError(f"--timeout must be > 0 seconds, got {self.timeout}")
        if self.blas is not None and self.blas < 1:
            raise ValueError(f"--blas-threads must be >= 1, got {self.blas}")
        if self.chaos is not None and self.backend != "threads":
            raise ValueError("--chaos injects delays into the threads backend only")

    def thread_ranks(self, mesh: Mesh | None) -> int:
        """The threads to start (--devices, else the mesh's size, else 4); ValueError past MAX_THREAD_RANKS."""
        devices = self.devices or (mesh.size if mesh else 4)
        if devices > MAX_THREAD_RANKS:
            raise ValueError(
                f"{devices} ranks on threads: at most {MAX_THREAD_RANKS} (threads of one Python process "
                "take turns: 128 run a small matmul in about 15 s here, 512 would take many minutes); "
                f"start them as processes: mpiexec -n {devices} python -m spmd ..."
            )
        return devices


def parse(argv=None, fixed: str | None = None) -> tuple[JobConfig, LaunchConfig]:
    """The job and launch configurations from the command line; exits 2 on bad usage."""
    parser = build_parser(fixed)
    args = parser.parse_args(argv)
    strategy = STRATEGIES[fixed or args.strategy]
    sizes = {name: getattr(args, name) for name in ("m", "k", "n") if getattr(args, name) is not None}
    if args.a_path is not None and sizes:
        parser.error("--m/--k/--n size generated inputs; with --a/--b the files give the shapes")
    try:
        backend = resolve_backend(args.backend, args.devices)
        at_least("--seed", args.seed, 0)
        for flag, path in (("--out", args.out_path), ("--trace", args.trace_path), ("--json", args.json)):
            writable(flag, path)
        mesh = None if args.mesh is None else Mesh.parse(args.mesh)
        if mesh is not None:  # the strategy's axes, and the rank count where it is known already
            strategy.mesh(args.devices or (world_size() if backend == "mpi" else None) or mesh.size, mesh)
        job = JobConfig(
            strategy,
            mesh,
            dtype=args.dtype,
            seed=args.seed,
            a_path=args.a_path,
            b_path=args.b_path,
            out_path=args.out_path,
            check=args.check,
            json=args.json,
            schedule=args.schedule,
            trace_path=args.trace_path,
            **sizes,
        )
        for flag, path in (("--a", args.a_path), ("--b", args.b_path)):
            if path is not None:
                readable(flag, path)
        job.inputs()  # files: header, shape and dtype checked here, once, before any rank starts
        chaos = None if args.chaos is None else Chaos(seed=args.chaos)
        launch = LaunchConfig(
            backend, args.devices, args.timeout or None, chaos, args.blas_threads, args.debug or debugging()
        )
        if backend == "threads":
            launch.thread_ranks(mesh)
    except (ValueError, TypeError) as exc:
        fail(parser.prog, str(exc))
    return job, launch


def main(argv=None, fixed: str | None = None) -> int:
    """Run one job; exit status 0 on success, 1 if a rank failed or the check did not pass."""
    job, launch = parse(argv, fixed)
    if job.schedule:
        size = launch.devices or world_size() or (job.mesh.size if job.mesh else 4)
        print(format_schedule(job.strategy.schedule(job.strategy.mesh(size, job.mesh))))
        return 0
    return start_ranks(launch, job.mesh, lambda world, backend, per_process: run_rank(world, job, backend, per_process))


def start_ranks(launch: LaunchConfig, mesh: Mesh | None, body) -> int:
    """Run body(world, backend, one_rank_per_process) on every rank; 1 if a rank failed or rank 0's
    report says {"ok": False}, else 0. Threads: --devices ranks (default: the mesh's size, or 4)."""
    if launch.backend == "mpi":
        from spmd.transport.mpi import run_mpi

        def mpi_rank(comm, rank):
            world = Group.world(comm, rank)
            if launch.devices is not None and launch.devices != world.size:
                raise UsageError(f"--devices {launch.devices} disagrees with the {world.size} MPI ranks started")
            return body(world, "mpi", True)

        report = run_mpi(mpi_rank, launch.timeout, launch.blas, traceback=launch.debug)
    else:
        devices = launch.thread_ranks(mesh)
        try:
            report = run_threads(
                devices,
                lambda comm, rank: body(Group.world(comm, rank), "threads", False),
                launch.timeout,
                launch.chaos,
                launch.blas,
            )[0]
        except RankFailure as failure:
            sys.stderr.write(
                failure_message(failure.rank, devices, failure.__cause__ or failure, traceback=launch.debug)
            )
            return 1
    return 1 if report is not None and report.get("ok") is False else 0
