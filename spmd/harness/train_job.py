"""What every rank of `python -m spmd mlp-<strategy>` does: build its part of the model, train, report.

The same function runs as a thread or as an MPI process; only the launcher differs.
"""

from __future__ import annotations

import json
import time
import tracemalloc
from dataclasses import dataclass

import numpy as np

from spmd.collectives import barrier, gather
from spmd.harness.job import gather_spans
from spmd.observe.memory import start_peak_memory, stop_peak_memory
from spmd.observe.trace import Tracer, now_us, write_trace
from spmd.train.kernels import KINDS
from spmd.train.record import Trainer
from spmd.transport.group import Group
from spmd.transport.mesh import Mesh
from spmd.workloads.mlp import MLP, reference_train


@dataclass(frozen=True)
class TrainJob:
    trainer: Trainer
    mlp: MLP
    mesh: Mesh | None = None
    check: bool = False
    json: bool = False
    trace_path: str | None = None


def tolerance(mlp: MLP) -> float:
    """The stated bound on |ours - reference| / max |reference|: 0 for integer data (exact), else 1e4 eps."""
    return 0.0 if mlp.integers else 1e4 * float(np.finfo(mlp.dtype).eps)


def max_relative_error(engine, losses: list[float], mlp: MLP) -> float:
    """Against the single-device reference (computed on this rank): losses and every parameter it holds."""
    ref_losses, ref_layers = reference_train(mlp)
    worst = max(abs(a - b) / max(abs(b), 1e-300) for a, b in zip(losses, ref_losses, strict=True))
    for layer, index, values in engine.owned():
        ref = ref_layers[layer][index]
        scale = max(float(np.abs(ref).max(initial=0.0)), 1e-300)
        worst = max(worst, float(np.abs(values - ref).max(initial=0.0)) / scale)
    return worst


def run_train_rank(world: Group, job: TrainJob, backend: str, one_rank_per_process: bool):
    """One rank's training run; the report dict at rank 0, None elsewhere.

    Memory: tracemalloc from before the engine allocates; its peak is reset once the
    engine is built (building loads each initial layer whole, once), so the figure is
    what the steps hold. One process per rank measures itself; on threads rank 0
    measures the whole process, every rank together.
    """
    trainer, mlp, rank = job.trainer, job.mlp, world.rank
    mesh = trainer.validate(mlp, world.size, job.mesh)
    batches = [mlp.batch(step) for step in range(mlp.steps)]
    if job.trace_path is not None and world.comm.tracer is None:  # threads share one communicator
        world.comm.tracer = Tracer()
    traces_memory = start_peak_memory(world, one_rank_per_process)
    engine = trainer.start(world, mesh, mlp)
    barrier(world)
    if traces_memory:
        tracemalloc.reset_peak()
    sent_before, received_before = world.traffic().bytes_sent(), world.traffic().bytes_received()
    losses, seconds, busy, start_us = [], [], [], now_us()
    for x, target in batches:
        barrier(world)
        started = time.perf_counter()
        losses.append(engine.step(x, target))
        seconds.append(time.perf_counter() - started)
        busy.append(engine.busy)
    barrier(world)
    peak = stop_peak_memory(traces_memory)
    sent = world.traffic().bytes_sent() - sent_before
    received = world.traffic().bytes_received() - received_before
    error = max_relative_error(engine, losses, mlp) if job.check else 0.0
    bubble = 1 - float(np.median(np.array(busy) / np.array(seconds)))
    held = [engine.plan.bytes[kind] for kind in KINDS]
    measured = gather(world, np.array([sent, received, peak, error, bubble, *held], dtype=np.float64))
    spans = gather_spans(world, start_us) if job.trace_path is not None else None
    if rank != 0:
        return None
    cost = trainer.cost(mlp, mesh)
    rows = np.array(measured)
    report = {
        "strategy": trainer.name, "mesh": str(mesh), "backend": backend, "ranks": world.size,
        "mlp": {k: getattr(mlp, k) for k in ("layers", "hidden", "ffn", "tokens", "microbatches", "steps", "dtype",
                                              "lr", "momentum", "integers", "seed")},
        "losses": losses,
        "step_seconds": seconds,
        "bytes_sent": [int(v) // mlp.steps for v in rows[:, 0]],
        "bytes_received": [int(v) // mlp.steps for v in rows[:, 1]],
        "model_bytes_sent": cost.bytes_sent, "model_bytes_received": cost.bytes_received,
        "memory": [dict(zip(KINDS, map(int, r[5:]), strict=True)) for r in rows],
        "model_memory": cost.memory,
        "peak_bytes": [int(v) for v in rows[:, 2]] if one_rank_per_process else None,
        "process_peak_bytes": None if one_rank_per_process else int(rows[0, 2]),
    }
    if trainer.microbatched:
        p, m = mesh.size, mlp.microbatches
        report.update(bubble=[float(v) for v in rows[:, 4]], bubble_model=(p - 1) / (m + p - 1))
    # on the totals over every step: a per-step figure from integer division could hide a stray byte
    bytes_ok = ([int(v) for v in rows[:, 0]] == [b * mlp.steps for b in cost.bytes_sent]
                and [int(v) for v in rows[:, 1]] == [b * mlp.steps for b in cost.bytes_received])
    report.update(bytes_match_model=bytes_ok, memory_match_model=report["memory"] == cost.memory)
    if job.check:
        worst = float(rows[:, 3].max())
        ok = worst <= tolerance(mlp) and bytes_ok and report["memory_match_model"]
        report.update(max_relative_error=worst, tolerance=tolerance(mlp), ok=bool(ok))
    if spans is not None:
        write_trace(job.trace_path, spans)
        report.update(trace=job.trace_path)
    print(json.dumps(report) if job.json else format_train_report(report), flush=True)
    return report


def _kib(values) -> str:
    return " ".join(f"{v / 1024:.1f}" for v in values)


def format_train_report(r: dict) -> str:
    m = r["mlp"]
    lines = [
        f"spmd {r['strategy']}: {r['ranks']} ranks on {r['backend']} (mesh {r['mesh']}), MLP {m['layers']} layers, "
        f"h {m['hidden']}, f {m['ffn']}, {m['tokens']} tokens" + (f" in {m['microbatches']} micro-batches"
                                                                  if m["microbatches"] > 1 else "")
        + f", {m['dtype']}",
        "  loss per step: " + " ".join(f"{v:.6g}" for v in r["losses"]),
        f"  step: median {np.median(r['step_seconds']):.4f} s",
        f"  sent per rank per step, KiB: {_kib(r['bytes_sent'])} (model: {_kib(r['model_bytes_sent'])})",
        "  held per rank, KiB: " + " / ".join(KINDS),
    ]
    for rank, held in enumerate(r["memory"]):
        peak = f", measured peak {r['peak_bytes'][rank] / 1024:.1f}" if r["peak_bytes"] else ""
        lines.append(f"    rank {rank}: " + " / ".join(f"{held[k] / 1024:.1f}" for k in KINDS)
                     + f" = {sum(held.values()) / 1024:.1f}{peak}")
    if r["process_peak_bytes"] is not None:
        lines.append(f"    every rank (one process): measured peak {r['process_peak_bytes'] / 1024:.1f} KiB")
    if "bubble" in r:
        lines.append("  bubble per stage, measured: " + " ".join(f"{v:.2f}" for v in r["bubble"])
                     + f"; (p-1)/(m+p-1) = {r['bubble_model']:.2f}")
    lines.append(f"  bytes == model: {r['bytes_match_model']}, held memory == model: {r['memory_match_model']}")
    if "ok" in r:
        lines.append(f"  check: max relative error vs the single-device step {r['max_relative_error']:.3g} "
                     f"(tolerance {r['tolerance']:.3g}) {'OK' if r['ok'] else 'FAILED'}")
    return "\n".join(lines)
