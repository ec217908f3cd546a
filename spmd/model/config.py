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

import math
from dataclasses import dataclass

import numpy as np

from spmd.model import llama
from spmd.model.llama import check_llama, check_not_lm
from spmd.model.optimizers import OPTIMIZERS, AdamW
from spmd.model.precision import NAME_OF, Precision
from spmd.model.tokens import token_batch
from spmd.workloads.mlp import MLP

MODELS = ("mlp", "transformer", "llama")
LR_SCHEDULES = ("constant", "cosine")


@dataclass(frozen=True)
class Net:
    model: str = "mlp"
    layers: int = 4
    hidden: int = 64
    ffn: int = 256
    heads: int = 4
    seq: int = 8
    batch: int = 8
    microbatches: int = 1
    chunks: int = 1
    steps: int = 2
    dtype: str = "float64"
    lr: float | None = None
    momentum: float = 0.5
    integers: bool = False
    seed: int = 0
    optimizer: str = "sgd"  # optimizers.OPTIMIZERS
    precision: str = ""  # precision.PRECISIONS; "" follows dtype (float64: fp64, float32: fp32)
    reduce_dtype: str = ""  # the gradients' dtype under mixed precision ("": fp32)
    weight_decay: float = 0.01  # AdamW's, decoupled
    # the language model's (llama): vocabulary, grouped-query kv heads (0: as many as --heads), one weight for
    # embedding and head, RoPE's base, RMSNorm's epsilon
    vocab: int = 64
    kv_heads: int = 0
    tie_embeddings: bool = False
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    # its mixture of experts (0: a dense FFN; spmd.model.moe): experts a token chooses, the router's scores,
    # gates renormalized over the chosen, the balancing loss's weight, the capacity factor (0: dropless)
    experts: int = 0
    top_k: int = 2
    router: str = "softmax"
    renormalize: bool = False
    aux_loss: float = 0.0
    capacity_factor: float = 0.0
    bias_balance: float = 0.0  # DeepSeek-V3's auxiliary-loss-free balancing: the bias's step (0: off)
    expert_activation: str = "silu"  # the experts' gate: SwiGLU's silu, or Grok-1's gelu (tanh approximation)
    moe_every: int = 1  # layer i (from 0) is a mixture of experts when i % moe_every == 0, else dense
    # the training loop's: global gradient-norm clipping (0: off), the learning-rate schedule
    clip_grad: float = 0.0
    lr_schedule: str = "constant"
    warmup: int = 0
    lr_min: float = 0.0

    def __post_init__(self):
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
        else:
            check_not_lm(self)
        if self.clip_grad < 0 or not np.isfinite(self.clip_grad):
            raise ValueError(f"--clip-grad must be a norm >= 0 (0: off), got {self.clip_grad}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"--lr-schedule must be one of {', '.join(LR_SCHEDULES)}, got {self.lr_schedule!r}")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0 steps, got {self.warmup}")
        if self.lr is None and self.model == "llama":  # the mean token loss: a rate of the field's size
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
        if self.model == "llama":
            return llama.initial_unit(self, layer)
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
        if self.model == "llama":
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
