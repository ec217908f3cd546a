"""One rank of a composed run: its pipeline stages' layers, each a block of the model, on the mesh's axes.

The step is the pipeline executor's (pp = 1 included: then it only orders the micro-batches of gradient
accumulation): for each Action of the schedule a chunk of layers runs forward or backward on one micro-batch,
receiving from and sending to the neighbouring stages. Inside a layer the block calls the tensor axis
(tensor.TensorParallel) at its conjugate points; the layer's weights come held or gathered over fsdp
(weights), its gradient is accumulated, reduce-scattered over fsdp as soon as it is whole (ZeRO-2/3, one
micro-batch) or after the last micro-batch, then all-reduced over cp and dp, and the optimizer (the run's,
on fp32 master weights under mixed precision) steps what this rank owns. With overlap (the default) the next
layer's gather and a finished layer's reduction run in the background, as Handles moved on at every point of
the tensor axis. Every array comes from the Arena by kind, so what a rank holds is known exactly (cost.py).
"""

from __future__ import annotations

import time

import numpy as np

from spmd.collectives import Workspace, all_gather, all_reduce, broadcast
from spmd.collectives.handle import Handle, run
from spmd.collectives.ring import (
    REDUCTION_BUFFERS,
    all_reduce_steps,
    reduce_scatter_steps,
    start_all_gather,
)
from spmd.collectives.tags import Tag, pipe_tag
from spmd.model import kernels
from spmd.model.blocks import Block, take
from spmd.model.config import Net
from spmd.model.kernels import Arena
from spmd.model.optimizers import STATE
from spmd.parallel.block import block_for
from spmd.parallel.cost import reduction_sizes, separate_grad_workspace
from spmd.parallel.layout import Layout
from spmd.parallel.schedules import executor_slots, order, stage_of
from spmd.parallel.tensor import TensorParallel
from spmd.transport.clock import traced
from spmd.transport.comm import Request
from spmd.transport.group import Group


def group_or_none(world: Group, layout: Layout, axis: str) -> Group | None:
    """The rank's group on `axis`, or None when the mesh leaves the axis out or it has one rank."""
    if axis not in layout.dims.mesh.names or layout.dims.size(axis) == 1:
        return None
    return layout.dims.mesh.group(world, axis)


class ComposedRank:
    """A rank's model state and step. `busy`: seconds of compute in the last step (the pipeline's bubble)."""

    def __init__(self, world: Group, layout: Layout, net: Net):
        self.world, self.layout, self.net = world, layout, net
        self.rank = world.rank
        self.policy = net.policy
        self.arena, self.workspace = Arena(self.policy.dtypes()), Workspace()
        # the gradients' reductions: a workspace of their own when their dtype differs, or when they run in the
        # background (overlap) while the tensor axis reduces activations
        self.overlap = layout.overlap
        self.grad_workspace = self.workspace if not separate_grad_workspace(layout, net) else Workspace()
        self.busy, self.steps_done = 0.0, 0
        get = lambda axis: group_or_none(world, layout, axis)  # noqa: E731
        self.pp, self.dp, self.fsdp, self.cp = get("pp"), get("dp"), get("fsdp"), get("cp")
        self.tp = TensorParallel(get("tp"), layout.sp, self.workspace)
        self.tp.tick = self.progress  # the tensor axis's points: where the background collectives move on
        self.prefetch: tuple[int, Handle, int] | None = None  # (local layer, its all-gather, buffer)
        self.reducing: Handle | None = None  # one layer's gradient reduction in the background
        self.reduced: set[int] = set()  # layers whose gradients were reduced in the background this step
        self.sharding = layout.sharding
        self.block: Block = block_for(net, layout, self.rank, self.tp.sp, self.cp)
        self.full_recompute = layout.recompute == "full"
        p, r, v, m = layout.dims.size("pp"), layout.dims.coord("pp", self.rank), net.chunks, net.microbatches
        self.chunks = layout.chunks(net, self.rank)
        # per micro-batch: the global rows this rank holds, in its order, and their sizes, fixed for the run
        self.pieces = [layout.pieces(net, self.rank, k) for k in range(m)]
        self.rows = [layout.rows(net, self.rank, k) for k in range(m)]
        self.layers = [layer for chunk in self.chunks for layer in chunk]
        self.first = [sum(map(len, self.chunks[:c])) for c in range(v)]
        self.order = order(layout.schedule, p, m, r, v)
        # each chunk's last backward in the step: where its layers' gradients are whole
        self.last_backward = {a.chunk: index for index, a in enumerate(self.order) if a.op == "B"}
        self.stages, self.stage_rank = p, r
        self._allocate(executor_slots(layout.schedule, p, m, v)[r])
        index = layout.tensor_index(net, self.rank)  # not kept: a layer's worth of int64
        lo, hi = self.shard
        for i, layer in enumerate(self.layers):
            mine = net.initial_layer(layer)[index]
            self.params[i] = mine[lo:hi] if self.sharding.params else mine  # cast to the compute dtype
            if self.master is not None:  # the fp32 values themselves, of the part this rank updates
                self.master[i] = mine[lo:hi] if self.sharding.optimizer else mine

    def _allocate(self, slots: int) -> None:
        net, take_ = self.net, self.arena.take
        n, width, h = len(self.layers), self.block.size, net.hidden
        self.shard, self.counts = self.layout.shard(net, self.rank)
        shard = self.shard[1] - self.shard[0]
        s = self.sharding
        self.grads_sharded = s.grads and net.microbatches == 1  # reduced as each layer's gradient is whole
        self.params = take_("params", (n, shard if s.params else width))
        # one gathered layer at a time (two with overlap: the next arriving), or (no reshard after forward)
        # every layer, kept for the step
        gathered = (2 if self.overlap else 1, width) if s.reshard_after_forward else (n, width)
        self.gathered = take_("params", gathered) if s.params and self.fsdp is not None else None
        self.whole: set[int] = set()  # without resharding: the layers gathered this step
        self.grads = take_("grads", (n, shard if self.grads_sharded else width))
        # a layer's gradient before it is reduced (two with overlap: one reducing, the next being computed),
        # or accumulated over micro-batches
        reduced_ahead = 2 if self.grads_sharded and self.overlap and self.fsdp is not None else 1
        self.layer_grad = take_("grads", (reduced_ahead, width)) if self.grads_sharded or net.microbatches > 1 \
            else None
        self.grad_slot = 0
        part = shard if s.optimizer else width  # what this rank's optimizer updates of a layer
        self.master = take_("master", (n, part)) if self.policy.mixed else None
        self.state = [take_("optimizer", (n, part)) for _ in STATE[net.optimizer]]
        self.update_scratch = take_("buffers", (part,), self.policy.state) if net.optimizer == "adamw" else None
        rows = self.layout.largest_rows(net, self.rank)
        depth = max(map(len, self.chunks))
        self.slot_x = [[take_("activations", (rows.local, h)) for _ in range(depth + 1)] for _ in range(slots)]
        saved = lambda: take(self.arena, "activations", self.block.saved_shapes(rows))  # noqa: E731
        if self.full_recompute:  # one layer's kept arrays, refilled by the forward each backward reruns
            shared = saved()
            self.slot_saved = [[shared] * depth for _ in range(slots)]
        else:
            self.slot_saved = [[saved() for _ in range(depth)] for _ in range(slots)]
        shapes = self.block.scratch_shapes(rows)
        if self.full_recompute:
            shapes["rerun"] = (rows.local, h)  # the rerun forward's output, not needed
        self.full_scratch = take(self.arena, "buffers", shapes)
        self.block.prepare(self.full_scratch)
        for workspace, dtype, largest in reduction_workspaces(self.layout, net, self.rank, self.workspace,
                                                              self.grad_workspace):
            for name in REDUCTION_BUFFERS:
                workspace.array(name, (largest,), dtype)
            self.arena.bytes["buffers"] += len(REDUCTION_BUFFERS) * largest * dtype.itemsize
        self.written: set[int] = set()

    # --- the parts the step calls ---------------------------------------------------------------------------

    def weights(self, i: int, upcoming: int | None = None) -> np.ndarray:
        """Local layer i's whole weights; with overlap, start gathering layer `upcoming` behind them."""
        if self.gathered is None:  # held whole, or sharded over one rank
            return self.params[i]
        assert self.fsdp is not None
        if self.sharding.reshard_after_forward:
            if self.prefetch is not None and self.prefetch[0] == i:
                _, handle, b = self.prefetch
                handle.wait()
            else:
                self.finish_prefetch()
                b = 0
                all_gather(self.fsdp, self.params[i], self.counts, out=self.gathered[b])
            self.prefetch = None
            if self.overlap and upcoming is not None:
                self.prefetch = (upcoming, start_all_gather(self.fsdp, self.params[upcoming], self.counts,
                                                            out=self.gathered[1 - b]), 1 - b)
            return self.gathered[b]
        if i not in self.whole:
            all_gather(self.fsdp, self.params[i], self.counts, out=self.gathered[i])
            self.whole.add(i)
        return self.gathered[i]

    def finish_prefetch(self) -> None:
        if self.prefetch is not None:
            self.prefetch[1].wait()
            self.prefetch = None

    def finish_reducing(self) -> None:
        if self.reducing is not None:
            self.reducing.wait()
            self.reducing = None

    def progress(self) -> None:
        """Move the background collectives on (called at the tensor axis's points inside every layer)."""
        for handle in (self.prefetch[1] if self.prefetch is not None else None, self.reducing):
            if handle is not None:
                handle.progress()

    def grad_buffer(self, i: int) -> np.ndarray:
        if i in self.written or self.grads_sharded:
            assert self.layer_grad is not None
            return self.layer_grad[self.grad_slot]
        return self.grads[i]

    def grad_ready(self, i: int, final: bool) -> None:
        """Local layer i's backward is done (`final`: its last this step): reduce what is whole. With overlap
        in the background (one layer at a time: the previous one is finished first); blocking, only where
        the layer-gradient buffer must be freed (ZeRO-2/3), the rest after the backward (in update)."""
        whole = None  # ZeRO-2/3 with one micro-batch: the layer's whole gradient, reduce-scattered to the shard
        if self.grads_sharded:
            assert self.layer_grad is not None
            whole = self.layer_grad[self.grad_slot]
            if self.fsdp is None:  # a shard of one rank: the whole
                self.grads[i][...], whole = whole, None
        elif i in self.written:
            assert self.layer_grad is not None
            np.add(self.grads[i], self.layer_grad[0], out=self.grads[i])
        self.written.add(i)
        if not final:
            return
        if self.overlap:
            self.finish_reducing()
            self.reducing = Handle(self.reduce_steps(i, whole))
            self.reduced.add(i)
            if self.layer_grad is not None:  # the next layer's gradient goes to the other buffer, if two
                self.grad_slot = (self.grad_slot + 1) % len(self.layer_grad)
        elif whole is not None:  # the next layer's gradient needs the buffer: scatter now, the rest in update
            run(self.scatter_steps(i, whole))

    def optimizer_grad(self, i: int) -> np.ndarray:
        """The part of local layer i's gradient the optimizer takes (its fsdp shard, or all of it)."""
        lo, hi = self.shard
        grad = self.grads[i]
        return grad[lo:hi] if self.sharding.optimizer and not self.grads_sharded else grad

    def reduce_steps(self, i: int, whole: np.ndarray | None = None):
        """Local layer i's gradient reduced, as collective steps: scattered over fsdp, then summed across."""
        yield from self.scatter_steps(i, whole)
        yield from self.across_steps(i)

    def scatter_steps(self, i: int, whole: np.ndarray | None):
        """Layer i's gradient reduce-scattered over fsdp to this rank's shard: from `whole`, the layer-gradient
        buffer, under ZeRO-2/3; in place under ZeRO-1 or several micro-batches; nothing without fsdp."""
        lo, hi = self.shard
        grad = self.grads[i]
        if whole is not None:
            assert self.fsdp is not None
            yield from reduce_scatter_steps(self.fsdp, whole, Tag.REDUCE_SCATTER, self.grad_workspace, grad)
        elif self.sharding.optimizer and not self.grads_sharded and self.fsdp is not None:
            yield from reduce_scatter_steps(self.fsdp, grad, Tag.REDUCE_SCATTER, self.grad_workspace, grad[lo:hi])

    def across_steps(self, i: int):
        """Layer i's (shard of its) gradient all-reduced over cp and dp: the other tokens' and sequences' share."""
        part = self.optimizer_grad(i)
        for group in (self.cp, self.dp):
            if group is not None:
                yield from all_reduce_steps(group, part, self.grad_workspace, part)

    def own(self, i: int) -> np.ndarray:
        """The part of local layer i this rank's optimizer updates: its shard, unless the layer is replicated."""
        if self.sharding.params or not self.sharding.optimizer:
            return self.params[i]
        lo, hi = self.shard
        return self.params[i][lo:hi]

    def update(self) -> None:
        net = self.net
        self.steps_done += 1
        self.finish_prefetch()
        self.finish_reducing()
        for i in range(len(self.layers)):
            if i not in self.reduced:
                run(self.reduce_steps(i))
            grad = self.optimizer_grad(i)
            mine = self.own(i)
            stepped = mine if self.master is None else self.master[i]  # mixed: the fp32 master, then cast
            with traced(self.world, "update"):
                if net.optimizer == "adamw":
                    assert self.update_scratch is not None
                    m, v = (state[i] for state in self.state)
                    net.adamw.step(stepped, grad, m, v, self.update_scratch, self.steps_done)
                else:
                    kernels.sgd(stepped, grad, self.state[0][i], net.rate, net.momentum)
                if self.master is not None:
                    np.copyto(mine, self.master[i], casting="same_kind")
            if self.sharding.optimizer and not self.sharding.params and self.fsdp is not None:
                all_gather(self.fsdp, mine, self.counts, out=self.params[i])

    def total_loss(self, loss: float) -> float:
        """The step's loss over every token: summed over the rows' owners (SP's tp, fsdp, dp), then from the
        last pipeline stage to every stage."""
        value = np.array([loss], dtype=self.policy.state)  # fp32 under mixed precision; a 1-element reduction's
        # own scratch
        groups = [self.tp.group if self.tp.sp else None, self.cp, self.fsdp, self.dp]
        for group in groups:
            if group is not None:
                all_reduce(group, value, out=value)
        if self.pp is not None:
            last = self.pp.size - 1
            value = broadcast(self.pp, value if self.pp.rank == last else None, root=last)
        return float(value[0])

    # --- the step --------------------------------------------------------------------------------------------

    def bind(self, slot: int, k: int, chunk: int):
        """(activations, kept arrays, scratch) of `slot` for micro-batch k's rows; the two lists are indexed by
        local layer, so chunk c's layer first[c] + j sees the slot's j-th arrays."""
        rows = self.rows[k]
        self.tp.bind_rows(rows.matmul)
        pad, depth = [None] * self.first[chunk], len(self.chunks[chunk])
        xs = pad + [b[:rows.local] for b in self.slot_x[slot][:depth + 1]]
        saved = pad + [b.cut(rows, self.block.saved_rows) for b in self.slot_saved[slot][:depth]]
        return xs, saved, self.full_scratch.cut(rows, {**self.block.scratch_rows, "rerun": "local"})

    def step(self, x: np.ndarray, target: np.ndarray) -> float:
        p, v = self.stages, self.net.chunks
        g = self.pp if self.pp is not None else self.world  # with one stage nothing is sent (layout.check)
        prev, succ, last_stage = (self.stage_rank - 1) % p, (self.stage_rank + 1) % p, p * v - 1
        free = list(range(len(self.slot_x)))
        slot_of: dict[tuple[int, int], int] = {}
        sending: dict[int, Request] = {}
        loss, self.busy = 0.0, 0.0
        self.written.clear()
        self.whole.clear()
        self.reduced.clear()
        for index, a in enumerate(self.order):
            c, k = a.chunk, a.microbatch
            s = stage_of(self.stage_rank, c, p)
            local = range(self.first[c], self.first[c] + len(self.chunks[c]))
            if a.op == "F":
                slot = slot_of[(c, k)] = free.pop(0)
                if slot in sending:
                    sending.pop(slot).wait()
                xs, saved, scratch = self.bind(slot, k, c)
                if s == 0:
                    copy_rows(x, self.pieces[k], xs[local.start])
                else:
                    g.irecv(prev, pipe_tag(False, k, (s - 1) // p, v), xs[local.start]).wait()
                started = time.perf_counter()
                for i in local:
                    w = self.weights(i, i + 1 if i + 1 < local.stop else None)
                    with traced(self.world, f"F layer {self.layers[i]}"):
                        self.block.forward(self.tp, w, xs[i], xs[i + 1], saved[i], scratch)
                if s == last_stage:
                    loss += loss_of_rows(xs[local.stop], target, self.pieces[k])
                self.busy += time.perf_counter() - started
                if s < last_stage:
                    sending[slot] = g.isend(succ, xs[local.stop], pipe_tag(False, k, s // p, v))
            else:
                slot = slot_of.pop((c, k))
                xs, saved, scratch = self.bind(slot, k, c)
                out = xs[local.stop]
                if s < last_stage:
                    sending.pop(slot).wait()
                    g.irecv(succ, pipe_tag(True, k, s // p, v), out).wait()
                started = time.perf_counter()
                final = index == self.last_backward[c]
                for i in reversed(local):
                    w = self.weights(i, i - 1 if i > local.start else None)
                    with traced(self.world, f"B layer {self.layers[i]}"):
                        if self.full_recompute:  # the layer's forward again, from its kept input
                            self.block.forward(self.tp, w, xs[i], scratch.rerun, saved[i], scratch)
                        self.block.backward(self.tp, w, self.grad_buffer(i), xs[i], out, saved[i], scratch)
                    self.grad_ready(i, final)
                self.busy += time.perf_counter() - started
                if s > 0:
                    sending[slot] = g.isend(prev, out, pipe_tag(True, k, (s - 1) // p, v))
                free.append(slot)
        for request in sending.values():
            request.wait()
        self.update()
        return self.total_loss(loss)

    def owned(self) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """(layer, indices into the full flat layer, values) of every parameter this rank keeps up to date (under
        mixed precision its fp32 master values)."""
        index = self.layout.tensor_index(self.net, self.rank)
        lo, hi = self.shard
        mine = index[lo:hi] if self.sharding.optimizer else index  # ZeRO-3 shards the optimizer too
        values = self.own if self.master is None else self.master.__getitem__  # mixed: the fp32 master
        return [(layer, mine, values(i)) for i, layer in enumerate(self.layers)]


def copy_rows(x: np.ndarray, pieces: list[tuple[int, int]], out: np.ndarray) -> None:
    """out = the rows `pieces` of x, one after another (no temporary: each piece a slice)."""
    at = 0
    for lo, hi in pieces:
        out[at:at + hi - lo] = x[lo:hi]
        at += hi - lo


def loss_of_rows(y: np.ndarray, target: np.ndarray, pieces: list[tuple[int, int]]) -> float:
    """kernels.loss_grad over rows held in pieces: y becomes y - target; returns the loss of these rows."""
    loss, at = 0.0, 0
    for lo, hi in pieces:
        loss += kernels.loss_grad(y[at:at + hi - lo], target[lo:hi])
        at += hi - lo
    return loss


def reduction_workspaces(layout: Layout, net: Net, rank: int, workspace: Workspace, grad_workspace: Workspace):
    """(workspace, dtype, largest chunk) of each reduction workspace the rank keeps: one when activations and
    gradients share a dtype, else one each (cost.reduction_sizes says how large)."""
    act, grad = reduction_sizes(layout, net, rank)
    policy = net.policy
    if workspace is grad_workspace:
        largest = max(act, grad)
        return [(workspace, policy.compute, largest)] if largest else []
    return [(w, dtype, size) for w, dtype, size in ((workspace, policy.compute, act),
                                                    (grad_workspace, policy.reduce, grad)) if size]
