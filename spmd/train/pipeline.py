"""Pipeline parallelism: the layers split into p stages, the batch streamed as m micro-batches.

Stage r holds layers np.array_split(range(L), p)[r] whole, with their gradients
and optimizer state. A forward receives its micro-batch's activations from
stage r - 1 and sends its output to r + 1; a backward receives the output's
gradient from r + 1 into the same buffer and sends the input's gradient to
r - 1. Every message is tagged by direction and micro-batch (pipe_tag).
Gradients accumulate over the micro-batches; the loss is summed at the last
stage and broadcast. The order of forwards and backwards is GPipe's or 1F1B's
(pipeline_schedule); activations live in slots, one per micro-batch in flight.
"""

from __future__ import annotations

import time

import numpy as np

from spmd.collectives import broadcast
from spmd.collectives.cost import broadcast_bytes
from spmd.collectives.tags import pipe_tag
from spmd.layout import block_range, block_size, largest_block
from spmd.observe.trace import traced
from spmd.train import kernels
from spmd.train.engine import Engine
from spmd.train.kernels import Scratch
from spmd.train.pipeline_schedule import in_flight, order, schedule
from spmd.train.record import Tally, TrainCost, Trainer, memory, scratch_elements, step_flops
from spmd.transport.mesh import Mesh
from spmd.workloads.mlp import MLP


class Pipeline(Engine):
    layer_spans = False  # traced per micro-batch (F k / B k) below
    def __init__(self, world, mesh: Mesh, mlp: MLP, kind: str):
        super().__init__(world, mesh, mlp)
        self.group = mesh.group(world, "pp")
        p, r, m = self.group.size, self.group.rank, mlp.microbatches
        self.layers = list(range(*block_range(mlp.layers, p, r)))
        self.order = order(kind, p, m, r)
        n, h, f, rows = len(self.layers), mlp.hidden, mlp.ffn, largest_block(mlp.tokens, m)
        take = self.plan.take
        self.params = take("params", (n, self.width))
        self.grads = take("grads", (n, self.width))
        self.layer_grad = take("grads", (self.width,)) if m > 1 else None  # a later micro-batch's share
        self.velocity = take("optimizer", (n, self.width))
        slots = in_flight(kind, p, m, r)
        self.slot_x = [[take("activations", (rows, h)) for _ in range(n + 1)] for _ in range(slots)]
        self.slot_a = [[take("activations", (rows, f)) for _ in range(n)] for _ in range(slots)]
        self.full_scratch = Scratch(self.plan, rows, h, f)
        for i, layer in enumerate(self.layers):
            self.params[i] = mlp.initial_layer(layer)
        self.accumulate = False

    def bind(self, slot: int, microbatch: int) -> tuple[int, int]:
        """Point the layer code at `slot`'s buffers, cut to the micro-batch's rows; returns its batch rows."""
        lo, hi = block_range(self.mlp.tokens, self.mlp.microbatches, microbatch)
        self.x = [b[:hi - lo] for b in self.slot_x[slot]]
        self.a = [b[:hi - lo] for b in self.slot_a[slot]]
        self.scratch = self.full_scratch.rows(hi - lo)
        return lo, hi

    def grad_buffer(self, i):
        return self.layer_grad if self.accumulate else self.grads[i]

    def grad_ready(self, i):
        if self.accumulate:
            np.add(self.grads[i], self.layer_grad, out=self.grads[i])

    def step(self, x, target):
        g, last = self.group, self.group.rank == self.group.size - 1
        free, slot_of, sending = list(range(len(self.slot_x))), {}, {}
        loss, self.busy, self.accumulate = 0.0, 0.0, False
        for action, k in self.order:
            if action == "F":
                slot = slot_of[k] = free.pop(0)
                if slot in sending:
                    sending.pop(slot).wait()
                lo, hi = self.bind(slot, k)
                if g.rank == 0:
                    self.x[0][...] = x[lo:hi]
                else:
                    g.irecv(g.rank - 1, pipe_tag(False, k), self.x[0]).wait()
                started = time.perf_counter()
                with traced(g, f"F{k}"):
                    for i in range(len(self.layers)):
                        self.forward_layer(i)
                    if last:
                        loss += kernels.loss_grad(self.x[-1], target[lo:hi])
                self.busy += time.perf_counter() - started
                if not last:
                    sending[slot] = g.isend(g.rank + 1, self.x[-1], pipe_tag(False, k))
            else:
                slot = slot_of.pop(k)
                self.bind(slot, k)
                if not last:
                    sending.pop(slot).wait()  # the output went out; its gradient comes back into its place
                    g.irecv(g.rank + 1, pipe_tag(True, k), self.x[-1]).wait()
                started = time.perf_counter()
                with traced(g, f"B{k}"):
                    for i in reversed(range(len(self.layers))):
                        self.backward_layer(i, self.x[-1])
                self.busy += time.perf_counter() - started
                self.accumulate = True
                if g.rank > 0:
                    sending[slot] = g.isend(g.rank - 1, self.x[-1], pipe_tag(True, k))
                free.append(slot)
        for request in sending.values():
            request.wait()
        kernels.sgd(self.params, self.grads, self.velocity, self.mlp.lr, self.mlp.momentum)
        total = broadcast(g, np.array([loss], dtype=self.plan.dtype) if last else None, root=g.size - 1)
        return float(total[0])

    def owned(self):
        index = np.arange(self.width)
        return [(layer, index, self.params[i]) for i, layer in enumerate(self.layers)]


def cost(mlp: MLP, mesh: Mesh, kind: str) -> TrainCost:
    p, m, h, f, s = mesh.size, mlp.microbatches, mlp.hidden, mlp.ffn, mlp.itemsize
    activations = mlp.tokens * h * s  # every micro-batch's (rows, h) once
    rows, width = largest_block(mlp.tokens, m), mlp.layer_size
    traffic, held, flops = [], [], []
    for r in range(p):
        n = block_size(mlp.layers, p, r)
        tally = Tally()
        # activations on to r + 1, their gradients back to r - 1; then the loss, from the last stage
        tally.add("pp", (activations * (r < p - 1), activations * (r > 0)))
        tally.add("pp", (activations * (r > 0), activations * (r < p - 1)))
        tally.add("pp", broadcast_bytes(s, p, r, root=p - 1))
        traffic.append(tally)
        slots = in_flight(kind, p, m, r)
        held.append(memory(
            s, params=n * width, grads=n * width + (width if m > 1 else 0), optimizer=n * width,
            activations=slots * ((n + 1) * rows * h + n * rows * f),
            buffers=scratch_elements(rows, h, f),
        ))
        flops.append(step_flops(mlp.tokens, h, f, n))
    return TrainCost(traffic, held, flops)


def check(mlp: MLP, mesh: Mesh) -> None:
    p = mesh.size
    if p > mlp.layers:
        raise ValueError(f"{p} pipeline stages but only {mlp.layers} layers: a stage needs at least one layer")
    if mlp.microbatches > mlp.tokens:
        raise ValueError(f"{mlp.microbatches} micro-batches but only {mlp.tokens} tokens: "
                         "a micro-batch needs at least one row")


def trainer(kind: str) -> Trainer:
    return Trainer(
        name=f"mlp-pp-{kind}",
        summary=f"MLP training, pipeline parallel ({kind}): layers split into stages, micro-batches streamed",
        axes=("pp",),
        build=lambda world, mesh, mlp: Pipeline(world, mesh, mlp, kind),
        cost=lambda mlp, mesh: cost(mlp, mesh, kind),
        check=check,
        schedule=lambda mlp, mesh: schedule(kind, mesh.size, mlp.microbatches),
        microbatched=True,
    )


GPIPE, ONE_F_ONE_B = trainer("gpipe"), trainer("1f1b")
