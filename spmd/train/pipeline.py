"""Pipeline parallelism: the layers cut into p x v stages, the batch streamed as m micro-batches.

Rank r holds v model chunks, stages r, r + p, ..., r + (v-1) p (the loop layout; v = 1 but for
interleaved schedules), each np.array_split(range(L), p v)[stage] whole, with their gradients and
optimizer state. One executor runs any registered schedule (pipeline_schedule.SCHEDULES): for each
Action, a forward receives its micro-batch's activations from the previous stage (rank r - 1, or for
chunk c > 0 on rank 0, rank p - 1's chunk c - 1) and sends its output on; a backward receives the
output's gradient into the same buffer and sends its input's gradient back. Every message is tagged
by direction, micro-batch and the chunk of the boundary it crosses (pipe_tag). Gradients accumulate
over the micro-batches; the loss is summed at the last stage and broadcast. Activations live in
slots, each as deep as the rank's largest chunk: one per (micro-batch, chunk) in flight, plus what
a backward's gradient, sent back out of its slot, keeps busy (pipeline_schedule.executor_slots).
"""

from __future__ import annotations

import time

import numpy as np

from spmd.collectives import broadcast
from spmd.collectives.cost import broadcast_bytes
from spmd.collectives.tags import pipe_tag
from spmd.layout import block_range, largest_block
from spmd.observe.trace import traced
from spmd.train import kernels
from spmd.train.engine import Engine
from spmd.train.kernels import Scratch
from spmd.train.pipeline_schedule import executor_slots, ideal_bubble, order, schedule, schedule_named, stage_of
from spmd.train.record import Tally, TrainCost, Trainer, memory, scratch_elements, step_flops
from spmd.transport.mesh import Mesh
from spmd.workloads.mlp import MLP


def chunk_layers(mlp: MLP, stages: int, rank: int) -> list[list[int]]:
    """The global layers of each of `rank`'s chunks, chunk 0 first."""
    v = mlp.chunks
    return [list(range(*block_range(mlp.layers, stages * v, stage_of(rank, c, stages)))) for c in range(v)]


class Pipeline(Engine):
    layer_spans = False  # traced per action (F k / B k) below

    def __init__(self, world, mesh: Mesh, mlp: MLP, kind: str):
        super().__init__(world, mesh, mlp)
        self.group = mesh.group(world, "pp")
        p, r, m, v = self.group.size, self.group.rank, mlp.microbatches, mlp.chunks
        self.chunks = chunk_layers(mlp, p, r)
        self.layers = [layer for chunk in self.chunks for layer in chunk]
        self.first = [sum(map(len, self.chunks[:c])) for c in range(v)]  # local index of each chunk's first layer
        self.order = order(kind, p, m, r, v)
        n, h, f, rows = len(self.layers), mlp.hidden, mlp.ffn, largest_block(mlp.tokens, m)
        depth = max(map(len, self.chunks))
        take = self.plan.take
        self.params = take("params", (n, self.width))
        self.grads = take("grads", (n, self.width))
        self.layer_grad = take("grads", (self.width,)) if m > 1 else None  # a later micro-batch's share
        self.velocity = take("optimizer", (n, self.width))
        slots = executor_slots(kind, p, m, v)[r]
        self.slot_x = [[take("activations", (rows, h)) for _ in range(depth + 1)] for _ in range(slots)]
        self.slot_a = [[take("activations", (rows, f)) for _ in range(depth)] for _ in range(slots)]
        self.full_scratch = Scratch(self.plan, rows, h, f)
        for i, layer in enumerate(self.layers):
            self.params[i] = mlp.initial_layer(layer)
        self.written: set[int] = set()  # local layers whose gradient this step has begun

    def bind(self, slot: int, microbatch: int, chunk: int) -> tuple[int, int]:
        """Point the layer code at `slot`'s buffers for `chunk`, cut to the micro-batch's rows; returns its rows.

        The lists are indexed by local layer, so chunk c's layers i = first[c] + j see the slot's j-th buffers.
        """
        lo, hi = block_range(self.mlp.tokens, self.mlp.microbatches, microbatch)
        pad, depth = [None] * self.first[chunk], len(self.chunks[chunk])
        self.x = pad + [b[:hi - lo] for b in self.slot_x[slot][:depth + 1]]
        self.a = pad + [b[:hi - lo] for b in self.slot_a[slot][:depth]]
        self.scratch = self.full_scratch.rows(hi - lo)
        return lo, hi

    def grad_buffer(self, i):
        return self.layer_grad if i in self.written else self.grads[i]

    def grad_ready(self, i):
        if i in self.written:
            np.add(self.grads[i], self.layer_grad, out=self.grads[i])
        self.written.add(i)

    def step(self, x, target):
        g, p, v = self.group, self.group.size, self.mlp.chunks
        prev, succ, last_stage = (g.rank - 1) % p, (g.rank + 1) % p, p * v - 1
        free, slot_of, sending = list(range(len(self.slot_x))), {}, {}
        loss, self.busy = 0.0, 0.0
        self.written.clear()
        for a in self.order:
            c, k = a.chunk, a.microbatch
            s, local = stage_of(g.rank, c, p), range(self.first[c], self.first[c] + len(self.chunks[c]))
            if a.op == "F":
                slot = slot_of[(c, k)] = free.pop(0)
                if slot in sending:
                    sending.pop(slot).wait()
                lo, hi = self.bind(slot, k, c)
                if s == 0:
                    self.x[local.start][...] = x[lo:hi]
                else:  # the boundary below stage s belongs to the sender's chunk: (s - 1) // p
                    g.irecv(prev, pipe_tag(False, k, (s - 1) // p, v), self.x[local.start]).wait()
                started = time.perf_counter()
                with traced(g, a.label(v)):
                    for i in local:
                        self.forward_layer(i)
                    if s == last_stage:
                        loss += kernels.loss_grad(self.x[local.stop], target[lo:hi])
                self.busy += time.perf_counter() - started
                if s < last_stage:
                    sending[slot] = g.isend(succ, self.x[local.stop], pipe_tag(False, k, s // p, v))
            else:
                slot = slot_of.pop((c, k))
                self.bind(slot, k, c)
                out = self.x[local.stop]
                if s < last_stage:
                    sending.pop(slot).wait()  # the output went out; its gradient comes back into its place
                    g.irecv(succ, pipe_tag(True, k, s // p, v), out).wait()
                started = time.perf_counter()
                with traced(g, a.label(v)):
                    for i in reversed(local):
                        self.backward_layer(i, out)
                self.busy += time.perf_counter() - started
                if s > 0:
                    sending[slot] = g.isend(prev, out, pipe_tag(True, k, (s - 1) // p, v))
                free.append(slot)
        for request in sending.values():
            request.wait()
        kernels.sgd(self.params, self.grads, self.velocity, self.mlp.lr, self.mlp.momentum)
        last_rank = last_stage % p
        total = broadcast(g, np.array([loss], dtype=self.plan.dtype) if g.rank == last_rank else None, root=last_rank)
        return float(total[0])

    def owned(self):
        index = np.arange(self.width)
        return [(layer, index, self.params[i]) for i, layer in enumerate(self.layers)]


def cost(mlp: MLP, mesh: Mesh, kind: str) -> TrainCost:
    p, m, v, h, f, s = mesh.size, mlp.microbatches, mlp.chunks, mlp.hidden, mlp.ffn, mlp.itemsize
    activations = mlp.tokens * h * s  # every micro-batch's (rows, h) once, across one stage boundary
    rows, width = largest_block(mlp.tokens, m), mlp.layer_size
    traffic, held, flops = [], [], []
    slot_counts = executor_slots(kind, p, m, v)
    for r in range(p):
        chunks = chunk_layers(mlp, p, r)
        n, depth = sum(map(len, chunks)), max(map(len, chunks))
        # a stage sends activations on unless it is the last, gradients back unless it is the first
        on, back = v - (r == p - 1), v - (r == 0)
        tally = Tally()
        tally.add("pp", (activations * on, activations * back))  # forward: sent on, received from below
        tally.add("pp", (activations * back, activations * on))  # backward: sent back, received from above
        tally.add("pp", broadcast_bytes(s, p, r, root=p - 1))  # the loss, from the last stage's rank
        traffic.append(tally)
        held.append(memory(
            s, params=n * width, grads=n * width + (width if m > 1 else 0), optimizer=n * width,
            activations=slot_counts[r] * ((depth + 1) * rows * h + depth * rows * f),
            buffers=scratch_elements(rows, h, f),
        ))
        flops.append(step_flops(mlp.tokens, h, f, n))
    return TrainCost(traffic, held, flops)


def check(mlp: MLP, mesh: Mesh, kind: str) -> None:
    p, v = mesh.size, mlp.chunks
    if p * v > mlp.layers:
        raise ValueError(f"{p} pipeline stages x {v} chunks = {p * v} stages but only {mlp.layers} layers: "
                         "a stage needs at least one layer" if v > 1 else
                         f"{p} pipeline stages but only {mlp.layers} layers: a stage needs at least one layer")
    if mlp.microbatches > mlp.tokens:
        raise ValueError(f"{mlp.microbatches} micro-batches but only {mlp.tokens} tokens: "
                         "a micro-batch needs at least one row")
    schedule_named(kind).check(p, mlp.microbatches, v)


def trainer(name: str, kind: str) -> Trainer:
    return Trainer(
        name=name,
        summary=f"MLP training, pipeline parallel ({kind}): layers split into stages, micro-batches streamed"
        + (", v model chunks per rank (--chunks)" if schedule_named(kind).chunked else ""),
        axes=("pp",),
        build=lambda world, mesh, mlp: Pipeline(world, mesh, mlp, kind),
        cost=lambda mlp, mesh: cost(mlp, mesh, kind),
        check=lambda mlp, mesh: check(mlp, mesh, kind),
        schedule=lambda mlp, mesh: schedule(kind, mesh.size, mlp.microbatches, mlp.chunks),
        microbatched=True,
        bubble=lambda mlp, mesh: ideal_bubble(kind, mesh.size, mlp.microbatches, mlp.chunks),
        chunked=schedule_named(kind).chunked,
    )


GPIPE, ONE_F_ONE_B = trainer("mlp-pp-gpipe", "gpipe"), trainer("mlp-pp-1f1b", "1f1b")
INTERLEAVED = trainer("mlp-pp-interleaved", "interleaved-1f1b")
