"""The command line of the training strategies: `python -m spmd mlp-<strategy> [--mesh ...] [flags]`."""

from __future__ import annotations

import argparse

from spmd.harness.cli import LaunchConfig, start_ranks
from spmd.harness.train_job import TrainJob, run_train_rank
from spmd.observe.schedule import format_schedule
from spmd.train import TRAINERS
from spmd.transport.comm import DEFAULT_TIMEOUT
from spmd.transport.mesh import Mesh
from spmd.transport.mpi import launched_by_mpirun, world_size
from spmd.workloads.mlp import DTYPES, MLP


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m spmd", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train an MLP (Y = X + relu((X g) W1) W2 per layer, SGD with momentum) with a parallel "
                    "strategy, on MPI ranks or threads.",
        epilog="training strategies:\n" + "\n".join(f"  {t.name:<14} {t.summary}" for t in TRAINERS.values()),
    )
    p.add_argument("strategy", choices=sorted(TRAINERS), help="which strategy (listed below)")
    p.add_argument("--mesh", metavar="AXIS=N,...", help="named mesh axes, last fastest (mlp-fsdp-tp: fsdp=2,tp=2)")
    model = p.add_argument_group("the model and the run")
    defaults = MLP()
    for name, text in (("layers", "L"), ("hidden", "h"), ("ffn", "f, the hidden layer's width"),
                       ("tokens", "rows of X per step (batch x sequence)"),
                       ("microbatches", "pipelines: micro-batches per step"), ("steps", "optimizer steps")):
        model.add_argument(f"--{name}", type=int, default=getattr(defaults, name),
                           help=f"{text} (default {getattr(defaults, name)})")
    model.add_argument("--dtype", choices=DTYPES, default=defaults.dtype)
    model.add_argument("--lr", type=float, help="learning rate (default 0.2 / (tokens x hidden): the loss is a sum)")
    model.add_argument("--momentum", type=float, default=defaults.momentum)
    model.add_argument("--integers", action="store_true",
                       help="small integer inputs and weights (with --steps 1 and a power-of-two --lr: exact)")
    model.add_argument("--seed", type=int, default=0)
    p.add_argument("--devices", type=int, help="ranks; threads default to the mesh's size or 4")
    p.add_argument("--backend", choices=("auto", "threads", "mpi"), default="auto",
                   help="auto: mpi when started by mpirun/mpiexec/srun, else threads")
    p.add_argument("--check", action="store_true",
                   help="every rank compares its losses and parameters with the single-device step, and bytes and "
                        "memory with the model; exit status 1 on a mismatch")
    p.add_argument("--json", action="store_true", help="print the report as one JSON line")
    p.add_argument("--trace", dest="trace_path", metavar="TRACE.json", help="rank 0 writes a Chrome trace")
    p.add_argument("--schedule", action="store_true", help="print the strategy's step table, and exit")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, metavar="SECONDS",
                   help="a rank waiting longer than this for a message fails the run")
    p.add_argument("--blas-threads", type=int, metavar="N", help="BLAS threads per rank")
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    trainer = TRAINERS[args.strategy]
    backend = args.backend if args.backend != "auto" else ("mpi" if launched_by_mpirun() else "threads")
    try:
        mlp = MLP(layers=args.layers, hidden=args.hidden, ffn=args.ffn, tokens=args.tokens,
                  microbatches=args.microbatches, steps=args.steps, dtype=args.dtype, lr=args.lr,
                  momentum=args.momentum, integers=args.integers, seed=args.seed)
        mesh = None if args.mesh is None else Mesh.parse(args.mesh)
        size = args.devices or (world_size() if backend == "mpi" else None) or (mesh.size if mesh else 4)
        mesh = trainer.validate(mlp, size, mesh)  # every check before any rank starts
        launch = LaunchConfig(backend, args.devices, args.timeout or None, None, args.blas_threads)
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
    if args.schedule:
        print(format_schedule(trainer.schedule(mlp, mesh)))
        return 0
    job = TrainJob(trainer, mlp, mesh, check=args.check, json=args.json, trace_path=args.trace_path)
    return start_ranks(launch, mesh, lambda world, backend, per_process: run_train_rank(world, job, backend,
                                                                                        per_process))
