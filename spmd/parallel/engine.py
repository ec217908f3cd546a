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
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from spmd.collectives import Workspace, all_reduce, broadcast
from spmd.collectives.handle import Handle, run
from spmd.collectives.ring import REDUCTION_BUFFERS, all_gather_steps, all_reduce_steps, reduce_scatter_steps
from spmd.collectives.tags import Tag, pipe_tag
from spmd.layout import largest_block
from spmd.model import kernels
from spmd.model.blocks import BLOCK_KINDS, EXPERT_KIND, take
from spmd.model.config import Net
from spmd.model.kernels import Arena
from spmd.model.registry import spec_of
from spmd.model.weight_grads import WeightGrads, replay
from spmd.parallel.block import block_positions, blocks_for, merged_scratch, stash_sizes
from spmd.parallel.layout import Layout
from spmd.parallel.pipeline_sim import executor_slots, stashed
from spmd.parallel.schedules import order, rank_of, schedule_named, stage_of
from spmd.parallel.state import allocate_state, optimizer_parts
from spmd.parallel.tensor import TensorParallel
from spmd.stopwatch import part
from spmd.transport.clock import traced
from spmd.transport.comm import Request
from spmd.transport.group import Group


@dataclass(frozen=True)
class At:
    """Where an action of the schedule runs: its index in the rank's order, chunk, micro-batch, global stage, and
    the chunk's local units."""

    index: int
    chunk: int
    microbatch: int
    stage: int
    local: range


@dataclass
class StepRun:
    """The executor's bookkeeping through one step: the batch, the free slots and stashes, which micro-batch holds
    which, the sends in flight (by slot), the loss so far."""

    x: np.ndarray
    target: np.ndarray
    free: list[int]
    free_stashes: list[int]
    slot_of: dict[tuple[int, int], int] = field(default_factory=dict)  # (chunk, micro-batch) -> its slot
    stash_of: dict[tuple[int, int], int] = field(default_factory=dict)
    sending: dict[int, Request] = field(default_factory=dict)
    loss: float = 0.0


Action = Callable[[StepRun, str, At], float]  # runs one action; returns when its compute started


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
        self.spec = spec_of(net)
        self.rows_in = not self.spec.loss_unit(net)  # the dense models: rows in, a squared error out
        self.arena, self.workspace = Arena(self.policy.dtypes()), Workspace()
        self.overlap = layout.overlap
        self.busy = 0.0
        self.op_seconds = dict.fromkeys("FBIW", 0.0)  # the last step's seconds in each kind of action
        self._join_groups()
        self.prefetch: tuple[int, Handle, int] | None = None  # (local unit, its all-gather, buffer)
        self.reducing: Handle | None = None  # one unit's gradient reduction in the background
        self.reduced: set[int] = set()  # units whose gradients were reduced in the background this step
        self.sharding = layout.sharding
        self.plan = layout.for_rank(net, self.rank)
        self.blocks = blocks_for(net, layout, self.plan, self.tp.sp, self.cp, self.ep)  # one Block a kind of unit
        moe = self.blocks.get(EXPERT_KIND)
        self.experts = moe.moe_layer if moe is not None else None  # a mixture of experts' layer (spmd.model.moe)
        self.full_recompute = layout.recompute == "full"
        self._place_microbatches()
        self._follow_schedule()
        p, r, m, v = self.stages, self.stage_rank, net.microbatches, net.chunks
        self._allocate(
            executor_slots(layout.schedule, p, m, v)[r], stashed(layout.schedule, p, m, r, v) if any(self.defers) else 0
        )
        self.counted = self._counted_runs() if net.clip_grad > 0 else []
        self._initialize()
        # the executor's table: what each kind of action of the schedule does
        self.actions: dict[str, Action] = {
            "F": self.forward_action,
            "B": self.backward_action,
            "I": self.backward_action,
            "W": self.weights_action,
        }

    def _join_groups(self) -> None:
        """The rank's group on every axis of the mesh (None where it has one rank), and the workspace the
        gradients' reductions use: their own when their dtype differs, or when they run in the background
        (overlap) while the tensor axis reduces activations."""
        get = lambda axis: group_or_none(self.world, self.layout, axis)  # noqa: E731
        self.pp, self.dp, self.fsdp, self.ep, self.cp = get("pp"), get("dp"), get("fsdp"), get("ep"), get("cp")
        self.tp = TensorParallel(get("tp"), self.layout.sp, self.workspace)
        self.tp.tick = self.progress  # the tensor axis's points: where the background collectives move on
        separate = self.policy.reduce != self.policy.compute or (self.overlap and self.tp.group is not None)
        self.grad_workspace = Workspace() if separate else self.workspace

    def _place_microbatches(self) -> None:
        """Per micro-batch: the global rows this rank holds, in its order, and their sizes, fixed for the run; and
        the rows its matmuls see (its tp group's, in order: token ids, targets and positions are theirs). The
        units it holds, chunk after chunk."""
        layout, net, m = self.layout, self.net, self.net.microbatches
        self.pieces = [layout.pieces(net, self.rank, k) for k in range(m)]
        self.matmul_pieces = [layout.pieces(net, self.rank, k, split=False) for k in range(m)]
        self.rows = self.plan.rows
        self.units = self.plan.units  # a unit this rank holds: its kind, size (tensor slice), fsdp shard, ep sum
        self.layers = [u.unit for u in self.units]  # the global units this rank holds
        self.kinds = self.plan.kinds
        self.chunks = self.plan.chunks
        self.first = [sum(map(len, self.chunks[:c])) for c in range(self.net.chunks)]

    def _follow_schedule(self) -> None:
        """The rank's actions in the step, and where each chunk's units' gradients are whole."""
        layout, net = self.layout, self.net
        p, r = layout.dims.size("pp"), layout.dims.coord("pp", self.rank)
        self.stages, self.stage_rank = p, r
        self.order = order(layout.schedule, p, net.microbatches, r, net.chunks)
        schedule = schedule_named(layout.schedule)
        self.placement = schedule.placement
        # the units whose weight gradients wait for the W action (split schedules), each given this rank's recorder
        self.wg = WeightGrads()
        for block in self.blocks.values():
            if schedule.split and block.defers:
                block.wg = self.wg
        self.defers = [schedule.split and self.blocks[kind].defers for kind in self.kinds]
        # each chunk's last backward (B or I) and last W in the step: where its units' gradients are whole
        # (a unit that defers is whole after the chunk's last B or W, one that does not after its last B or I: a
        # schedule may mix whole backwards and split ones, DualPipeV)
        self.last_backward = {a.chunk: index for index, a in enumerate(self.order) if a.op in ("B", "I")}
        self.last_weights = {a.chunk: index for index, a in enumerate(self.order) if a.op in ("B", "W")}
        self.deferred: dict[tuple[int, int], dict] = {}  # (chunk, micro-batch) -> local unit -> its writes

    def _initialize(self) -> None:
        """Every unit's initial values, this rank's part of them (the fp32 master too under mixed precision)."""
        state = self.state
        for i, unit in enumerate(self.layers):
            mine = self.net.initial_layer(unit)[self.layout.tensor_index(self.net, self.rank, unit)]  # not kept
            shard = self.units[i].take(mine)
            state.params[i][...] = shard if self.sharding.params else mine  # cast to the compute dtype
            if state.master is not None:  # the fp32 values themselves, of the part this rank updates
                state.master[i][...] = shard if self.sharding.optimizer else mine

    def indices(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(held, updated): the indices into the full flat unit of local unit i's parameters as this rank holds
        them, and of the part its optimizer updates (master weights, optimizer state)."""
        index = self.layout.tensor_index(self.net, self.rank, self.layers[i])
        shard = self.units[i].take(index)
        return shard if self.sharding.params else index, shard if self.sharding.optimizer else index

    def _allocate(self, slots: int, stashes: int) -> None:
        """Every array of the rank, from the arena by kind: the state, the update's and tied weights' buffers,
        the executor's slots and stashes, the units' scratch and the reductions' workspaces."""
        s, n = self.sharding, self.net
        self.grads_sharded = s.grads and n.microbatches == 1  # reduced as each unit's gradient is whole
        gathers = (2 if self.overlap else 1) if s.params and self.fsdp is not None else 0
        # with overlap one unit's gradient reducing while the next one's is computed
        reduced_ahead = 2 if self.grads_sharded and self.overlap and self.fsdp is not None else 1
        unit_grads = reduced_ahead if self.grads_sharded or n.microbatches > 1 else 0
        self.state = allocate_state(self.arena, self.plan, s, n, self.grads_sharded, gathers, unit_grads)
        self.whole: set[int] = set()  # without resharding: the units gathered this step
        self.grad_slot = 0
        parts = optimizer_parts(self.plan, s)
        take_ = self.arena.take
        self.update_scratch = take_("buffers", (max(parts),), self.policy.state) if n.optimizer == "adamw" else None
        self.tied = self._tied_partners()
        exchanged = [parts[i] for i, _, partner in self.tied if partner is not None]
        self.tied_buffer = take_("buffers", (max(exchanged),), self.policy.reduce) if exchanged else None
        self._allocate_slots(slots, stashes)
        self._allocate_scratch()
        self.written: set[int] = set()

    def _allocate_slots(self, slots: int, stashes: int) -> None:
        """The executor's slots (a micro-batch's activations between its forward and backward) and, under a
        split schedule, its stashes."""
        rows, h = self.plan.largest_rows, self.net.hidden
        depth = max(map(len, self.chunks))
        positions = block_positions(self.chunks, self.kinds)
        self.slot_x = [
            [self.arena.take("activations", (rows.local, h)) for _ in range(depth + 1)] for _ in range(slots)
        ]

        def kept(kind):
            return take(self.arena, "activations", self.blocks[kind].saved_shapes(rows), self.blocks[kind].dtypes)

        # per slot, per layer position in a chunk, the kept arrays of each kind of layer found there (dense or
        # mixture of experts); under full recomputation one layer's of each kind, refilled by each rerun forward
        if self.full_recompute:
            shared = {kind: kept(kind) for kind in self.blocks if kind in BLOCK_KINDS}
            self.slot_saved: list[list] = [[shared] * len(positions) for _ in range(slots)]
        else:
            self.slot_saved = [[{kind: kept(kind) for kind in kinds} for kinds in positions] for _ in range(slots)]
        # the other units (embedding, final norm, head) keep theirs per slot, whatever is recomputed
        self.slot_ends = [{kind: kept(kind) for kind in self.blocks if kind not in BLOCK_KINDS} for _ in range(slots)]
        # split schedules: what a micro-batch's deferred weight gradients need from its I to its W (products'
        # operands in the compute dtype, gains' gradients in the gradient's), in stashes of their own: the slot is
        # free again after the I
        products, values = stash_sizes(self.blocks, self.chunks, self.kinds, rows) if stashes else (0, 0)
        self.stash = [
            (self.arena.take("activations", (products,)), self.arena.take("activations", (values,), self.policy.reduce))
            for _ in range(stashes)
        ]

    def _allocate_scratch(self) -> None:
        """The scratch the rank's units share, and the reductions' workspaces (counted as buffers)."""
        rows = self.plan.largest_rows
        shapes, dtypes, self.scratch_rows = merged_scratch(self.blocks.values(), rows)
        if self.full_recompute:
            shapes["rerun"] = (rows.local, self.net.hidden)  # the rerun forward's output, not needed
        self.full_scratch = take(self.arena, "buffers", shapes, dtypes)
        for block in self.blocks.values():
            block.prepare(self.full_scratch)
        for workspace, dtype, largest in self._reduction_workspaces():
            for name in REDUCTION_BUFFERS:
                workspace.array(name, (largest,), dtype)
            self.arena.bytes["buffers"] += len(REDUCTION_BUFFERS) * largest * dtype.itemsize

    def _reduction_workspaces(self) -> list[tuple[Workspace, np.dtype, int]]:
        """(workspace, dtype, largest chunk) of each reduction workspace the rank keeps: one when activations and
        gradients share it, else one each."""
        act, grad = self._reduction_chunks()
        compute, reduce = self.policy.compute, self.policy.reduce
        if self.workspace is self.grad_workspace:
            largest = max(act, grad)
            return [(self.workspace, compute, largest)] if largest else []
        both = ((self.workspace, compute, act), (self.grad_workspace, reduce, grad))
        return [(w, dtype, size) for w, dtype, size in both if size]

    def _reduction_chunks(self) -> tuple[int, int]:
        """The largest chunk a ring reduction of this rank handles (0: none), from the arrays it reduces: of
        activations, the tensor axis's partial rows (split by rows under SP, flat otherwise); of gradients, each
        unit's pieces over fsdp (to its shard), its optimizer part over cp and dp, its dense prefix over
        ep. (A gain's gradient over SP and the loss have scratch of their own.)"""

        def chunk(n: int, group: Group | None) -> int:
            return largest_block(n, group.size) if group is not None else 0

        rows, h, tp = self.plan.largest_rows, self.net.hidden, self.tp.group
        act = chunk(rows.matmul, tp) * h if self.tp.sp else chunk(rows.matmul * h, tp)
        grad = [0]
        for u, q in zip(self.units, optimizer_parts(self.plan, self.sharding), strict=True):
            if self.sharding.optimizer:  # each piece's run over fsdp (FSDP over ep: each fsdp block, smaller)
                grad += [chunk(piece.stop - piece.start, self.fsdp) for piece in u.pieces]
            grad += [chunk(q, self.cp), chunk(q, self.dp), chunk(u.ep_summed, self.ep)]
        return act, max(grad)

    def _tied_partners(self) -> list[tuple[int, int | None, int | None]]:
        """Per tied weight this rank holds a copy of: (local unit, the other copy's local unit or None, the pp
        rank holding the other copy or None). The copies' gradients are summed before the optimizer."""
        local = {unit: i for i, unit in enumerate(self.layers)}
        tied: list[tuple[int, int | None, int | None]] = []
        for a, b in self.spec.tied(self.net):
            here = [u for u in (a, b) if u in local]
            if len(here) == 2:
                tied.append((local[a], local[b], None))
            elif here:
                assert self.pp is not None
                partner = self.pp.size - 1 if here[0] == a else 0
                tied.append((local[here[0]], None, partner))
        return tied

    def _counted_runs(self) -> list[list[tuple[int, int]]]:
        """Per local unit, the runs of its optimizer part this rank counts in the global gradient norm: nothing on
        a dp or cp replica, nor of a tied weight's second copy; of a value every tp rank holds, tp rank 0's."""
        dims, net = self.layout.dims, self.net
        if dims.coord("dp", self.rank) or dims.coord("cp", self.rank):
            return [[] for _ in self.layers]
        seconds = {b for _, b in self.spec.tied(net)}
        runs: list[list[tuple[int, int]]] = []
        for i, unit in enumerate(self.layers):
            if unit in seconds:
                runs.append([])
                continue
            index = self.layout.tensor_index(net, self.rank, unit)
            part = self.units[i].take(index) if self.sharding.optimizer else index
            mine = self.layout.first_holder(net, self.rank, unit, part)
            edges = np.flatnonzero(np.diff(np.concatenate([[0], mine.astype(np.int8), [0]])))
            runs.append([(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True)])
        return runs

    # --- the parts the step calls ---------------------------------------------------------------------------

    def weights(self, i: int, upcoming: int | None = None) -> np.ndarray:
        """Local unit i's whole weights; with overlap, start gathering unit `upcoming` behind them."""
        if self.state.gathered is None:  # held whole, or sharded over one rank
            return self.state.params[i]
        assert self.fsdp is not None
        if self.sharding.reshard_after_forward:
            if self.prefetch is not None and self.prefetch[0] == i:
                _, handle, b = self.prefetch
                handle.wait()
            else:
                self.finish_prefetch()
                b = 0
                run(self.gather_steps(i, self.state.params[i], self.state.gathered[b][: self.units[i].size]))
            self.prefetch = None
            if self.overlap and upcoming is not None:
                buffer = self.state.gathered[1 - b][: self.units[upcoming].size]
                self.prefetch = (
                    upcoming,
                    Handle(self.gather_steps(upcoming, self.state.params[upcoming], buffer)),
                    1 - b,
                )
            return self.state.gathered[b][: self.units[i].size]
        if i not in self.whole:
            run(self.gather_steps(i, self.state.params[i], self.state.gathered[i]))
            self.whole.add(i)
        return self.state.gathered[i]

    def gather_steps(self, i: int, shard: np.ndarray, out: np.ndarray):
        """Local unit i whole into `out` from this rank's shard, as collective steps: each piece's fsdp block
        gathered over ep first (FSDP over ep), then the blocks over fsdp."""
        assert self.fsdp is not None
        at = 0
        for piece in self.units[i].pieces:
            n = piece.shard[1] - piece.shard[0]
            mine, at = shard[at : at + n], at + n
            if piece.ep:
                assert self.ep is not None
                block = out[piece.block[0] : piece.block[1]]
                yield from all_gather_steps(self.ep, mine, piece.ep, block, Tag.ALL_GATHER)
                mine = block
            yield from all_gather_steps(self.fsdp, mine, piece.fsdp, out[piece.start : piece.stop], Tag.ALL_GATHER)

    def finish_prefetch(self) -> None:
        if self.prefetch is not None:
            self.prefetch[1].wait()
            self.prefetch = None

    def finish_reducing(self) -> None:
        if self.reducing is not None:
            self.reducing.wait()
            self.reducing = None

    def progress(self) -> None:
        """Move the background collectives on (called at the tensor axis's points inside every unit)."""
        for handle in (self.prefetch[1] if self.prefetch is not None else None, self.reducing):
            if handle is not None:
                handle.progress()

    def grad_buffer(self, i: int) -> np.ndarray:
        if i in self.written or self.grads_sharded:
            assert self.state.layer_grad is not None
            return self.state.layer_grad[self.grad_slot][: self.units[i].size]
        return self.state.grads[i]

    def grad_ready(self, i: int, final: bool) -> None:
        """Local unit i's backward is done (`final`: its last this step): reduce what is whole. With overlap
        in the background (one unit at a time: the previous one is finished first); blocking, only where
        the unit-gradient buffer must be freed (ZeRO-2/3), the rest after the backward (in update)."""
        whole = None  # ZeRO-2/3 with one micro-batch: the unit's whole gradient, reduce-scattered to the shard
        if self.grads_sharded:
            assert self.state.layer_grad is not None
            whole = self.state.layer_grad[self.grad_slot][: self.units[i].size]
            if self.fsdp is None:  # a shard of one rank: the whole
                self.state.grads[i][...], whole = whole, None
        elif i in self.written:
            assert self.state.layer_grad is not None
            np.add(self.state.grads[i], self.state.layer_grad[0][: self.units[i].size], out=self.state.grads[i])
        self.written.add(i)
        if not final:
            return
        if self.overlap:
            self.finish_reducing()
            self.reducing = Handle(self.reduce_steps(i, whole))
            self.reduced.add(i)
            if self.state.layer_grad is not None:  # the next unit's gradient goes to the other buffer, if two
                self.grad_slot = (self.grad_slot + 1) % len(self.state.layer_grad)
        elif whole is not None:  # the next unit's gradient needs the buffer: scatter now, the rest in update
            run(self.scatter_steps(i, whole))

    def optimizer_grad(self, i: int) -> np.ndarray:
        """The part of local unit i's gradient the optimizer takes (its fsdp shard, or all of it)."""
        lo, hi = self.units[i].reduced_at
        grad = self.state.grads[i]
        return grad[lo:hi] if self.sharding.optimizer and not self.grads_sharded else grad

    def reduce_steps(self, i: int, whole: np.ndarray | None = None):
        """Local unit i's gradient reduced, as collective steps: scattered over fsdp, then summed across."""
        yield from self.scatter_steps(i, whole)
        yield from self.across_steps(i)

    def scatter_steps(self, i: int, whole: np.ndarray | None):
        """Unit i's gradient reduce-scattered over fsdp to this rank's shard: from `whole`, the unit-gradient
        buffer, under ZeRO-2/3; in place under ZeRO-1 or several micro-batches (several pieces' shards then
        moved to the front); nothing without fsdp."""
        grad, unit = self.state.grads[i], self.units[i]
        if whole is not None:
            at = 0
            for piece in unit.pieces:
                n = piece.shard[1] - piece.shard[0]
                yield from self.piece_scatter_steps(piece, whole, grad[at : at + n])
                at += n
        elif self.sharding.optimizer and not self.grads_sharded and self.fsdp is not None:
            for piece in unit.pieces:
                yield from self.piece_scatter_steps(piece, grad, grad[piece.shard[0] : piece.shard[1]])
            if len(unit.pieces) > 1:  # to the front, in order (each moves left: numpy copies overlaps safely)
                at = 0
                for piece in unit.pieces:
                    n = piece.shard[1] - piece.shard[0]
                    grad[at : at + n] = grad[piece.shard[0] : piece.shard[1]]
                    at += n

    def piece_scatter_steps(self, piece, grad: np.ndarray, out: np.ndarray):
        """One piece of a unit's gradient (its range of `grad`, whole-width) summed into `out`, this rank's shard
        of it: over fsdp, to the rank's block (in place, under FSDP over ep, then that block over ep)."""
        assert self.fsdp is not None
        whole = grad[piece.start : piece.stop]
        if not piece.ep:
            yield from reduce_scatter_steps(self.fsdp, whole, Tag.REDUCE_SCATTER, self.grad_workspace, out)
            return
        assert self.ep is not None
        block = grad[piece.block[0] : piece.block[1]]
        yield from reduce_scatter_steps(self.fsdp, whole, Tag.REDUCE_SCATTER, self.grad_workspace, block)
        yield from reduce_scatter_steps(self.ep, block, Tag.REDUCE_SCATTER, self.grad_workspace, out)

    def across_steps(self, i: int):
        """Unit i's (shard of its) gradient all-reduced over cp, ep and dp: the other tokens' and sequences'
        share; over ep only its dense part (ep rank e's experts saw every ep rank's tokens already), and nothing
        under FSDP over ep (reduce-scattered over ep instead)."""
        part = self.optimizer_grad(i)
        for group in (self.cp, self.ep, self.dp):
            mine = part[: self.units[i].ep_summed] if group is self.ep else part
            if group is not None and mine.size:  # (an fsdp shard of experts only: nothing over ep)
                yield from all_reduce_steps(group, mine, self.grad_workspace, mine)

    def own(self, i: int) -> np.ndarray:
        """The part of local unit i this rank's optimizer updates: its shard, unless the unit is replicated."""
        if self.sharding.params or not self.sharding.optimizer:
            return self.state.params[i]
        lo, hi = self.units[i].reduced_at  # (one piece: FSDP over ep is ZeRO-3's)
        return self.state.params[i][lo:hi]

    def sum_tied(self) -> None:
        """A tied weight's two copies take the sum of their gradients (first copy's + second's, on both: bitwise
        the same), after the data axes' reductions, before the optimizer; across stages by an exchange over pp."""
        for i, other, partner in self.tied:
            grad = self.optimizer_grad(i)
            if other is not None:
                np.add(grad, self.optimizer_grad(other), out=grad)
                np.copyto(self.optimizer_grad(other), grad)
                continue
            assert self.pp is not None and self.tied_buffer is not None and partner is not None
            theirs = self.tied_buffer[: grad.size]
            sending = self.pp.isend(partner, grad, Tag.TIED)
            self.pp.irecv(partner, Tag.TIED, theirs).wait()
            sending.wait()
            first, second = (grad, theirs) if self.stage_rank == 0 else (theirs, grad)
            np.add(first, second, out=grad)

    def clip(self) -> None:
        """The global gradient norm (every parameter counted once over the mesh: _counted_runs), all-reduced
        over the world; every gradient scaled by min(1, clip / (norm + 1e-6)) (torch's clip_grad_norm_)."""
        total = np.zeros(1, dtype=np.float64)
        for i, runs in enumerate(self.counted):
            grad = self.optimizer_grad(i)
            for lo, hi in runs:
                piece = grad[lo:hi].astype(np.float64, copy=False)
                total += np.dot(piece, piece)
        all_reduce(self.world, total, out=total)
        self.state.grad_norm = float(np.sqrt(total[0]))
        scale = min(1.0, self.net.clip_grad / (self.state.grad_norm + 1e-6))
        if scale < 1.0:
            for i in range(len(self.layers)):
                grad = self.optimizer_grad(i)
                np.multiply(grad, scale, out=grad)

    def update(self) -> None:
        net = self.net
        self.state.steps_done += 1
        self.finish_prefetch()
        self.finish_reducing()
        for i in range(len(self.layers)):
            if i not in self.reduced:
                run(self.reduce_steps(i))
        self.sum_tied()
        if net.clip_grad > 0:
            with part("optimizer"):
                self.clip()
        rate = net.rate_at(self.state.steps_done)
        adamw = net.adamw_at(self.state.steps_done) if net.optimizer == "adamw" else None
        for i in range(len(self.layers)):
            grad = self.optimizer_grad(i)
            mine = self.own(i)
            stepped = mine if self.state.master is None else self.state.master[i]  # mixed: the fp32 master, then cast
            with traced(self.world, "update"), part("optimizer"):
                if adamw is not None:
                    assert self.update_scratch is not None
                    m, v = (self.state.optimizer[kind][i] for kind in ("m", "v"))
                    adamw.step(stepped, grad, m, v, self.update_scratch[: grad.size], self.state.steps_done)
                else:
                    kernels.sgd(stepped, grad, self.state.optimizer["velocity"][i], rate, net.momentum)
                if self.state.master is not None:
                    np.copyto(mine, self.state.master[i], casting="same_kind")
            if self.sharding.optimizer and not self.sharding.params and self.fsdp is not None:
                run(self.gather_steps(i, mine, self.state.params[i]))

    def total_loss(self, loss: float) -> float:
        """The step's loss over every token: summed over the rows' owners (SP's tp, fsdp, dp), then from the
        last pipeline stage to every stage."""
        value = np.array([loss], dtype=self.policy.state)  # fp32 under mixed precision; a 1-element reduction's
        # own scratch
        groups = [self.tp.group if self.tp.sp else None, self.cp, self.ep, self.fsdp, self.dp]
        for group in groups:
            if group is not None:
                all_reduce(group, value, out=value)
        if self.pp is not None:
            last = rank_of(self.stages * self.net.chunks - 1, self.stages, self.placement)  # the loss's stage
            value = broadcast(self.pp, value if self.pp.rank == last else None, root=last)
        return float(value[0])

    # --- the step --------------------------------------------------------------------------------------------

    def bind(self, slot: int, k: int, chunk: int, batch: tuple[np.ndarray, np.ndarray]):
        """(activations, kept arrays, scratch) of `slot` for micro-batch k's rows; the two lists are indexed by
        local unit, so chunk c's unit first[c] + j sees the slot's j-th activations. The scratch is fed the
        micro-batch's positions, token ids and targets (where a unit here reads them)."""
        rows = self.rows[k]
        self.tp.bind_rows(rows.matmul)
        start, depth = self.first[chunk], len(self.chunks[chunk])
        pad = [None] * start
        xs = pad + [b[: rows.local] for b in self.slot_x[slot][: depth + 1]]
        saved: list = list(pad)
        blocks = 0
        for kind in self.kinds[start : start + depth]:
            if kind in BLOCK_KINDS:
                saved.append(self.slot_saved[slot][blocks][kind].cut(rows, self.blocks[kind].saved_rows))
                blocks += 1
            else:
                saved.append(self.slot_ends[slot][kind].cut(rows, self.blocks[kind].saved_rows))
        scratch = self.full_scratch.cut(rows, {**self.scratch_rows, "rerun": "local"})
        feed_rows(scratch, self.matmul_pieces[k], self.net.seq, batch)
        for block in self.blocks.values():
            block.feed(scratch)
        return xs, saved, scratch

    def chunk_input(self, k: int, s: int, into: np.ndarray, x, here: np.ndarray | None) -> None:
        """Micro-batch k's input to stage s's chunk: its rows (the dense models' first stage), or the previous
        stage's output (`here` when that stage is on this rank: V placement's turn); nothing for a first stage
        that reads token ids (its embedding does, from the scratch)."""
        if s == 0 and self.rows_in:
            copy_rows(x, self.pieces[k], into)
        elif here is not None:
            np.copyto(into, here)
        elif s > 0:
            self.pipe().irecv(rank_of(s - 1, self.stages, self.placement), self.tag(False, k, s - 1), into).wait()

    def tag(self, backward: bool, k: int, boundary: int) -> int:
        return pipe_tag(backward, k, boundary, self.stages * self.net.chunks)

    def local_chunk(self, stage: int) -> int | None:
        """Which of this rank's chunks is global stage `stage`, if this rank holds it."""
        for c in range(self.net.chunks):
            if stage_of(self.stage_rank, c, self.stages, self.placement) == stage:
                return c
        return None

    def output(self, slot: int, chunk: int, k: int) -> np.ndarray:
        """Micro-batch k's activations (or, after its backward, input gradient) leaving chunk `chunk` in `slot`."""
        return self.slot_x[slot][len(self.chunks[chunk])][: self.rows[k].local]

    def span(self, op: str, i: int, k: int, stage: int) -> str:
        """A trace span's name: the action's letter first (the timeline colours by it), its unit, stage, micro-batch."""
        return f"{op} layer {self.layers[i]} (stage {stage}, micro-batch {k})"

    def chunk_forward(self, k: int, s: int, local: range, xs, saved, scratch, target, prefetch: bool) -> float:
        """Forward of a chunk's units on micro-batch k; the loss of its rows if it ends the model (0 otherwise).
        With `prefetch`, each unit's next one is gathered behind it (overlap)."""
        loss = 0.0
        for i in local:
            w = self.weights(i, i + 1 if prefetch and i + 1 < local.stop else None)
            self.at_unit(i)
            with traced(self.world, self.span("F", i, k, s)), part("elementwise"):
                value = self.blocks[self.kinds[i]].forward(self.tp, w, xs[i], xs[i + 1], saved[i], scratch)
            if value is not None:
                loss += value
        if s == self.stages * self.net.chunks - 1 and self.rows_in:
            loss += loss_of_rows(xs[local.stop], target, self.pieces[k])
        return loss

    def chunk_backward(
        self, op: str, index: int, c: int, k: int, stash: int | None, local: range, xs, saved, scratch
    ) -> None:
        """B (the whole backward) or I (its input-gradient half: the deferring units' weight gradients kept in
        stash `stash` for W) of chunk c on micro-batch k; the output's gradient becomes the input's, in place."""
        out = xs[local.stop]
        records: dict[int, list] = {}
        used = (0, 0)
        for i in reversed(local):
            w = self.weights(i, i - 1 if i > local.start else None)
            block = self.blocks[self.kinds[i]]
            self.at_unit(i)
            deferred = op == "I" and self.defers[i]
            with (
                traced(self.world, self.span(op, i, k, stage_of(self.stage_rank, c, self.stages, self.placement))),
                part("elementwise"),
            ):
                if self.full_recompute and self.kinds[i] in BLOCK_KINDS:  # the forward again, from its input
                    block.forward(self.tp, w, xs[i], scratch.rerun, saved[i], scratch)
                if deferred:
                    assert stash is not None
                    self.wg.defer(self.stash[stash], self.grad_buffer(i), used)
                block.backward(self.tp, w, self.grad_buffer(i), xs[i], out, saved[i], scratch)
            if deferred:
                records[i], used = self.wg.finish()
            else:
                self.grad_ready(i, index == (self.last_weights if self.defers[i] else self.last_backward)[c])
        if op == "I":
            self.deferred[(c, k)] = records

    def chunk_weights(self, index: int, c: int, k: int, local: range) -> None:
        """W: the weight gradients chunk c's I deferred for micro-batch k, into the units' gradients."""
        records, final = self.deferred.pop((c, k)), index == self.last_weights[c]
        for i in reversed(local):
            if self.defers[i]:
                with traced(
                    self.world, self.span("W", i, k, stage_of(self.stage_rank, c, self.stages, self.placement))
                ):
                    replay(records[i], self.grad_buffer(i))
                self.grad_ready(i, final)

    def step(self, x: np.ndarray, target: np.ndarray) -> float:
        run = StepRun(x, target, list(range(len(self.slot_x))), list(range(len(self.stash))))
        self.busy, self.op_seconds = 0.0, dict.fromkeys("FBIW", 0.0)
        self.written.clear()
        self.whole.clear()
        self.reduced.clear()
        for index, a in enumerate(self.order):
            c, s = a.chunk, stage_of(self.stage_rank, a.chunk, self.stages, self.placement)
            at = At(index, c, a.microbatch, s, range(self.first[c], self.first[c] + len(self.chunks[c])))
            started = self.actions[a.op](run, a.op, at)
            took = time.perf_counter() - started
            self.busy += took
            self.op_seconds[a.op] += took
        for request in run.sending.values():
            request.wait()
        self.update()
        if self.experts is not None and self.experts.gamma:  # --bias-balance: from the step's global loads
            self.experts.balance([g for g in (self.dp, self.fsdp, self.ep, self.cp) if g is not None])
        return self.total_loss(run.loss)

    def pipe(self) -> Group:
        """The group pipeline stages talk over (with one stage nothing is sent: layout.check)."""
        return self.pp if self.pp is not None else self.world

    def forward_action(self, run: StepRun, op: str, at: At) -> float:
        """F: micro-batch k's input into a free slot (from the previous stage, or its rows), the chunk's forward,
        its output sent on; returns when the compute started (after the input arrived)."""
        c, k, s, local = at.chunk, at.microbatch, at.stage, at.local
        before, after = self.local_chunk(s - 1), self.local_chunk(s + 1)  # neighbours on this rank
        slot = run.slot_of[(c, k)] = run.free.pop(0)
        if slot in run.sending:
            run.sending.pop(slot).wait()
        xs, saved, scratch = self.bind(slot, k, c, (run.x, run.target))
        here = self.output(run.slot_of[(before, k)], before, k) if before is not None else None
        self.chunk_input(k, s, xs[local.start], run.x, here)
        started = time.perf_counter()
        run.loss += self.chunk_forward(k, s, local, xs, saved, scratch, run.target, prefetch=True)
        if s < self.stages * self.net.chunks - 1 and after is None:
            to = rank_of(s + 1, self.stages, self.placement)
            run.sending[slot] = self.pipe().isend(to, xs[local.stop], self.tag(False, k, s))
        return started

    def backward_action(self, run: StepRun, op: str, at: At) -> float:
        """B or I: the output's gradient received (or already here), the chunk's backward (I: its weight
        gradients stashed for W), the input's gradient sent back; the slot is free again."""
        c, k, s, local = at.chunk, at.microbatch, at.stage, at.local
        before, after = self.local_chunk(s - 1), self.local_chunk(s + 1)
        slot = run.slot_of.pop((c, k))
        if op == "I":
            run.stash_of[(c, k)] = run.free_stashes.pop(0)
        xs, saved, scratch = self.bind(slot, k, c, (run.x, run.target))
        out = xs[local.stop]
        if s < self.stages * self.net.chunks - 1 and after is None:  # (from a chunk on this rank, it is already there)
            run.sending.pop(slot).wait()
            self.pipe().irecv(rank_of(s + 1, self.stages, self.placement), self.tag(True, k, s), out).wait()
        started = time.perf_counter()
        self.chunk_backward(op, at.index, c, k, run.stash_of.get((c, k)), local, xs, saved, scratch)
        if before is not None:  # the previous stage is here: its output's gradient, into its slot
            np.copyto(self.output(run.slot_of[(before, k)], before, k), out)
        elif s > 0:
            to = rank_of(s - 1, self.stages, self.placement)
            run.sending[slot] = self.pipe().isend(to, out, self.tag(True, k, s - 1))
        run.free.append(slot)
        return started

    def weights_action(self, run: StepRun, op: str, at: At) -> float:
        """W: the weight gradients the chunk's I deferred, from its stash, which is free again."""
        started = time.perf_counter()
        self.chunk_weights(at.index, at.chunk, at.microbatch, at.local)
        run.free_stashes.append(run.stash_of.pop((at.chunk, at.microbatch)))
        return started

    def exchanged(self) -> np.ndarray:
        """Pairs a mixture of experts sent to and received from other ep ranks since the start: in forwards, in
        backwards (what its all-to-alls' bytes depend on; zeros without)."""
        return self.experts.exchanged.copy() if self.experts is not None else np.zeros(4, dtype=np.int64)

    def routing(self) -> np.ndarray | None:
        """A mixture of experts' routing since the last call, this rank's share (spmd.model.moe.take_routing;
        zeros on a pipeline stage whose layers are all dense, --moe-every); None for a dense model."""
        if self.experts is not None:
            return self.experts.take_routing()
        return np.zeros(self.net.experts + 1, dtype=np.int64) if self.net.experts else None

    def at_unit(self, i: int) -> None:
        """Tell a mixture of experts which layer runs next (its balancing bias is per layer)."""
        if self.experts is not None:
            self.experts.unit = self.layers[i]

    def evaluate(self, x, target) -> float:
        """The loss of a batch, forward only: every micro-batch through every stage in order (chunk by chunk),
        one slot reused, no gradient; summed over the mesh as a step's loss is (the same number on any mesh)."""
        p, v = self.stages, self.net.chunks
        g = self.pipe()
        last_stage = p * v - 1
        loss = 0.0
        for k in range(self.net.microbatches):
            for c in range(v):
                s = stage_of(self.stage_rank, c, p, self.placement)
                local = range(self.first[c], self.first[c] + len(self.chunks[c]))
                before = self.local_chunk(s - 1)
                xs, saved, scratch = self.bind(0, k, c, (x, target))
                here = self.output(0, before, k) if before is not None else None
                self.chunk_input(k, s, xs[local.start], x, here)
                loss += self.chunk_forward(k, s, local, xs, saved, scratch, target, prefetch=False)
                if s < last_stage and self.local_chunk(s + 1) is None:
                    g.isend(rank_of(s + 1, p, self.placement), xs[local.stop], self.tag(False, k, s)).wait()
        self.finish_prefetch()
        self.whole.clear()
        return self.total_loss(loss)

    def owned(self) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """(unit, indices into the full flat unit, values) of every parameter this rank keeps up to date (under
        mixed precision its fp32 master values)."""
        master = self.state.master
        return [
            (unit, self.indices(i)[1], self.own(i) if master is None else master[i])
            for i, unit in enumerate(self.layers)
        ]


def feed_rows(scratch, pieces: list[tuple[int, int]], seq: int, batch: tuple[np.ndarray, np.ndarray]) -> None:
    """Into the scratch arrays a rank's units read (where it has them): each matmul row's position in its
    sequence (pos), its token id (ids) and the next token (targets)."""
    x, target = batch
    for name, source in (("ids", x), ("targets", target)):
        into = scratch.get(name)
        if into is not None:
            copy_rows(source, pieces, into)
    pos = scratch.get("pos")
    if pos is not None:
        at = 0
        for lo, hi in pieces:
            np.mod(np.arange(lo, hi), seq, out=pos[at : at + hi - lo])
            at += hi - lo


def copy_rows(x: np.ndarray, pieces: list[tuple[int, int]], out: np.ndarray) -> None:
    """out = the rows `pieces` of x, one after another (no temporary: each piece a slice)."""
    at = 0
    for lo, hi in pieces:
        out[at : at + hi - lo] = x[lo:hi]
        at += hi - lo


def loss_of_rows(y: np.ndarray, target: np.ndarray, pieces: list[tuple[int, int]]) -> float:
    """kernels.loss_grad over rows held in pieces: y becomes y - target; returns the loss of these rows."""
    loss, at = 0.0, 0
    for lo, hi in pieces:
        loss += kernels.loss_grad(y[at : at + hi - lo], target[lo:hi])
        at += hi - lo
    return loss
