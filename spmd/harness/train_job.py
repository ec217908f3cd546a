"""What every rank of `python -m spmd train` (and its mlp-* presets) does: build its part of the model, train,
report.

The same function runs as a thread or as an MPI process; only the launcher differs.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import signal
import sys
import time
import tracemalloc
from collections import Counter
from dataclasses import dataclass

import numpy as np

from spmd.collectives import barrier, gather
from spmd.data.loader import Corpus
from spmd.harness.breakdown import TRACED_STEPS, as_dicts, breakdown_lines, mean_parts, timed
from spmd.harness.bubble import action_seconds, bubble_at, bubble_line
from spmd.harness.job import gather_spans
from spmd.harness.loop import Watcher, check_finite, due, evaluations, train_loop
from spmd.harness.memory import start_peak_memory, stop_peak_memory
from spmd.harness.mfu import flops_per_token, machine_rate
from spmd.harness.report import byte_unit, in_unit
from spmd.model.config import Net
from spmd.model.kernels import MEMORY_KINDS
from spmd.model.reference import reference_train as composed_reference
from spmd.model.registry import summary
from spmd.observe.trace import hidden_fraction, write_trace
from spmd.parallel.cost import pair_traffic
from spmd.parallel.engine import ComposedRank
from spmd.parallel.strategy import Composition
from spmd.split import own_cores
from spmd.stopwatch import start as start_stopwatch
from spmd.stopwatch import stop as stop_stopwatch
from spmd.trainers import checkpoint
from spmd.transport.clock import Tracer, now_us
from spmd.transport.cores import blas_thread_count
from spmd.transport.group import Group
from spmd.transport.mesh import Mesh, bytes_by_axis
from spmd.transport.mpi import MPICommunicator
from spmd.usage import say


@dataclass(frozen=True)
class TrainJob:
    trainer: Composition  # how the ranks lay the model out
    net: Net  # the run: the model, its sizes, the optimizer
    mesh: Mesh | None = None
    check: bool = False
    json_path: str | None = None  # "-": the report as one JSON line on stdout; a path: into that file
    trace_path: str | None = None
    log_every: int = 10  # rank 0 prints a progress line every this many steps (0: none)
    save: str | None = None  # --save DIR: a checkpoint every save_every steps and after the last
    save_every: int = 0
    keep: int = 0  # the newest checkpoints kept under save (0: every one)
    config: dict | None = None  # the resolved flags, recorded in each checkpoint's manifest
    load: str | None = None  # --load DIR: start from its newest checkpoint's step
    data: str | None = None  # --data DIR: a prepared corpus (the LM's tokens), read on demand
    eval_every: int = 0  # the validation loss every N steps and after the last (0: never)
    eval_tokens: int = 4096  # of validation tokens (whole batches)
    name: str = "train"  # the command, as the report names it (an mlp-* preset's name)


def tolerance(net: Net) -> float:
    """The stated bound on |ours - reference| / max |reference|: 0 for integer data (exact); 1e4 eps in fp64 and
    fp32; under mixed precision Megatron's bound for a layer's gradient, k C^(L+1) eps with k = 4, C = 1.03
    and eps the compute dtype's (arXiv 2506.09280, Theorem 5.3; field-notes B8), once for every step (each
    step's update carries its gradient's error on): 0.036 a step for 4 bf16 layers."""
    if net.integers:
        return 0.0
    if net.policy.mixed:
        return 4 * 1.03 ** (net.layers + 1) * net.policy.epsilon * net.steps
    return 1e4 * float(np.finfo(net.dtype).eps)


def max_relative_error(
    engine: ComposedRank, losses: list[float], net: Net, reference=composed_reference, first: int = 0
) -> float:
    """Against the single-device reference (computed on this rank, from step 0): losses of the steps run (from
    `first`, after a checkpoint) and every parameter it holds."""
    ref_losses, ref_layers = reference(net)
    errors = [abs(a - b) / max(abs(b), 1e-300) for a, b in zip(losses, ref_losses[first:], strict=True)]
    for layer, index, values in engine.owned():
        ref = ref_layers[layer][index]
        scale = max(float(np.abs(ref).max(initial=0.0)), 1e-300)
        errors.append(float(np.abs(values - ref).max(initial=0.0)) / scale)
    # NaN compares false with everything, so max() would drop it: any non-finite error is infinitely wrong
    return max((e if math.isfinite(e) else math.inf for e in errors), default=0.0)


FAULT = "SPMD_FAULT"  # "RANK:STEP": that rank dies as step STEP (0-based) starts; the resume tests' fault


class InjectedFault(RuntimeError):
    """The fault SPMD_FAULT asked for, on threads (a process rank is killed instead)."""


def inject_fault(world: Group, step: int) -> None:
    """Die here if SPMD_FAULT names this rank and step: under MPI by SIGKILL (no cleanup, no message: as a
    lost node), on threads by an exception (the other ranks are threads of this process)."""
    where = os.environ.get(FAULT)
    if not where or where != f"{world.rank}:{step}":
        return
    if isinstance(world.comm, MPICommunicator):
        os.kill(os.getpid(), signal.SIGKILL)
    raise InjectedFault(f"{FAULT}={where}: rank {world.rank} dies as step {step} starts")


def next_batch(net, corpus, held: tuple | None, step: int):
    """The step's (inputs, targets): the corpus's rows, or the synthetic batch copied into the held buffers."""
    if corpus is not None:
        return corpus.batch_data(step)
    for buffer, values in zip(held, net.batch_data(step), strict=True):  # type: ignore[arg-type]
        np.copyto(buffer, values)
    return held


class Fault(Watcher):
    """SPMD_FAULT's rank dies as its step starts (the resume tests' lost node)."""

    def __init__(self, world: Group):
        self.world = world

    def before_step(self, step: int) -> None:
        inject_fault(self.world, step)


class Measures(Watcher):
    """What the report measures of each step: tracemalloc's peak (reset as each of the first TRACED_STEPS steps
    starts, after its batch is read; stopped after them), the stopwatch's parts, a pipeline's busy time and
    actions, a mixture of experts' routing counts, and the bytes evaluations move, kept out of the steps'."""

    def __init__(self, world: Group, engine: ComposedRank, mesh: Mesh, traces_memory: bool):
        self.world, self.engine, self.mesh, self.traces_memory = world, engine, mesh, traces_memory
        self.steps_peak = 0  # the most any traced step held
        self.traced = 0
        self.busy: list[float] = []
        self.laps: list = []  # where each step's time goes, by part
        self.routes: list = []  # this rank's share of the routing counts, each step
        self.op_seconds: Counter = Counter()  # a pipeline rank's seconds in each kind of action (F, B, I, W)
        self.aside = np.zeros(2 + 2 * len(mesh.names))
        self.pairs = engine.exchanged()  # over ep: pairs sent and received (their bytes' closed form)
        self.watch = start_stopwatch()
        self.before: tuple = ()
        traffic = world.traffic()
        self.sent_before, self.received_before = traffic.bytes_sent(), traffic.bytes_received()
        self.axes_before = axis_vector(traffic, mesh)
        self.start_us = now_us()

    def row(self, peak: int, error: float, seconds: list[float], run: int) -> np.ndarray:
        """This rank's figures over the run's `run` steps, one vector to gather: bytes sent and received (the
        evaluations' left out), the peak, --check's error, the bubble, held bytes by kind, [sent, received] over
        each axis, a pipeline's seconds in each kind of action."""
        traffic, engine = self.world.traffic(), self.engine
        sent = traffic.bytes_sent() - self.sent_before - self.aside[0]
        received = traffic.bytes_received() - self.received_before - self.aside[1]
        bubble = 1 - float(np.median(np.array(self.busy) / np.array(seconds)))
        held = [engine.arena.bytes[kind] for kind in MEMORY_KINDS]
        axes = axis_vector(traffic, self.mesh) - self.axes_before - self.aside[2:]
        times = action_seconds(self.op_seconds, Counter(a.op for a in engine.order), run)
        return np.array([sent, received, peak, error, bubble, *held, *axes, *times], dtype=np.float64)

    def before_step(self, step: int) -> None:
        barrier(self.world)  # every rank is done with the step before: this one's tracing starts clean
        if self.traces_memory and self.traced == TRACED_STEPS:
            # the steps after hold what the traced ones held: each writes into the Arena's arrays (but for a mixture
            # of experts with a capacity, whose kept pairs' index is sized by each step's routing: a few bytes)
            tracemalloc.stop()
            self.traces_memory = False
        if self.traces_memory:
            tracemalloc.reset_peak()
        self.watch.lap(0.0)  # what ran between steps (an evaluation) is not the step's

    def after_step(self, step: int, loss: float, seconds: float) -> None:
        self.laps.append(self.watch.lap(seconds))
        if self.traces_memory:
            self.steps_peak = max(self.steps_peak, tracemalloc.get_traced_memory()[1])
            self.traced += 1
        self.busy.append(self.engine.busy)
        self.op_seconds.update(self.engine.op_seconds)
        self.routes.append(self.engine.routing())

    def before_eval(self) -> None:
        self.before = traffic_vector(self.world.traffic(), self.mesh), self.engine.exchanged()

    def after_eval(self, evaluation: dict) -> None:
        self.aside += traffic_vector(self.world.traffic(), self.mesh) - self.before[0]
        self.pairs += self.engine.exchanged() - self.before[1]


class Progress(Watcher):
    """Rank 0's lines: a step's every `every` steps and after the last (with the time so far and what is left),
    and each evaluation's."""

    def __init__(
        self, engine: ComposedRank, net: Net, first: int, every: int, ranks: int, speed: tuple[int, float] | None
    ):
        self.engine, self.net, self.first, self.every, self.ranks, self.speed = engine, net, first, every, ranks, speed
        self.started = time.perf_counter()

    def after_step(self, step: int, loss: float, seconds: float) -> None:
        if not due(step, self.every, self.net.steps):
            return
        norm = self.engine.state.grad_norm
        print(
            step_line(
                self.net, step - 1, loss, norm, seconds, self.ranks, self.speed, sum(self.engine.arena.bytes.values())
            )
            + time_left(self.started, step - self.first, self.net.steps - step),
            file=sys.stderr,
            flush=True,
        )

    def after_eval(self, evaluation: dict) -> None:
        print(f"step {evaluation['step']}/{self.net.steps}  {evaluation_text(evaluation)}", file=sys.stderr, flush=True)


class Saver(Watcher):
    """--save: a checkpoint every --save-every steps and after the last, --keep the newest."""

    def __init__(self, engine: ComposedRank, job: TrainJob, data: dict | None, says: bool):
        self.engine, self.job, self.data, self.says = engine, job, data, says

    def end_of_step(self, step: int) -> None:
        job = self.job
        if job.save is None or not (due(step, job.save_every, job.net.steps) or step == job.net.steps):
            return
        folder = checkpoint.save(self.engine, job.save, step, self.data, job.config, job.keep)
        if self.says:
            print(f"saved {folder}", file=sys.stderr, flush=True)


def run_train_rank(world: Group, job: TrainJob, backend: str, one_rank_per_process: bool):
    """One rank's training run; the report dict at rank 0, None elsewhere.

    Memory: tracemalloc from before the engine allocates; its peak is reset once the engine is built (building
    loads each initial layer whole, once) and again as each of the first TRACED_STEPS steps starts (after its
    batch is made: the synthetic generator's arrays are the job's), so the figure is the most one of them held.
    One process per rank measures itself; on threads rank 0 measures the whole process, every rank together.
    """
    trainer, net, rank = job.trainer, job.net, world.rank
    mesh = trainer.validate(net, world.size, job.mesh)
    corpus = corpus_of(job.data, net) if job.data is not None else None
    # a synthetic batch is made as its step starts, into buffers held from before the measured peak (not all of
    # them up front: 100000 steps would take minutes and memory before the first); a corpus is read step by
    # step, each rank its own rows
    held_batch = None if corpus is not None else tuple(np.array(a) for a in net.batch_data(0))
    evals = evaluations(corpus, job.eval_tokens, job.eval_every)
    reference = trainer.reference if corpus is None else functools.partial(composed_reference, source=corpus)
    data = (
        None if corpus is None else {**corpus.describe(), "seed": corpus.seed, "batch": corpus.batch, "seq": corpus.seq}
    )
    if job.trace_path is not None and world.comm.tracer is None:  # threads share one communicator
        world.comm.tracer = Tracer()
    traces_memory = start_peak_memory(world, one_rank_per_process)
    engine = trainer.build(world, mesh, net)
    first = checkpoint.load(engine, job.load, data) if job.load is not None else 0
    # a real run's MFU (against this machine's measured GEMM rate), in its step lines
    rate = machine_rate(world, net) if corpus is not None else None
    speed = None if rate is None else (flops_per_token(net), rate)
    if rank == 0 and job.load is not None and job.log_every:
        print(f"loaded {job.load} at step {first}", file=sys.stderr, flush=True)
    barrier(world)
    measures = Measures(world, engine, mesh, traces_memory)
    watchers = [Fault(world), measures, Saver(engine, job, data, rank == 0 and job.log_every > 0)]
    if rank == 0 and job.log_every:
        watchers.insert(2, Progress(engine, net, first, job.log_every, world.size, speed))
    # a rank alone in its process splits its kernels over the cores BLAS would have had (spmd.split)
    with own_cores(blas_thread_count() if one_rank_per_process or world.size == 1 else 1):
        done = train_loop(
            engine, lambda step: next_batch(net, corpus, held_batch, step), net.steps, first, evals, watchers
        )
    barrier(world)
    stop_stopwatch()
    peak = measures.steps_peak if stop_peak_memory(traces_memory) >= 0 else -1
    check_finite(engine, done.losses[-1], net.steps, rank, final=True)  # the last update, which no loss has seen
    error = max_relative_error(engine, done.losses, net, reference, first) if job.check else 0.0
    routes = measures.routes
    gathered = Gathered(
        np.array(gather(world, measures.row(peak, error, done.seconds, net.steps - first)) or []),
        gather(world, np.array(routes)) if routes and routes[0] is not None else None,
        gather(world, engine.exchanged() - measures.pairs),
        gather(world, mean_parts(measures.laps)),
        gather_spans(world, measures.start_us) if job.trace_path is not None else None,
    )
    if rank != 0:
        return None
    return rank0_report(job, backend, world.size, mesh, engine, done, data, first, gathered, one_rank_per_process)


@dataclass(frozen=True)
class Gathered:
    """What rank 0 gathered of every rank: `rows` (Measures.row, a rank a row), each step's routing counts, the
    pairs moved over ep, the stopwatch's parts, the trace's spans."""

    rows: np.ndarray
    routing: list | None
    moved: list
    parts: list
    spans: list | None


def rank0_report(
    job: TrainJob,
    backend: str,
    ranks: int,
    mesh: Mesh,
    engine,
    done,
    data: dict | None,
    first: int,
    g: Gathered,
    one_rank_per_process: bool,
) -> dict:
    """The run's report from what every rank measured, against the closed form."""
    trainer, net, rows, routing = job.trainer, job.net, g.rows, g.routing
    cost = trainer.cost(net, mesh)
    run = net.steps - first  # the steps this run took
    model_axes, model_sent, model_received = closed_form_totals(cost, net, mesh, g.moved, run)
    # per rank, per mesh axis: [sent, received] over the run, measured (the columns after memory by kind)
    measured_axes = [axis_columns(r, mesh) for r in rows]
    norms = done.grad_norms
    report = {
        "strategy": job.name,
        "mesh": str(mesh),
        "backend": backend,
        "ranks": ranks,
        "layout": trainer.describe(mesh),
        "model": {**dataclasses.asdict(net), "tokens": net.tokens},
        "losses": done.losses,
        "grad_norms": norms if any(math.isfinite(n) for n in norms) else None,
        "validation": done.validation,
        "routing": None if routing is None else routing_per_step(routing),
        "data": data,
        "step_seconds": done.seconds,
        "breakdown": as_dicts(g.parts),  # per rank, seconds a step in each part (spmd.stopwatch)
        "first_step": first,
        "bytes_sent": [int(v) // run for v in rows[:, 0]],
        "bytes_received": [int(v) // run for v in rows[:, 1]],
        "model_bytes_sent": [b // run for b in model_sent],
        "model_bytes_received": [b // run for b in model_received],
        "memory": [dict(zip(MEMORY_KINDS, map(int, r[5 : 5 + len(MEMORY_KINDS)]), strict=True)) for r in rows],
        # per rank, per mesh axis: [sent, received] a step, measured and the closed form's
        "axis_bytes": [per_step(axes, run) for axes in measured_axes],
        "model_axis_bytes": [per_step(axes, run) for axes in model_axes],
        "model_memory": cost.memory,
        "peak_bytes": [int(v) for v in rows[:, 2]] if one_rank_per_process else None,
        "process_peak_bytes": None if one_rank_per_process else int(rows[0, 2]),
    }
    return finish_report(
        report,
        job,
        engine,
        mesh,
        rows,
        g.spans,
        measured_axes == model_axes
        and [int(v) for v in rows[:, 0]] == model_sent
        and [int(v) for v in rows[:, 1]] == model_received,
        cost.memory,
        ranks,
    )


def axis_columns(row, mesh: Mesh) -> dict[str, list[int]]:
    """A rank's [sent, received] over each mesh axis, from its row (the columns after memory by kind)."""
    starts = range(5 + len(MEMORY_KINDS), len(row) - 3, 2)
    return {axis: [int(row[at]), int(row[at + 1])] for axis, at in zip(mesh.names, starts, strict=True)}


def routing_per_step(routing) -> list[dict]:
    """Per step, summed over the ranks: (token, expert) pairs routed to each expert over every layer, dropped."""
    return [{"tokens_per_expert": [int(c) for c in counts[:-1]], "dropped": int(counts[-1])} for counts in sum(routing)]


def closed_form_totals(cost, net, mesh: Mesh, moved, run: int) -> tuple[list, list[int], list[int]]:
    """The closed form over a run of `run` steps, per rank: bytes [sent, received] over each axis, sent and received
    in all; its steps' bytes plus the pairs' rows where the routing sent them (ep: `moved`, measured)."""
    by_pairs = [pair_traffic(net, p) for p in moved]
    axes = [
        {axis: [t.sent[axis] * run + e.sent[axis], t.received[axis] * run + e.received[axis]] for axis in mesh.names}
        for t, e in zip(cost.traffic, by_pairs, strict=True)
    ]
    sent = [b * run + sum(e.sent.values()) for b, e in zip(cost.bytes_sent, by_pairs, strict=True)]
    received = [b * run + sum(e.received.values()) for b, e in zip(cost.bytes_received, by_pairs, strict=True)]
    return axes, sent, received


def finish_report(
    report: dict,
    job: TrainJob,
    engine,
    mesh: Mesh,
    rows: np.ndarray,
    spans,
    bytes_ok: bool,
    model_memory: list,
    ranks: int,
) -> dict:
    """The report's verdicts (bytes and memory against the closed form, --check's error against one device), the
    pipeline's bubble, the trace; written and said as the job asks. `bytes_ok`: on the totals over every step (a
    per-step figure from integer division could hide a stray byte)."""
    trainer, net = job.trainer, job.net
    report.update(bubble=[float(v) for v in rows[:, 4]], bubble_model=trainer.bubble(net, mesh))
    if "pp" in mesh.names:
        report["bubble_at_measured_times"] = bubble_at(
            engine.layout.schedule, mesh.axis_size("pp"), net.microbatches, net.chunks, rows[:, -3:], ranks
        )
    report.update(bytes_match_model=bytes_ok, memory_match_model=report["memory"] == model_memory)
    if job.check:
        worst = float(rows[:, 3].max())
        ok = worst <= tolerance(net) and bytes_ok and report["memory_match_model"]
        report.update(max_relative_error=worst, tolerance=tolerance(net), ok=bool(ok))
    if spans is not None and job.trace_path is not None:
        write_trace(job.trace_path, spans, mesh)
        report.update(trace=job.trace_path, hidden_fraction=hidden_fraction(spans))
    if job.json_path not in (None, "-"):
        with open(job.json_path, "w") as f:
            f.write(json.dumps(report) + "\n")
        report.update(json=job.json_path)
    say(json.dumps(report) if job.json_path == "-" else format_train_report(report))
    return report


def per_step(axes: dict[str, list[int]], steps: int) -> dict[str, list[int]]:
    """Bytes per axis over a run, [sent, received], as a step's."""
    return {axis: [sent // steps, received // steps] for axis, (sent, received) in axes.items()}


def corpus_of(folder: str, net) -> Corpus:
    """--data's corpus for `net` (the LM's Net: --data is refused for the other models before ranks start)."""
    return Corpus(folder, net.seq, net.batch, net.seed)


def evaluation_text(v: dict) -> str:
    return (
        f"validation loss {v['loss']:.6g} nats a token, {v['bits_per_byte']:.4g} bits a byte  perplexity "
        f"{v['perplexity']:.4g}"
    )


def traffic_vector(traffic, mesh: Mesh) -> np.ndarray:
    """[sent, received, then axis_vector] of a rank's traffic so far."""
    return np.concatenate([[traffic.bytes_sent(), traffic.bytes_received()], axis_vector(traffic, mesh)])


def axis_vector(traffic, mesh: Mesh) -> np.ndarray:
    """[sent, received] over each mesh axis, in the mesh's order, of a rank's traffic so far."""
    totals = bytes_by_axis(traffic, mesh)
    return np.array([b for axis in mesh.names for b in totals[axis]], dtype=np.float64)


def loss_list(losses: list[float], first: int) -> str:
    """Every step's loss, or for a long run the first and last five (the --json report has them all)."""
    text = lambda values: " ".join(f"{v:.6g}" for v in values)  # noqa: E731
    if len(losses) <= 12:
        return text(losses)
    return f"{text(losses[:5])} ... {text(losses[-5:])} (steps {first + 1}-{first + len(losses)}; all in --json)"


def precision_label(fields: dict) -> str:
    """The run's number format: its dtype, or under mixed precision the policy (bf16 compute, fp32 master)."""
    precision = fields.get("precision", "")
    if precision in ("bf16", "fp16"):
        reduce = fields.get("reduce_dtype") or "fp32"
        return f"{precision} compute, fp32 master weights and optimizer state, {reduce} gradients"
    return fields["dtype"]


def step_line(
    net: Net,
    step: int,
    loss: float,
    norm: float,
    seconds: float,
    ranks: int = 1,
    speed: tuple[int, float] | None = None,
    held: int = 0,
) -> str:
    """Rank 0's progress line: step, loss, gradient norm (when clipping computes it), learning rate, tokens/s (in
    all and a device); for a run on real text MFU (spmd.harness.mfu: flops per token, the machine's GEMM rate)
    and rank 0's memory held."""
    lr = f"  lr {net.rate_at(step + 1):.3g}"
    norm_text = f"  grad norm {norm:.4g}" if math.isfinite(norm) else ""
    tokens = net.tokens / seconds
    more = f" ({tokens / ranks:,.0f} a device)" if ranks > 1 else ""
    if speed is not None:
        more += f"  MFU {speed[0] * tokens / speed[1]:.1%}  held {held / 2**20:.1f} MiB"
    return f"step {step + 1}/{net.steps}  loss {loss:.6g}{norm_text}{lr}  {seconds:.4f} s  {tokens:,.0f} tokens/s{more}"


def clock(seconds: float) -> str:
    """A duration as a user reads it: 42s, 3m05s, 1h02m."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def time_left(started: float, done: int, remaining: int) -> str:
    """The progress line's tail: the run's time so far, and what is left at its pace so far (evaluations and
    saves included)."""
    elapsed = time.perf_counter() - started
    return f"  elapsed {clock(elapsed)}" + (f", about {clock(elapsed / done * remaining)} left" if remaining else "")


def memory_lines(r: dict) -> list[str]:
    """The report's memory: each rank's by kind and its measured peak (or the one process's, on threads)."""
    held_unit = byte_unit([sum(m.values()) for m in r["memory"]] + (r["peak_bytes"] or []))
    lines = [f"  held per rank, {held_unit[0]}: " + " / ".join(MEMORY_KINDS)]
    for rank, held in enumerate(r["memory"]):
        peak = f", measured peak {in_unit([r['peak_bytes'][rank]], held_unit)}" if r["peak_bytes"] else ""
        lines.append(
            f"    rank {rank}: "
            + " / ".join(in_unit([held[k]], held_unit) for k in MEMORY_KINDS)
            + f" = {in_unit([sum(held.values())], held_unit)}{peak}"
        )
    if r["process_peak_bytes"] is not None:
        unit = byte_unit([r["process_peak_bytes"]])
        lines.append(
            f"    every rank (one process): measured peak {in_unit([r['process_peak_bytes']], unit)} {unit[0]}"
        )
    return lines


def format_train_report(r: dict) -> str:
    m = r["model"]
    model, shape = summary(m)
    lines = [
        f"spmd {r['strategy']}: {r['ranks']} ranks on {r['backend']} (mesh {r['mesh']}), "
        f"{model} {m['layers']} layers{shape}, "
        f"h {m['hidden']}, f {m['ffn']}, {m['tokens']} tokens"
        + (f" in {m['microbatches']} micro-batches" if m["microbatches"] > 1 else "")
        + f", {precision_label(m)}",
        "  loss per step: " + loss_list(r["losses"], r.get("first_step", 0)),
        f"  step: median {np.median(timed(r['step_seconds'])):.4f} s",
    ]
    sent = byte_unit(r["bytes_sent"] + r["model_bytes_sent"])
    lines.append(
        f"  sent per rank per step, {sent[0]}: {in_unit(r['bytes_sent'], sent)} "
        f"(model: {in_unit(r['model_bytes_sent'], sent)})"
    )
    if r.get("axis_bytes"):
        axes = r["axis_bytes"][0]
        unit = byte_unit([sent for sent, _ in axes.values()])
        lines.append(
            f"  sent by rank 0 per step over each axis, {unit[0]}: "
            + ", ".join(f"{axis} {in_unit([axes[axis][0]], unit)}" for axis in axes)
            + " (the closed form's: "
            + ", ".join(f"{in_unit([model[0]], unit)}" for model in r["model_axis_bytes"][0].values())
            + ")"
        )
    if r.get("breakdown"):
        lines += breakdown_lines(r["breakdown"])
    if r.get("routing"):
        moe_layers = len(range(0, m["layers"], m.get("moe_every", 1)))
        lines.append(
            f"  routing, (token, expert) pairs a step over the {moe_layers} expert layers, to each expert: "
            + "; ".join(" ".join(map(str, s["tokens_per_expert"])) + f" (dropped {s['dropped']})" for s in r["routing"])
        )
    lines += memory_lines(r)
    if r.get("validation"):
        last = r["validation"][-1]
        lines.append(f"  at step {last['step']}: {evaluation_text(last)}, on {r['data']['folder']}")
    if r.get("json"):
        lines.append(f"  report: {r['json']}")
    if r.get("trace"):
        lines.append(f"  trace: {r['trace']}")
        if r.get("hidden_fraction") is not None:
            lines.append(f"  transfers under compute: {r['hidden_fraction']:.0%} of their time")
    if r.get("bubble_at_measured_times"):  # a pipeline's idle share; without one, nothing to say
        lines.append(bubble_line(r["bubble"], r["bubble_at_measured_times"]))
    lines.append(f"  bytes == model: {r['bytes_match_model']}, held memory == model: {r['memory_match_model']}")
    if "ok" in r:
        lines.append(
            f"  check: max relative error vs the single-device step {r['max_relative_error']:.3g} "
            f"(tolerance {r['tolerance']:.3g}) {'OK' if r['ok'] else 'FAILED'}"
        )
    return "\n".join(lines)
