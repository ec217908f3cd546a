"""What a model's block must provide to the composed engine, and the sizes a rank's share of it has."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from types import SimpleNamespace
from typing import Protocol

import numpy as np

from spmd.model.weight_grads import IMMEDIATE, WeightGrads

BLOCK_KIND = "block"  # a dense layer
EXPERT_KIND = "moe"  # the layer with a mixture of experts (its Block has moe_layer)
EMBED_KIND = "embed"  # the input embedding: a lookup, no matmul
BLOCK_KINDS = (BLOCK_KIND, EXPERT_KIND)  # the kinds of unit a pipeline splits and full recomputation reruns: the layers


class Role(Enum):
    """What a kind of unit is to the rest of the model, as the step table reads it: each spec says the role of
    each of its kinds (registry.role_of), so text keyed by role holds for a model that names its kinds otherwise."""

    EMBEDDING = "embedding"  # the input lookup
    BLOCK = "block"  # a dense layer
    EXPERTS = "experts"  # a layer with a mixture of experts
    NORM = "norm"  # the final norm
    HEAD = "head"  # the output projection and the loss


@dataclass(frozen=True)
class Share:
    """A rank's share of a layer: its ffn columns and its attention heads (tensor parallel), its experts (ep)."""

    ffn: int
    heads: int
    head_size: int
    kv_heads: int = 0  # grouped-query attention's key/value heads (0: as many as query heads)
    vocab: int = 0  # the rows of the vocabulary this rank holds (the LM's embedding and head)
    experts: tuple[int, int] = (0, 0)  # the experts this rank holds, [first, last) (a mixture of experts over ep)

    @property
    def attention(self) -> int:
        """Width of this rank's Q, K, V (its heads x the head size)."""
        return self.heads * self.head_size

    @property
    def kv_width(self) -> int:
        """Width of this rank's K and V before they are repeated for their query groups."""
        return (self.kv_heads or self.heads) * self.head_size


@dataclass(frozen=True)
class Rows:
    """The rows a micro-batch has on this rank: `local` between the regions, `matmul` inside them
    (more under SP), `sequences` of the matmul rows (attention's unit), `pairs` its experts may compute (a
    mixture of experts: matmul x top_k, or over ep every ep rank's, wherever the tokens go)."""

    local: int
    matmul: int
    sequences: int
    pairs: int = 0


class Buffers(SimpleNamespace):
    """Named arrays, cut to a micro-batch's rows by `cut` (each array's first axis is rows, or sequences)."""

    # the tensor axis's scratch that only SP takes (parallel/tensor.py): None where a block's shapes have none
    xf: np.ndarray | None = None  # the input rows gathered over tp
    part: np.ndarray | None = None  # the row-parallel matmul's partial output, all rows
    dyf: np.ndarray | None = None  # the output gradient gathered over tp

    def get(self, name: str) -> np.ndarray | None:
        """The array `name`, or None where the units here have none (a model without token ids, P recomputed)."""
        return vars(self).get(name)

    def cut(self, rows: Rows, by: dict[str, str]) -> Buffers:
        sizes = {"local": rows.local, "matmul": rows.matmul, "sequences": rows.sequences, "pairs": rows.pairs}
        return Buffers(
            **{name: (array[: sizes[by[name]]] if by.get(name) else array) for name, array in vars(self).items()}
        )


class Experts(Protocol):
    """What the engine and the checkpoint ask of a block's mixture of experts (spmd.model.moe.MoEFFN)."""

    e: int  # experts
    gamma: float  # the balancing bias's rate (--bias-balance; 0: none)
    unit: int  # the layer being run: the engine sets it (the bias is per layer)
    bias: dict[int, np.ndarray]  # per layer, its experts' balancing bias
    exchanged: np.ndarray  # pairs sent to and received from other ep ranks: in forwards, in backwards

    def take_routing(self) -> np.ndarray: ...
    def balance(self, groups: Sequence) -> None: ...


class Block(Protocol):
    """A layer of a model, written once: what the composed engine calls (see MLPBlock, TransformerBlock)."""

    saved_rows: dict[str, str]  # which axis of each kept array is rows ("local", "matmul", "sequences", "pairs")
    scratch_rows: dict[str, str]
    defers: bool  # its weight gradients can wait for a split schedule's W (then `wg` records them)
    wg: WeightGrads
    dtypes: dict[str, str]  # arrays not in their kind's dtype (see dtype_of)
    moe_layer: Experts | None  # its mixture of experts, if it has one (routing counts, balancing bias)

    @property
    def size(self) -> int: ...
    def saved_shapes(self, rows: Rows) -> dict[str, tuple]: ...
    def scratch_shapes(self, rows: Rows) -> dict[str, tuple]: ...
    def prepare(self, s: Buffers) -> None: ...
    def feed(self, s: Buffers) -> None: ...
    def forward(
        self, tp, w: np.ndarray, x: np.ndarray, y: np.ndarray, saved: Buffers, s: Buffers
    ) -> float | None: ...  # a loss, from a unit that ends the model
    def backward(
        self, tp, w: np.ndarray, grad: np.ndarray, x: np.ndarray, dy: np.ndarray, saved: Buffers, s: Buffers
    ) -> None: ...
    def stash_sizes(self, rows: Rows) -> tuple[int, int]: ...  # what its deferred weight gradients keep, I to W


class BlockDefaults:
    """Block's members for a block that does not set them: its weight gradients at once (nothing stashed),
    every array in its kind's dtype, no mixture of experts."""

    defers = False
    wg = IMMEDIATE
    dtypes: dict[str, str] = {}  # read only: a block with arrays of other dtypes sets its own
    moe_layer: Experts | None = None

    def stash_sizes(self, rows: Rows) -> tuple[int, int]:
        return 0, 0


# A block's `dtypes` names the arrays not in their kind's dtype: "index" (int64: token ids, positions) or "state"
# (the state dtype, fp32 under mixed precision: norms' statistics, the loss's softmax).
INDEX = np.dtype(np.int64)


def dtype_of(name: str, dtypes: dict[str, str], kind_dtype, state_dtype) -> np.dtype:
    return {"index": INDEX, "state": np.dtype(state_dtype)}.get(dtypes.get(name, ""), np.dtype(kind_dtype))


def take(arena, kind: str, shapes: dict[str, tuple], dtypes: dict[str, str] | None = None) -> Buffers:
    """A Buffers of zeroed arrays from `arena`, each counted under `kind` (in its dtype, or as `dtypes` says)."""
    return Buffers(
        **{
            name: arena.take(kind, shape, dtype_of(name, dtypes or {}, arena.dtypes[kind], arena.dtypes["optimizer"]))
            for name, shape in shapes.items()
        }
    )


def nbytes(shapes: dict[str, tuple], dtypes: dict[str, str], itemsize: int, state_itemsize: int) -> int:
    """Bytes of arrays of these shapes: `itemsize` each element, but as `dtypes` says (see take)."""
    sizes = {"index": INDEX.itemsize, "state": state_itemsize}
    return sum(
        int(math.prod(shape)) * sizes.get(dtypes.get(name, ""), itemsize)  # math's: numpy's costs 30x
        for name, shape in shapes.items()
    )


def elements(shapes: dict[str, tuple]) -> int:
    """How many elements arrays of these shapes hold."""
    return sum(int(math.prod(shape)) for shape in shapes.values())
