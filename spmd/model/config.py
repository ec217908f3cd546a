"""One training run's model and data: which block, its sizes, the batch, the optimizer's constants.

The MLP layer is spmd's MLP (Y = X + relu((X g) W1) W2). The transformer layer is pre-norm:
H = X + Attn(X g1), Y = H + relu((H g2) W1) W2, with causal multi-head self-attention
Attn(Z) = concat_j softmax(Q_j K_j^T / sqrt(d) + causal) V_j Wo, Q = Z Wq, K = Z Wk, V = Z Wv.
The norms are gain-only (a per-channel weight, the part of RMSNorm that parallelism must handle:
replicated under TP, its gradient all-reduced under SP); the normalization itself is left out so
the MLP keeps exact integer steps. A batch is `batch` sequences of `seq` tokens; data and pipeline
parallelism split whole sequences (attention mixes a sequence's tokens), SP splits token rows.

A layer's parameters are one flat vector, the unit FSDP/ZeRO shards: MLP [W1, W2, g]; transformer
[g1, Wq, Wk, Wv, Wo, W1, W2, g2] (its MLP part has the MLP layer's layout).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field

import numpy as np

from spmd.model import gpt2, llama
from spmd.model.llama import EXPERT_ACTIVATIONS, ROUTERS, check_llama, check_not_lm
from spmd.model.optimizers import OPTIMIZERS, AdamW
from spmd.model.precision import NAME_OF, PRECISIONS, Precision
from spmd.model.tokens import token_batch
from spmd.workloads.mlp import DTYPES, MLP

MODELS = ("mlp", "transformer", "llama", "gpt2")
LANGUAGE_MODELS = ("llama", "gpt2")  # trained on token ids, with a mean token loss
TIED_BY_DEFAULT = ("gpt2",)  # GPT-2 ties its embedding and head; the Llama does not
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
class Net:
    model: str = flag("mlp", "shape", "the model, written once for every layout", choices=MODELS)
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
    tie_embeddings: bool = flag(  # None: the model's default (TIED_BY_DEFAULT), settled in __post_init__
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

    def __post_init__(self):
        if self.tie_embeddings is None:
            object.__setattr__(self, "tie_embeddings", self.model in TIED_BY_DEFAULT)
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
        if not 0 <= self.weight_decay < 1:
            raise ValueError(f"--weight-decay must be in [0, 1), got {self.weight_decay}")
        if self.model not in MODELS:
            raise ValueError(f"--model must be one of {', '.join(MODELS)}, got {self.model!r}")
        for name in ("heads", "seq", "batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.model == "transformer" and self.hidden % self.heads:
            raise ValueError(f"--hidden {self.hidden} must be a multiple of --heads {self.heads} (head size h/a)")
        if self.model == "transformer" and self.integers:
            raise ValueError("--integers is for the MLP: softmax's exp makes no integer exact")
        if self.model == "llama":
            check_llama(self)
        elif self.model == "gpt2":
            gpt2.check_gpt2(self)
        else:
            check_not_lm(self)
        if self.clip_grad < 0 or not np.isfinite(self.clip_grad):
            raise ValueError(f"--clip-grad must be a norm >= 0 (0: off), got {self.clip_grad}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"--lr-schedule must be one of {', '.join(LR_SCHEDULES)}, got {self.lr_schedule!r}")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0 steps, got {self.warmup}")
        if self.lr is None and self.model in LANGUAGE_MODELS:  # the mean token loss: a rate of the field's size
            object.__setattr__(self, "lr", 1e-3 if self.optimizer == "adamw" else 0.5)
        if self.lr is None:  # SGD on the summed loss: scaled by its size; Adam is invariant to the scale
            object.__setattr__(self, "lr", 1e-3 if self.optimizer == "adamw" else 0.2 / (self.tokens * self.hidden))
        if not 0 <= self.lr_min <= self.rate:
            raise ValueError(f"--lr-min must be in [0, --lr {self.rate:g}], got {self.lr_min}")
        if self.lr_min and self.lr_schedule != "cosine":
            raise ValueError("--lr-min is where --lr-schedule cosine ends: add --lr-schedule cosine")
        self.as_mlp()  # the rest (sizes, dtype, lr, momentum, seed, integer exactness) is checked as the MLP's

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

    @property
    def layer_size(self) -> int:
        return layer_size(self.model, self.hidden, self.ffn, self.hidden)

    def as_mlp(self) -> MLP:
        """The same run as spmd's MLP workload (one token a row, the same weights and data)."""
        return MLP(
            layers=self.layers,
            hidden=self.hidden,
            ffn=self.ffn,
            tokens=self.tokens,
            microbatches=self.microbatches,
            chunks=self.chunks,
            steps=self.steps,
            dtype=self.dtype,
            lr=self.lr,
            momentum=self.momentum,
            integers=self.integers,
            seed=self.seed,
        )

    def initial_layer(self, layer: int) -> np.ndarray:
        """Layer `layer`'s flat parameters at step 0: the same on every rank, for every mesh."""
        if self.model in LANGUAGE_MODELS:
            return (gpt2 if self.model == "gpt2" else llama).initial_unit(self, layer)
        if self.model == "mlp":
            return self.as_mlp().initial_layer(layer)
        h, f = self.hidden, self.ffn
        rng = np.random.default_rng((self.seed, 3, layer))
        flat = np.empty(self.layer_size, dtype=self.dtype)
        g1, wq, wk, wv, wo, w1, w2, g2 = transformer_views(flat, h, f, h)
        g1[...], g2[...] = 1 + 0.1 * rng.standard_normal(h), 1 + 0.1 * rng.standard_normal(h)
        for w in (wq, wk, wv):
            w[...] = rng.standard_normal((h, h)) / np.sqrt(h)
        wo[...] = rng.standard_normal((h, h)) / np.sqrt(2 * h * self.layers)
        w1[...] = rng.standard_normal((h, f)) / np.sqrt(h)
        w2[...] = rng.standard_normal((f, h)) / np.sqrt(2 * f * self.layers)
        return flat

    def batch_data(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(X, target) of step `step`, each (batch x seq, hidden), sequence after sequence; the LM's (token ids,
        next tokens), each (batch x seq,)."""
        if self.model in LANGUAGE_MODELS:
            return token_batch(self.vocab, self.batch, self.seq, self.seed, step)
        return self.as_mlp().batch(step)


def layer_size(model: str, hidden: int, ffn: int, attention: int) -> int:
    """Elements of a layer's flat vector; `attention` is the width of Q/K/V (h, or a TP rank's heads x d)."""
    mlp = 2 * hidden * ffn + hidden
    return mlp if model == "mlp" else mlp + hidden + 4 * hidden * attention


def mlp_views(flat: np.ndarray, hidden: int, ffn: int):
    """(W1 (h, f), W2 (f, h), g (h,)) of an MLP layer's flat vector."""
    hf = hidden * ffn
    return flat[:hf].reshape(hidden, ffn), flat[hf : 2 * hf].reshape(ffn, hidden), flat[2 * hf : 2 * hf + hidden]


def transformer_views(flat: np.ndarray, hidden: int, ffn: int, attention: int):
    """(g1, Wq, Wk, Wv (h, w), Wo (w, h), W1, W2, g2) of a transformer layer; w = `attention`."""
    h, w = hidden, attention
    g1 = flat[:h]
    at = h + h * w
    wq, wk, wv = (flat[h + i * h * w : at + i * h * w].reshape(h, w) for i in range(3))
    wo = flat[h + 3 * h * w : h + 4 * h * w].reshape(w, h)
    w1, w2, g2 = mlp_views(flat[h + 4 * h * w :], hidden, ffn)
    return g1, wq, wk, wv, wo, w1, w2, g2


def tensor_slice(net: Net, heads: tuple[int, int], ffn: tuple[int, int]) -> np.ndarray:
    """Where a tensor-parallel rank's slice lives in the full flat layer: its heads' columns of Wq, Wk, Wv
    and rows of Wo, its ffn columns of W1 and rows of W2; the gains whole. The slice has the layout of a
    layer with attention width (heads) x d and ffn share, so the block runs on it unchanged."""
    index = np.arange(net.layer_size)
    h, f, d = net.hidden, net.ffn, net.head_size
    (f0, f1), (c0, c1) = ffn, (heads[0] * d, heads[1] * d)
    if net.model == "mlp":
        w1, w2, g = mlp_views(index, h, f)
        return np.concatenate([w1[:, f0:f1].ravel(), w2[f0:f1].ravel(), g])
    g1, wq, wk, wv, wo, w1, w2, g2 = transformer_views(index, h, f, h)
    return np.concatenate(
        [
            g1,
            *(w[:, c0:c1].ravel() for w in (wq, wk, wv)),
            wo[c0:c1].ravel(),
            w1[:, f0:f1].ravel(),
            w2[f0:f1].ravel(),
            g2,
        ]
    )
