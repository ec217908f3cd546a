"""Data parallelism with the ZeRO ladder, tensor parallelism, and both on a 2-D mesh (FSDP x TP).

Over the data axis (D ranks) the batch rows are split and the model is, by ZeRO stage:
- 0, DP: replicated: parameters, gradients and optimizer state whole; each layer's gradient all-reduced
  (a layer is the bucket, as DDP buckets gradients, so the reduction buffers stay one layer's size).
- 1: the optimizer state sharded; each layer's gradient reduce-scattered, its shard updated, the layer
  all-gathered again.
- 2: the gradients sharded too: each layer's gradient is reduce-scattered as soon as its backward ends,
  so only one full layer of gradient exists at a time.
- 3, FSDP: the parameters sharded too: a layer is all-gathered before its forward and again before its
  backward (resharded after forward, FSDP2's default), into one buffer holding a single layer.
Shards are each flat layer split as np.array_split over the D ranks.

Over the tensor axis (t ranks, Megatron's MLP) every rank sees all the rows: W1 is split by columns and
W2 by rows (np.array_split of f), so relu((X g) W1_i) W2_i is a partial sum of the layer's output:
one all-reduce in forward, and one of the input gradient in backward. g stays replicated; its gradient
is computed after that all-reduce, so it needs no reduction of its own.
"""

from __future__ import annotations

from spmd.collectives import all_gather, all_reduce, reduce_scatter
from spmd.collectives.cost import all_gather_bytes, all_reduce_bytes, reduce_scatter_bytes
from spmd.layout import block_range, block_size, block_sizes, largest_block
from spmd.strategies.base import Schedule
from spmd.train import kernels
from spmd.train.engine import Engine, sum_loss
from spmd.train.record import Tally, TrainCost, Trainer, layer_table, memory, scratch_elements, step_flops
from spmd.transport.mesh import Mesh
from spmd.workloads.mlp import MLP, layer_size, tp_indices


class Sharded(Engine):
    """A rank of DP/ZeRO over `data_axis` (None: no data parallelism) and TP over `tp_axis` (None: none)."""

    def __init__(self, world, mesh: Mesh, mlp: MLP, stage: int, data_axis: str | None, tp_axis: str | None):
        super().__init__(world, mesh, mlp)
        self.stage = stage
        self.data = mesh.group(world, data_axis) if data_axis else None
        self.tp = mesh.group(world, tp_axis) if tp_axis else None
        d, r = (self.data.size, self.data.rank) if self.data else (1, 0)
        t, j = (self.tp.size, self.tp.rank) if self.tp else (1, 0)
        self.ffn_range = block_range(mlp.ffn, t, j)
        self.ffn = self.ffn_range[1] - self.ffn_range[0]
        self.rows = self.data_rows(d, r)
        p = self.width
        self.shard, self.shard_counts = block_range(p, d, r), block_sizes(p, d)
        n, take, shard = len(self.layers), self.plan.take, self.shard[1] - self.shard[0]
        self.params = take("params", (n, p)) if stage < 3 else take("params", (n, shard))
        self.gathered = take("params", (p,)) if stage == 3 else None
        self.grads = take("grads", (n, p)) if stage < 2 else take("grads", (n, shard))
        self.layer_grad = take("grads", (p,)) if stage >= 2 else None
        self.velocity = take("optimizer", (n, p)) if stage == 0 else take("optimizer", (n, shard))
        self.allocate()
        self.reserve_reductions(self.largest_reduction_chunk(d, t))
        index = tp_indices(mlp.hidden, mlp.ffn, *self.ffn_range)  # not kept: a layer's worth of int64
        for i, layer in enumerate(self.layers):
            mine = mlp.initial_layer(layer)[index]
            self.params[i] = mine if stage < 3 else mine[slice(*self.shard)]

    def data_rows(self, d: int, r: int) -> tuple[int, int]:
        return block_range(self.mlp.tokens, d, r)

    def largest_reduction_chunk(self, d: int, t: int) -> int:
        """Over every reduction this rank runs: gradients over the data axis, partial outputs over TP."""
        grads = largest_block(self.width, d) if d > 1 else 0
        partial = largest_block(self.local_rows * self.mlp.hidden, t) if t > 1 else 0
        return max(grads, partial)

    def weights(self, i):
        if self.stage < 3:
            return self.params[i]
        return all_gather(self.data, self.params[i], self.shard_counts, out=self.gathered)

    def grad_buffer(self, i):
        return self.grads[i] if self.stage < 2 else self.layer_grad

    def grad_ready(self, i):
        if self.stage >= 2:
            reduce_scatter(self.data, self.layer_grad, workspace=self.workspace, out=self.grads[i])

    def sum_partial(self, array):
        if self.tp is not None and self.tp.size > 1:
            all_reduce(self.tp, array, self.workspace, out=array)

    def update(self):
        mlp, lo, hi = self.mlp, *self.shard
        if self.stage == 0:
            if self.data is not None and self.data.size > 1:
                for grad in self.grads:
                    all_reduce(self.data, grad, self.workspace, out=grad)
            with self.compute("update"):
                kernels.sgd(self.params, self.grads, self.velocity, mlp.lr, mlp.momentum)
            return
        for i in range(len(self.layers)):
            if self.stage == 1:
                reduce_scatter(self.data, self.grads[i], workspace=self.workspace, out=self.grads[i][lo:hi])
            grad = self.grads[i][lo:hi] if self.stage == 1 else self.grads[i]
            mine = self.params[i][lo:hi] if self.stage < 3 else self.params[i]
            with self.compute("update"):
                kernels.sgd(mine, grad, self.velocity[i], mlp.lr, mlp.momentum)
            if self.stage < 3:
                all_gather(self.data, mine, self.shard_counts, out=self.params[i])

    def total_loss(self, loss):
        return loss if self.data is None else sum_loss(self.data, loss, self.workspace, self.plan.dtype)

    def owned(self):
        index = tp_indices(self.mlp.hidden, self.mlp.ffn, *self.ffn_range)
        mine = index if self.stage < 3 else index[slice(*self.shard)]
        return [(layer, mine, self.params[i]) for i, layer in enumerate(self.layers)]


def _sizes(mesh: Mesh, data_axis, tp_axis) -> tuple[int, int]:
    return (mesh.axis_size(data_axis) if data_axis else 1), (mesh.axis_size(tp_axis) if tp_axis else 1)


def cost(mlp: MLP, mesh: Mesh, stage: int, data_axis: str | None, tp_axis: str | None) -> TrainCost:
    """Bytes per step per axis, memory by kind and matmul flops per rank, closed form."""
    d, t = _sizes(mesh, data_axis, tp_axis)
    n, h, s = mlp.layers, mlp.hidden, mlp.itemsize
    traffic, held, flops = [], [], []
    for rank in range(mesh.size):
        coords = mesh.coords(rank)
        r, j = (coords[data_axis] if data_axis else 0), (coords[tp_axis] if tp_axis else 0)
        f = block_size(mlp.ffn, t, j)
        p, rows = layer_size(h, f), block_size(mlp.tokens, d, r)
        counts = block_sizes(p, d)
        tally = Tally()
        if tp_axis:
            tally.add(tp_axis, all_reduce_bytes(rows * h, t, j, s), 2 * n)  # forward output, backward input grad
        if data_axis and stage == 0:
            tally.add(data_axis, all_reduce_bytes(p, d, r, s), n)
        elif data_axis:
            tally.add(data_axis, reduce_scatter_bytes(counts, r, s), n)
            # ZeRO-3 gathers every layer for forward and again for backward
            tally.add(data_axis, all_gather_bytes(counts, r, s), n * (2 if stage == 3 else 1))
        if data_axis:
            tally.add(data_axis, all_reduce_bytes(1, d, r, s))  # the loss
        traffic.append(tally)
        grads_chunk = largest_block(p, d) if d > 1 else 0
        partial_chunk = largest_block(rows * h, t) if t > 1 else 0
        shard = counts[r]
        held.append(memory(
            s,
            params=n * p if stage < 3 else n * shard + p,
            grads=n * p if stage < 2 else n * shard + p,
            optimizer=n * p if stage == 0 else n * shard,
            activations=(n + 1) * rows * h + n * rows * f,
            buffers=scratch_elements(rows, h, f) + 3 * max(grads_chunk, partial_chunk),
        ))
        flops.append(step_flops(rows, h, f, n))
    return TrainCost(traffic, held, flops)


def check_ffn(mlp: MLP, mesh: Mesh, tp_axis: str) -> None:
    """Every tensor-parallel rank must hold at least one column of W1 (f >= t)."""
    t = mesh.axis_size(tp_axis)
    if mlp.ffn < t:
        raise ValueError(f"ffn size f={mlp.ffn} is smaller than the {tp_axis} axis ({t} ranks): "
                         "a tensor-parallel rank would hold no column of W1")


def schedule(mlp: MLP, mesh: Mesh, stage: int, data_axis: str | None, tp_axis: str | None) -> Schedule:
    """Every rank does the same; the collectives each layer needs, by axis."""
    gather = f"AG W{{l}} over {data_axis}; " if stage == 3 else ""
    tp = f"; AR over {tp_axis}" if tp_axis else ""
    forward = f"{gather}W{{l}} forward{tp}"
    backward = f"{gather}W{{l}} backward{tp}" + (f"; RS dW{{l}} over {data_axis}" if stage >= 2 else "")
    update = {0: f"per layer: AR dW over {data_axis}; SGD" if data_axis else "SGD",
              1: f"per layer: RS dW over {data_axis}, SGD on the shard, AG W",
              2: f"SGD on the shards; per layer AG W over {data_axis}",
              3: "SGD on the shards"}[stage]
    names = {0: "DP" if data_axis else "TP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "FSDP (ZeRO-3)"}
    label = names[stage] + (" x TP" if data_axis and tp_axis else "")
    return layer_table(f"{label} on mesh {mesh}: AG all-gather, RS reduce-scatter, AR all-reduce.", mlp, mesh,
                       forward, backward, update)


def trainer(name: str, summary: str, stage: int, data_axis: str | None, tp_axis: str | None) -> Trainer:
    return Trainer(
        name=name, summary=summary, axes=tuple(a for a in (data_axis, tp_axis) if a),
        build=lambda world, mesh, mlp: Sharded(world, mesh, mlp, stage, data_axis, tp_axis),
        cost=lambda mlp, mesh: cost(mlp, mesh, stage, data_axis, tp_axis),
        check=(lambda mlp, mesh: check_ffn(mlp, mesh, tp_axis)) if tp_axis else (lambda mlp, mesh: None),
        schedule=lambda mlp, mesh: schedule(mlp, mesh, stage, data_axis, tp_axis),
    )


DP = trainer("mlp-dp", "MLP training, data parallel: batch split, gradients all-reduced", 0, "dp", None)
ZERO1 = trainer("mlp-zero1", "MLP training, ZeRO-1: optimizer state sharded", 1, "dp", None)
ZERO2 = trainer("mlp-zero2", "MLP training, ZeRO-2: optimizer state and gradients sharded", 2, "dp", None)
FSDP = trainer("mlp-fsdp", "MLP training, FSDP (ZeRO-3): parameters, gradients, optimizer sharded", 3, "fsdp", None)
TP = trainer("mlp-tp", "MLP training, Megatron tensor parallel: W1 by columns, W2 by rows, 2 all-reduces a layer",
             0, None, "tp")
FSDP_TP = trainer("mlp-fsdp-tp", "MLP training, FSDP over one mesh axis x tensor parallel over the other",
                  3, "fsdp", "tp")
