"""Megatron sequence parallelism around tensor parallelism (t ranks on the "tp" axis).

Between the matmuls (the residual stream, the gain g) each rank holds only its
rows of the sequence (np.array_split of the tokens), so those activations take
1/t of TP's memory. Per layer, forward: X_i g is all-gathered before the column
matmul, and the row matmul's partial output is reduce-scattered back to rows
(the same bytes as TP's all-reduce, which is a reduce-scatter plus an
all-gather). Backward: the output gradient is all-gathered, X_i g is gathered
again (recomputed, not kept), and the input gradient reduce-scattered. g is
replicated but each rank sees only its rows, so its gradient is partial and is
all-reduced over TP: the reduction Megatron-LM#1446 and gpt-neox#1257 found missing.
"""

from __future__ import annotations

import numpy as np

from spmd.collectives import all_gather, all_reduce, reduce_scatter
from spmd.collectives.cost import all_gather_bytes, all_reduce_bytes, reduce_scatter_bytes
from spmd.layout import block_range, block_size, block_sizes, largest_block
from spmd.train import kernels
from spmd.train.engine import sum_loss
from spmd.train.record import Tally, TrainCost, Trainer, layer_table, memory, scratch_elements, step_flops
from spmd.train.sharded import Sharded, check_ffn
from spmd.transport.mesh import Mesh
from spmd.workloads.mlp import MLP, layer_size, layer_views


class SequenceParallel(Sharded):
    def __init__(self, world, mesh: Mesh, mlp: MLP):
        super().__init__(world, mesh, mlp, 0, None, "tp")
        self.counts = block_sizes(mlp.tokens, self.tp.size)

    def data_rows(self, d, r):
        return block_range(self.mlp.tokens, self.tp.size, self.tp.rank)

    @property
    def matmul_rows(self):
        return self.mlp.tokens

    def allocate(self):
        super().allocate()
        self.dy_full = self.plan.take("buffers", (self.mlp.tokens, self.mlp.hidden))

    def largest_reduction_chunk(self, d, t):
        return largest_block(self.mlp.tokens, t) * self.mlp.hidden if t > 1 else 0

    def forward_layer(self, i):
        w1, w2, g = layer_views(self.weights(i), self.mlp.hidden, self.ffn)
        x, y, s = self.x[i], self.x[i + 1], self.scratch
        with self.compute(f"F layer {self.layers[i]}"):
            kernels.scale(x, g, y)  # this rank's rows of X g, for now in the output's place
        all_gather(self.tp, y, self.counts, out=s.xn)
        with self.compute(f"F layer {self.layers[i]}"):
            kernels.forward(s.xn, w1, w2, self.a[i], s.z, s.dxn)  # s.dxn: the partial output, all rows
        reduce_scatter(self.tp, s.dxn, workspace=self.workspace, out=y)
        np.add(y, x, out=y)

    def backward_layer(self, i, dy):
        w1, w2, g = layer_views(self.weights(i), self.mlp.hidden, self.ffn)
        dw1, dw2, dg = layer_views(self.grads[i], self.mlp.hidden, self.ffn)
        x, s, rows = self.x[i], self.scratch, self.local_rows
        all_gather(self.tp, dy, self.counts, out=self.dy_full)
        name = f"B layer {self.layers[i]}"
        with self.compute(name):
            kernels.scale(x, g, s.dxn[:rows])
        all_gather(self.tp, s.dxn[:rows], self.counts, out=s.xn)  # X g gathered again, not kept from forward
        with self.compute(name):
            kernels.backward(self.dy_full, s.xn, self.a[i], w1, w2, dw1, dw2, s)
        dxn = reduce_scatter(self.tp, s.dxn, workspace=self.workspace, out=self.dy_full[:rows])
        with self.compute(name):
            kernels.gain_grad(x, dxn, dg, s.xn[:rows])
        all_reduce(self.tp, dg, self.workspace, out=dg)  # g saw only this rank's rows
        with self.compute(name):
            kernels.input_grad(dy, dxn, g, s.xn[:rows])

    def update(self):
        kernels.sgd(self.params, self.grads, self.velocity, self.mlp.lr, self.mlp.momentum)

    def total_loss(self, loss):
        return sum_loss(self.tp, loss, self.workspace, self.plan.dtype)


def cost(mlp: MLP, mesh: Mesh) -> TrainCost:
    t, n, h, s, tokens = mesh.size, mlp.layers, mlp.hidden, mlp.itemsize, mlp.tokens
    counts = block_sizes(tokens, t)
    traffic, held, flops = [], [], []
    for j in range(t):
        f, rows = block_size(mlp.ffn, t, j), counts[j]
        p = layer_size(h, f)
        gather, scatter = all_gather_bytes(counts, j, h * s), reduce_scatter_bytes(counts, j, h * s)
        tally = Tally()
        tally.add("tp", gather, n), tally.add("tp", scatter, n)  # forward: AG before W1, RS after W2
        # backward: AG of dy and of X g, RS of the input gradient, AR of g's gradient; then the loss
        tally.add("tp", gather, 2 * n), tally.add("tp", scatter, n), tally.add("tp", all_reduce_bytes(h, t, j, s), n)
        tally.add("tp", all_reduce_bytes(1, t, j, s))
        traffic.append(tally)
        held.append(memory(
            s, params=n * p, grads=n * p, optimizer=n * p,
            activations=(n + 1) * rows * h + n * tokens * f,
            buffers=scratch_elements(tokens, h, f) + tokens * h + (3 * max(counts) * h if t > 1 else 0),
        ))
        flops.append(step_flops(tokens, h, f, n))
    return TrainCost(traffic, held, flops)


def check(mlp: MLP, mesh: Mesh) -> None:
    check_ffn(mlp, mesh, "tp")
    if mlp.tokens < mesh.size:
        raise ValueError(f"tokens={mlp.tokens} is fewer than the tp axis ({mesh.size} ranks): sequence "
                         "parallelism gives each rank at least one row of the sequence")


SP = Trainer(
    name="mlp-sp",
    summary="MLP training, Megatron sequence parallel around TP: rows split between the matmuls",
    axes=("tp",),
    build=SequenceParallel,
    cost=cost,
    check=check,
    schedule=lambda mlp, mesh: layer_table(
        f"SP around TP on mesh {mesh}: activations split by rows between the matmuls.", mlp, mesh,
        "AG X{l}g over tp; W{l} forward; RS y over tp",
        "AG dy, AG X{l}g over tp; W{l} backward; RS dx over tp; AR dg{l} over tp", "SGD"),
)
