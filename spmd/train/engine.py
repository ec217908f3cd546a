"""One rank's training step, with the hooks each parallel strategy fills in.

The step is the same for every strategy: forward through this rank's layers,
the loss, backward in reverse, the optimizer. What differs is where a layer's
weights come from (held, or all-gathered), what is summed across ranks and
when (partial outputs under TP, gradients under DP), and what is sharded.
A subclass overrides only those hooks; every array comes from a Plan, so the
memory a rank holds is known by kind and a step allocates nothing.
"""

from __future__ import annotations

import contextlib

import numpy as np

from spmd.collectives import Workspace, all_reduce
from spmd.collectives.ring import REDUCTION_BUFFERS
from spmd.observe.trace import traced
from spmd.train import kernels
from spmd.train.kernels import Plan, Scratch
from spmd.transport.group import Group
from spmd.transport.mesh import Mesh
from spmd.workloads.mlp import MLP, layer_size, layer_views


class Engine:
    """A rank of a strategy whose layers are replicated or tensor-sliced, one pass over its tokens.

    Attributes set by subclasses before `allocate()`:
        rows: (lo, hi), the batch rows this rank's activations hold.
        ffn: this rank's share of f (f unless tensor parallel).
        layers: the global indices of the layers this rank runs.
    """

    busy = 0.0  # seconds of forward/backward compute in the last step; only pipelines measure it (their bubble)
    layer_spans = True  # trace each layer's kernels (a pipeline traces whole micro-batches instead)

    def __init__(self, world: Group, mesh: Mesh, mlp: MLP):
        self.world = world  # for the trace: compute spans are recorded on this rank's row
        self.mlp = mlp
        self.plan = Plan(mlp.dtype)
        self.workspace = Workspace()
        self.layers = list(range(mlp.layers))
        self.ffn = mlp.ffn
        self.rows = (0, mlp.tokens)

    # --- set-up ----------------------------------------------------------------------------------------------

    @property
    def width(self) -> int:
        """Elements of one of this rank's (possibly tensor-sliced) flat layers."""
        return layer_size(self.mlp.hidden, self.ffn)

    @property
    def local_rows(self) -> int:
        return self.rows[1] - self.rows[0]

    @property
    def matmul_rows(self) -> int:
        """Rows the layer's matmuls see (more than local_rows under sequence parallelism)."""
        return self.local_rows

    def allocate(self) -> None:
        """The activations (each layer's input and pre-activation) and the layer scratch."""
        h, n = self.mlp.hidden, len(self.layers)
        self.x = [self.plan.take("activations", (self.local_rows, h)) for _ in range(n + 1)]
        self.a = [self.plan.take("activations", (self.matmul_rows, self.ffn)) for _ in range(n)]
        self.scratch = Scratch(self.plan, self.matmul_rows, h, self.ffn)

    def reserve_reductions(self, largest: int) -> None:
        """Size the Workspace's reduction buffers once for the largest chunk any reduction of this rank uses."""
        if largest:
            for name in REDUCTION_BUFFERS:
                self.workspace.array(name, (largest,), self.plan.dtype)
            self.plan.bytes["buffers"] += len(REDUCTION_BUFFERS) * largest * self.plan.dtype.itemsize

    # --- hooks -----------------------------------------------------------------------------------------------

    def weights(self, i: int) -> np.ndarray:
        """The flat weights of local layer i, ready to use (gathered, if sharded)."""
        return self.params[i]

    def grad_buffer(self, i: int) -> np.ndarray:
        """Where local layer i's backward writes its gradient."""
        return self.grads[i]

    def grad_ready(self, i: int) -> None:
        """Layer i's gradient is complete on this rank (ZeRO-2/3 reduce-scatter it here)."""

    def sum_partial(self, array: np.ndarray) -> None:
        """Sum a partial result over the tensor-parallel ranks, in place (TP's all-reduce)."""

    def update(self) -> None:
        """Reduce the gradients as the strategy needs, then the optimizer step."""
        raise NotImplementedError

    def total_loss(self, loss: float) -> float:
        """The loss over every token, from this rank's share."""
        return loss

    def owned(self) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """(layer, indices into the full flat layer, values) of every parameter this rank holds up to date."""
        raise NotImplementedError

    def compute(self, name: str):
        """A trace span around kernels (no communication inside), if tracing is on."""
        return traced(self.world, name) if self.layer_spans else _NO_SPAN

    # --- the step ---------------------------------------------------------------------------------------------

    def step(self, x: np.ndarray, target: np.ndarray) -> float:
        """One training step on the batch (every rank passes the whole batch; it reads only its rows)."""
        lo, hi = self.rows
        self.x[0][...] = x[lo:hi]
        for i in range(len(self.layers)):
            self.forward_layer(i)
        loss = kernels.loss_grad(self.x[-1], target[lo:hi])
        for i in reversed(range(len(self.layers))):
            self.backward_layer(i, self.x[-1])
        self.update()
        return self.total_loss(loss)

    def forward_layer(self, i: int) -> None:
        w1, w2, g = layer_views(self.weights(i), self.mlp.hidden, self.ffn)
        x, y, s = self.x[i], self.x[i + 1], self.scratch
        with self.compute(f"F layer {self.layers[i]}"):
            kernels.scale(x, g, s.xn)
            kernels.forward(s.xn, w1, w2, self.a[i], s.z, y)
        self.sum_partial(y)
        np.add(y, x, out=y)

    def backward_layer(self, i: int, dy: np.ndarray) -> None:
        """dy (the gradient of layer i's output) becomes the gradient of its input, in place."""
        w1, w2, g = layer_views(self.weights(i), self.mlp.hidden, self.ffn)
        dw1, dw2, dg = layer_views(self.grad_buffer(i), self.mlp.hidden, self.ffn)
        x, s = self.x[i], self.scratch
        with self.compute(f"B layer {self.layers[i]}"):
            kernels.scale(x, g, s.xn)
            kernels.backward(dy, s.xn, self.a[i], w1, w2, dw1, dw2, s)
        self.sum_partial(s.dxn)
        with self.compute(f"B layer {self.layers[i]}"):
            kernels.gain_grad(x, s.dxn, dg, s.xn)
            kernels.input_grad(dy, s.dxn, g, s.xn)
        self.grad_ready(i)


_NO_SPAN = contextlib.nullcontext()


def sum_loss(group: Group, loss: float, workspace: Workspace, dtype) -> float:
    """The sum over `group` of every rank's loss (an all-reduce of one element, the same order everywhere)."""
    value = np.array([loss], dtype=dtype)
    return float(all_reduce(group, value, workspace, out=value)[0])
