"""The fields of one training run: the model's sizes, the batch, the optimizer's, the loop's, each also a training
flag (spmd.harness.net_flags builds the flags from them), and what follows from them alone. spmd.model.config's
Net adds the model's spec (the registry's), which checks them and draws the initial units and the data; the
specs and the oracles read a run through these fields, below the registry that the Net imports.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field

import numpy as np

from spmd.model.llama import EXPERT_ACTIVATIONS, ROUTERS
from spmd.model.optimizers import OPTIMIZERS, AdamW
from spmd.model.precision import PRECISIONS, Precision

DTYPES = ("float64", "float32")
LR_SCHEDULES = ("constant", "cosine")
PIPELINE_MICROBATCHES_PER_STAGE = 2  # a pipeline's default: 2 p micro-batches, bubble (p-1)/(3p-1)


def flag(default, group: str, help: str, **argparse_options):
    """A field that is also a training flag (--name-with-dashes), in one of FLAG_GROUPS: its help, and the
    argparse options beyond the type its default gives (choices, metavar; cli_default: the flag's own default
    where the command fills the field itself, as --microbatches from the pipeline's stages)."""
    return field(default=default, metadata={"group": group, "help": help, **argparse_options})


# the groups a training command's --help shows the flags in, by the key each field's flag() names
FLAG_GROUPS = {
    "shape": "the model and the batch",
    "optimizer": "the optimizer and precision",
    "lm": "the language model (--model llama)",
    "moe": "a mixture of experts (--model llama --experts E: Grok-1's, Mixtral's layer)",
    "loop": "the training loop",
}


@dataclass(frozen=True)
class NetFields:
    """The fields, each a flag; what follows from them alone (the model's spec is the Net's)."""

    model: str = flag("mlp", "shape", "the model, written once for every layout")  # its choices: the Net's
    layers: int = flag(4, "shape", "L (default %(default)s)")
    hidden: int = flag(64, "shape", "h (default %(default)s)")
    ffn: int = flag(256, "shape", "f (default %(default)s)")
    heads: int = flag(4, "shape", "attention heads (default %(default)s)")
    seq: int = flag(8, "shape", "tokens a sequence (default %(default)s)")
    batch: int = flag(8, "shape", "sequences a step (default %(default)s)")
    microbatches: int = flag(
        1,
        "shape",
        f"micro-batches a step (default {PIPELINE_MICROBATCHES_PER_STAGE} per pipeline stage, 1 without a "
        "pipeline: more is gradient accumulation)",
        cli_default=None,
    )
    chunks: int = flag(1, "shape", "model chunks per pipeline rank (default 2 with interleaved-1f1b)", cli_default=None)
    steps: int = flag(2, "shape", "optimizer steps")
    dtype: str = flag("float64", "shape", "every array's (see --precision)", choices=DTYPES)
    lr: float | None = flag(
        None,
        "optimizer",
        "learning rate > 0 (default: AdamW 1e-3; SGD 0.2 / (tokens x hidden) on the dense models' summed loss, "
        "0.5 on the LM's mean token loss)",
        type=float,
    )
    momentum: float = flag(0.5, "optimizer", "in [0, 1)")
    integers: bool = flag(
        False, "shape", "--model mlp: small integer data and weights, so every mesh is bitwise equal to one device"
    )
    seed: int = flag(0, "shape", "the initial weights' and the synthetic data's")
    optimizer: str = flag(
        "sgd",
        "optimizer",
        "sgd (with --momentum) or adamw (bias-corrected, decoupled --weight-decay)",
        choices=OPTIMIZERS,
    )
    precision: str = flag(  # "" follows dtype (float64: fp64, float32: fp32)
        "",
        "optimizer",
        "fp64 or fp32 (as --dtype), or mixed: fp16 or bf16 compute with fp32 master weights, optimizer state and "
        "gradient reductions",
        choices=PRECISIONS,
    )
    reduce_dtype: str = flag(  # "": fp32
        "",
        "optimizer",
        "mixed precision: the gradients' dtype, accumulated and reduced in it (default fp32)",
        choices=PRECISIONS,
    )
    weight_decay: float = flag(0.01, "optimizer", "AdamW's, decoupled (default 0.01)")
    # the language model's (llama): vocabulary, grouped-query kv heads (0: as many as --heads), one weight for
    # embedding and head, RoPE's base, RMSNorm's epsilon
    vocab: int = flag(
        64,
        "lm",
        "tokens (default 64, or with --data its tokenizer's; any size over any tp: uneven vocabulary shards)",
        cli_default=None,
    )
    kv_heads: int = flag(
        0, "lm", "grouped-query attention's key/value heads, dividing --heads (default: as many as --heads)"
    )
    tie_embeddings: bool = flag(  # None: the model's default (its spec's tied_by_default), settled in __post_init__
        None,  # type: ignore[arg-type]
        "lm",
        "one weight for the embedding and the head (across pipeline stages: their gradients summed); default: "
        "tied for gpt2, untied for llama",
        action=argparse.BooleanOptionalAction,
    )
    rope_base: float = flag(10000.0, "lm", "RoPE's base (default 10000)")
    norm_eps: float = flag(1e-5, "lm", "RMSNorm's epsilon (default 1e-5)")
    # its mixture of experts (0: a dense FFN; spmd.model.moe): experts a token chooses, the router's scores,
    # gates renormalized over the chosen, the balancing loss's weight, the capacity factor (0: dropless)
    experts: int = flag(
        0, "moe", "SwiGLU experts in each block's FFN place, chosen by a router (default 0: a dense FFN)", metavar="E"
    )
    top_k: int = flag(2, "moe", "experts a token goes to (default 2); a tie goes to the lower expert", metavar="K")
    router: str = flag("softmax", "moe", "the router's scores (default softmax)", choices=ROUTERS)
    renormalize: bool = flag(
        False, "moe", "divide a token's gates by their sum (default: Grok-1's gates, the scores as they are)"
    )
    aux_loss: float = flag(
        0.0,
        "moe",
        "the Switch/GShard balancing loss's weight (alpha at perfect balance; default 0: off)",
        metavar="ALPHA",
    )
    capacity_factor: float = flag(
        0.0,
        "moe",
        "an expert takes at most ceil(seq K / E CF) tokens of a sequence, the earliest (default 0: dropless)",
        metavar="CF",
    )
    bias_balance: float = flag(
        0.0,
        "moe",
        "DeepSeek-V3's balancing without a loss: a bias per layer and expert that only chooses, moved by GAMMA "
        "after each step toward the mean load (default 0: off)",
        metavar="GAMMA",
    )
    expert_activation: str = flag(
        "silu",
        "moe",
        "the experts' gate: silu (SwiGLU) or gelu (Grok-1's gated GELU, tanh approximation; default silu)",
        choices=EXPERT_ACTIVATIONS,
    )
    moe_every: int = flag(
        1,
        "moe",
        "the experts in layers 0, N, 2N, ... only, the others dense (Megatron's --moe-layer-freq; default 1: "
        "every layer)",
        metavar="N",
    )
    # the training loop's: global gradient-norm clipping (0: off), the learning-rate schedule
    clip_grad: float = flag(
        0.0,
        "loop",
        "clip the global gradient norm (every parameter once over the mesh) to NORM; the norm is reported every "
        "step (default 0: off)",
        metavar="NORM",
    )
    lr_schedule: str = flag(
        "constant",
        "loop",
        "after --warmup: constant, or a cosine from --lr to --lr-min at the last step",
        choices=LR_SCHEDULES,
    )
    warmup: int = flag(0, "loop", "steps of linear warmup from 0 to --lr (default 0)")
    lr_min: float = flag(0.0, "loop", "the cosine's last learning rate (default 0)")

    def check_numbers(self) -> None:
        """The fields every model reads, each in its range, naming its flag."""
        if not 0 <= self.weight_decay < 1:
            raise ValueError(f"--weight-decay must be in [0, 1), got {self.weight_decay}")
        # --batch before --microbatches: a command's default micro-batches derive from the batch (0 rows give 0)
        for name in ("layers", "hidden", "ffn", "batch", "microbatches", "chunks", "steps", "heads", "seq"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"--momentum must be in [0, 1), got {self.momentum}")
        if self.seed < 0:
            raise ValueError(f"--seed must be >= 0, got {self.seed}")
        if self.clip_grad < 0 or not np.isfinite(self.clip_grad):
            raise ValueError(f"--clip-grad must be a norm >= 0 (0: off), got {self.clip_grad}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"--lr-schedule must be one of {', '.join(LR_SCHEDULES)}, got {self.lr_schedule!r}")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0 steps, got {self.warmup}")

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @property
    def rate(self) -> float:
        """The learning rate (lr, its default filled in)."""
        assert self.lr is not None
        return self.lr

    def rate_at(self, step: int) -> float:
        """The learning rate of optimizer step `step` (1-based): linear warmup over --warmup steps, then constant
        or a cosine from lr down to --lr-min at the last step."""
        if step <= self.warmup:
            return self.rate * step / self.warmup
        if self.lr_schedule == "constant":
            return self.rate
        span = max(self.steps - self.warmup, 1)
        progress = min((step - self.warmup) / span, 1.0)
        return self.lr_min + 0.5 * (self.rate - self.lr_min) * (1 + math.cos(math.pi * progress))

    @property
    def kv(self) -> int:
        """Key/value heads (grouped-query attention; as many as query heads unless --kv-heads says)."""
        return self.kv_heads or self.heads

    def batch_of(self, rows: np.ndarray) -> int:
        """How many sequences `rows` (rows x hidden, whole sequences) holds."""
        return rows.shape[0] // self.seq

    @property
    def head_size(self) -> int:
        return self.hidden // self.heads

    @property
    def policy(self) -> Precision:
        return Precision(self.precision, self.reduce_dtype)

    @property
    def itemsize(self) -> int:
        """Bytes of a compute element (parameters, activations)."""
        return self.policy.compute.itemsize

    def adamw_at(self, step: int) -> AdamW:
        return AdamW(self.rate_at(step), weight_decay=self.weight_decay)
