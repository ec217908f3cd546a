"""The flags every training command shares (how a job runs and reports, its checkpoints) and the run they start:
the last checks, --schedule's table or the ranks (`python -m spmd train` and its mlp-* presets)."""

from __future__ import annotations

import os

from spmd.harness.cli import (
    LaunchConfig,
    add_backend_flag,
    add_debug_flag,
    add_json_flag,
    resolve_backend,
    start_ranks,
)
from spmd.harness.config_file import add_config_flags, as_toml, resolved
from spmd.harness.fits import check_fits, ranks_on_this_machine
from spmd.harness.train_job import TrainJob, run_train_rank
from spmd.model.config import Net
from spmd.observe.schedule import format_schedule
from spmd.parallel.strategy import Composition
from spmd.trainers import checkpoint
from spmd.trainers.presets import Preset
from spmd.transport.comm import DEFAULT_TIMEOUT
from spmd.transport.mesh import Mesh
from spmd.transport.mpi import world_size
from spmd.usage import UsageError, at_least, debugging, fail, writable


def add_run_flags(p) -> None:
    """The flags of how a training job runs and reports, shared by every training command."""
    p.add_argument(
        "--no-overlap",
        dest="overlap",
        action="store_false",
        help="blocking collectives: no FSDP prefetch, gradients reduced after the backward (to compare)",
    )
    p.add_argument("--devices", type=int, help="ranks; threads default to the mesh's size or 4")
    add_backend_flag(p)
    p.add_argument(
        "--check",
        action="store_true",
        help="every rank compares its losses and parameters with the single-device step, and bytes and "
        "memory with the model; exit status 1 on a mismatch",
    )
    add_json_flag(p)
    p.add_argument("--trace", dest="trace_path", metavar="TRACE.json", help="rank 0 writes a Chrome trace")
    p.add_argument(
        "--out-dir", metavar="DIR", help="write the run's files there: report.json and trace.json (created if missing)"
    )
    p.add_argument(
        "--log-every",
        type=int,
        default=10,
        metavar="N",
        help="a progress line every N steps and after the last, with the time so far and an estimate of "
        "what is left (default 10)",
    )
    add_checkpoint_flags(p)
    p.add_argument("--quiet", action="store_true", help="no progress lines, only the report")
    p.add_argument("--schedule", action="store_true", help="print the strategy's step table, and exit")
    p.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        metavar="SECONDS",
        help="a rank waiting longer than this for a message fails the run",
    )
    p.add_argument("--blas-threads", type=int, metavar="N", help="BLAS threads per rank")
    p.add_argument(
        "--memory-limit",
        type=float,
        metavar="GB",
        help="refuse, before any rank starts, a run whose ranks here need more GiB than this (default: "
        "the memory this machine has available)",
    )
    add_debug_flag(p)
    add_config_flags(p)


def add_checkpoint_flags(p) -> None:
    """--save, --save-every, --keep and --load."""
    p.add_argument(
        "--save",
        metavar="DIR",
        help="write a checkpoint into DIR (step-N folders) after the last step "
        "and every --save-every steps: each rank what it owns",
    )
    p.add_argument("--save-every", type=int, default=0, metavar="N", help="with --save: a checkpoint every N steps")
    p.add_argument(
        "--keep",
        type=int,
        default=0,
        metavar="N",
        help="with --save: keep the N newest checkpoints, removing older ones (default 0: keep all)",
    )
    p.add_argument(
        "--load",
        metavar="DIR",
        help="start from the newest checkpoint in DIR, on any mesh, strategy or "
        "number of ranks; --steps counts from step 0",
    )


def output_paths(args) -> tuple[str | None, str | None]:
    """(JSON report path or "-" or None, trace path or None), with --out-dir's defaults, each checked writable."""
    json_path, trace_path = args.json, args.trace_path
    if args.out_dir is not None:
        os.makedirs(args.out_dir, exist_ok=True)
        json_path = json_path or os.path.join(args.out_dir, "report.json")
        trace_path = trace_path or os.path.join(args.out_dir, "trace.json")
    return writable("--json", json_path), writable("--trace", trace_path)


def launch_size(args, mesh: Mesh | None) -> tuple[str, int]:
    """(backend, ranks) of a training command: --devices, else the MPI world, else the mesh's size, else 4."""
    backend = resolve_backend(args.backend, args.devices)
    at_least("--log-every", args.log_every, 1)
    return backend, args.devices or (world_size() if backend == "mpi" else None) or (mesh.size if mesh else 4)


def run_job(
    parser,
    args,
    trainer: Composition,
    net: Net,
    mesh,
    backend: str,
    data: dict | None = None,
    preset: Preset | None = None,
) -> int:
    """The checks that remain, then --schedule's table or the ranks' run (the same for every training command).
    `data`: the corpus the run reads (--data), described as a checkpoint records it; `preset`: the mlp-* command
    run, whose flags the errors name."""
    config = resolved(parser, args)  # the flags as --print-config writes them and a checkpoint records them
    if args.print_config:
        print(as_toml(config), end="")
        return 0
    try:
        json_path, trace_path = output_paths(args)
        launch = LaunchConfig(
            backend, args.devices, args.timeout or None, None, args.blas_threads, args.debug or debugging()
        )
        if backend == "threads":
            launch.thread_ranks(mesh)
        check_checkpoint_flags(args, net, data)
        if args.memory_limit is not None and not args.memory_limit > 0:
            raise UsageError(f"--memory-limit must be a number of GiB > 0, got {args.memory_limit}")
        if not args.schedule:  # every rank started here shares this machine (one process on threads)
            check_fits(trainer.cost(net, mesh).memory, args.memory_limit, ranks_on_this_machine(mesh.size))
    except (ValueError, TypeError, UsageError, OSError) as exc:
        fail(parser.prog, preset.words(str(exc)) if preset else str(exc))
    if args.schedule:
        print(format_schedule(trainer.schedule(net, mesh)))
        return 0
    job = TrainJob(
        trainer,
        net,
        mesh,
        check=args.check,
        json_path=json_path,
        trace_path=trace_path,
        save=args.save,
        save_every=args.save_every,
        keep=args.keep,
        config=config,
        load=args.load,
        log_every=0 if args.quiet else args.log_every,
        data=data["path"] if data else None,
        eval_every=args.eval_every,
        eval_tokens=args.eval_tokens,
        name=preset.name if preset else "train",
    )
    return start_ranks(
        launch, mesh, lambda world, backend, per_process: run_train_rank(world, job, backend, per_process)
    )


def check_checkpoint_flags(args, net: Net, data: dict | None = None) -> None:
    """--save, --save-every and --load, before any rank starts: one line naming the flag."""
    if args.save_every and args.save is None:
        raise UsageError("--save-every needs --save DIR (where the checkpoints go)")
    if args.save_every < 0:
        raise UsageError(f"--save-every must be >= 1, got {args.save_every}")
    if args.keep < 0 or (args.keep and args.save is None):
        raise UsageError(f"--keep {args.keep}: give N >= 1 newest checkpoints to keep, with --save DIR")
    if args.save is not None:  # checked, not created: a run stopped before its first save leaves nothing
        if os.path.exists(args.save) and not os.path.isdir(args.save):
            raise UsageError(f"--save {args.save}: is a file, not a folder")
        existing = os.path.abspath(args.save)
        while not os.path.exists(existing):
            existing = os.path.dirname(existing)
        if not os.path.isdir(existing) or not os.access(existing, os.W_OK):
            raise UsageError(f"--save {args.save}: cannot be created ({existing} is not a writable folder)")
    if args.load is not None:
        checkpoint.read_manifest(
            checkpoint.latest(args.load), net, {k: v for k, v in data.items() if k != "path"} if data else None
        )
