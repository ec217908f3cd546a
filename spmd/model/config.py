"""One training run's model and data: which model, its sizes, the batch, the optimizer's constants.

The models are spmd.model.registry's MODELS (the MLP, the pre-norm transformer, the Llama-style and the
GPT-2-style LM): each one's spec checks the fields it takes, says its default learning rate and whether its
embedding is tied, and draws its initial units and batches; nothing here tests a model's name. A batch is
`batch` sequences of `seq` tokens; data and pipeline parallelism split whole sequences (attention mixes a
sequence's tokens), SP splits token rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from spmd.model.fields import DTYPES, FLAG_GROUPS, PIPELINE_MICROBATCHES_PER_STAGE, NetFields, flag
from spmd.model.optimizers import OPTIMIZERS
from spmd.model.precision import NAME_OF, Precision
from spmd.model.registry import MODELS

__all__ = ["DTYPES", "FLAG_GROUPS", "PIPELINE_MICROBATCHES_PER_STAGE", "Net", "flag"]


@dataclass(frozen=True)
class Net(NetFields):
    """A run's fields with its model's spec: checked by the spec when made, every derived default filled in."""

    model: str = flag("mlp", "shape", "the model, written once for every layout", choices=tuple(MODELS))

    def __post_init__(self):
        if self.model not in MODELS:
            raise ValueError(f"--model must be one of {', '.join(MODELS)}, got {self.model!r}")
        if self.tie_embeddings is None:
            object.__setattr__(self, "tie_embeddings", self.spec.tied_by_default)
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if not self.precision:
            object.__setattr__(self, "precision", NAME_OF.get(self.dtype, self.dtype))
        policy = Precision(self.precision, self.reduce_dtype)  # checks both names
        # the initial values and the data: the precision's own dtype, or the fp32 master's under mixed precision
        object.__setattr__(self, "dtype", "float32" if policy.mixed else str(policy.compute))
        if self.integers and (policy.mixed or self.optimizer != "sgd"):
            raise ValueError(
                "--integers needs --optimizer sgd and --precision fp64 or fp32: Adam's square root "
                "and 16-bit rounding make no integer exact"
            )
        self.check_numbers()
        if self.lr is None:  # Adam is invariant to the loss's scale; SGD's rate is the model's (a sum or a mean)
            object.__setattr__(self, "lr", 1e-3 if self.optimizer == "adamw" else self.spec.sgd_lr(self))
        if not (np.isfinite(self.rate) and self.rate > 0):
            raise ValueError(f"--lr must be a finite number > 0, got {self.lr}")
        if not 0 <= self.lr_min <= self.rate:
            raise ValueError(f"--lr-min must be in [0, --lr {self.rate:g}], got {self.lr_min}")
        if self.lr_min and self.lr_schedule != "cosine":
            raise ValueError("--lr-min is where --lr-schedule cosine ends: add --lr-schedule cosine")
        self.spec.check(self)

    @property
    def spec(self):
        """The model's spec in the registry (spmd.model.registry): what the engine, cost and planner ask."""
        return MODELS[self.model]

    @property
    def layer_size(self) -> int:
        """Elements of a block's flat vector, whole."""
        return self.spec.unit_size(
            self, self.spec.kinds(self)[self.spec.block_units(self)[0]], self.spec.share(self, 1, 0)
        )

    def initial_layer(self, layer: int) -> np.ndarray:
        """Unit `layer`'s flat parameters at step 0: the same on every rank, for every mesh."""
        return self.spec.initial_unit(self, layer)

    def batch_data(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(X, target) of step `step`, each (batch x seq, hidden), sequence after sequence; the LM's (token ids,
        next tokens), each (batch x seq,)."""
        return self.spec.batch_data(self, step)
