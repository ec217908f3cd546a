"""The Llama-style language model's parameters: its units, each unit's flat layout, tensor slices, initial values.

A model is units, each one flat vector (the thing FSDP/ZeRO shard, gather and reduce): unit 0 the token
embedding E (V, h); units 1..L the decoder blocks; unit L+1 the final RMSNorm's gain (h); unit L+2 the LM head
W (V, h), stored as nn.Linear stores it (logits = x W^T), so that embedding and head split the vocabulary the
same way (rows) and a tied head is the embedding's own layout. A block is
    [g1 (h), Wq (h, a d), Wk (h, kv d), Wv (h, kv d), Wo (a d, h), g2 (h), W1 (h, f), W3 (h, f), W2 (f, h)]
with W1 (gate) and W3 (up) stored apart (never fused), so a tensor slice takes the same channels of both.
With --experts E (a mixture of experts: spmd.model.moe) the FFN part is [g2, Wr (h, E), W1 (E, h, f), W3 (E, h, f),
W2 (E, f, h)]: the router, then each expert's SwiGLU weights stacked; a tensor slice takes the same ffn channels
of every expert and the whole router. Over ep rank e holds experts block e of E / ep (its slice stacks only
those): everything before W1 is the block's dense prefix, the same on every ep rank.
Under TP rank j holds kv heads block_range(kv, t, j) with their query groups (a/kv query heads each), the
same columns of Wq / Wk / Wv and rows of Wo, its ffn columns of W1, W3 and rows of W2, and vocabulary rows
block_range(V, t, j) of E and W (uneven shards allowed); gains whole.
Initialization (GPT-2 / Megatron's): gains 1; every matrix N(0, 0.02), the router's too (Grok-1 starts it at
zero, where every score ties); the residual outputs Wo and W2 N(0, 0.02 / sqrt(2 L)).
"""

from __future__ import annotations

import math

import numpy as np

from spmd.layout import block_range
from spmd.model.params import Flat, Piece, Table

STD = 0.02  # the matrices' initial standard deviation


def llama_ffn(hidden: int, multiple_of: int = 256, multiplier: float | None = None) -> int:
    """Llama's SwiGLU width: 2/3 of 4h (the same parameters as a 4h MLP with two matrices), times
    ffn_dim_multiplier when given, rounded up to a multiple of multiple_of."""
    f = int(2 * 4 * hidden / 3)
    if multiplier is not None:
        f = int(multiplier * f)
    return multiple_of * math.ceil(f / multiple_of)


def is_moe(net, layer: int) -> bool:
    """Whether decoder layer `layer` (from 0) has a mixture of experts: every --moe-every-th from the first
    (Megatron's --moe-layer-freq), when there are --experts."""
    return bool(net.experts) and layer % net.moe_every == 0


def unit_kinds(net) -> list[str]:
    """embed, then each layer ("moe" for a mixture of experts, else "block"), norm, head."""
    return ["embed", *("moe" if is_moe(net, i) else "block" for i in range(net.layers)), "norm", "head"]


def unit_kind(net, unit: int) -> str:
    """unit_kinds(net)[unit]."""
    if not 0 <= unit < net.layers + 3:
        raise IndexError(f"unit {unit} is outside 0..{net.layers + 2}")
    if unit == 0:
        return "embed"
    if unit > net.layers:
        return "norm" if unit == net.layers + 1 else "head"
    return "moe" if is_moe(net, unit - 1) else "block"


def table(net, kind: str) -> Table:
    """A unit's parameter table, whole: each piece's name, shape and splits in the unit's flat order."""
    h, d, f = net.hidden, net.head_size, net.ffn
    if kind in ("embed", "head"):
        return (Piece("embedding" if kind == "embed" else "lm_head", (net.vocab, h), ("vocab", None)),)
    if kind == "norm":
        return (Piece("final_norm", (h,)),)
    q, kv = net.heads * d, net.kv * d
    attention = (
        Piece("g1", (h,)),
        Piece("wq", (h, q), (None, "heads")),
        Piece("wk", (h, kv), (None, "kv")),
        Piece("wv", (h, kv), (None, "kv")),
        Piece("wo", (q, h), ("heads", None)),
        Piece("g2", (h,)),
    )
    if kind == "moe":  # the router whole, the experts' weights stacked (their same channels split over tp)
        e = net.experts
        return (
            *attention,
            Piece("wr", (h, e)),
            Piece("w1", (e, h, f), ("experts", None, "ffn")),
            Piece("w3", (e, h, f), ("experts", None, "ffn")),
            Piece("w2", (e, f, h), ("experts", "ffn", None)),
        )
    return (
        *attention,
        Piece("w1", (h, f), (None, "ffn")),
        Piece("w3", (h, f), (None, "ffn")),
        Piece("w2", (f, h), ("ffn", None)),
    )


# the parameter table's rows (python -m spmd.plan), in order: each piece's label by its name
LABELS = {
    "embedding": "embedding (V x h)",
    "wq": "attention Wq (h x H*Q)",
    "wk": "attention Wk (h x kv*Q)",
    "wv": "attention Wv (h x kv*Q)",
    "wo": "attention Wo (H*Q x h)",
    "w1": "SwiGLU W1 (h x f, gate)",
    "w3": "SwiGLU W3 (h x f, up)",
    "w2": "SwiGLU W2 (f x h, down)",
    "wr": "router (h x E)",
    "g1": "norms (2 RMSNorm of h)",
    "g2": "norms (2 RMSNorm of h)",
    "final_norm": "final norm (RMSNorm of h)",
    "lm_head": "LM head (h x V)",
}


def labels(net) -> list[str]:
    """The parameter table's rows in order."""
    return list(dict.fromkeys(label(net, name) for name in LABELS))


def label(net, name: str) -> str:
    """A piece's row in the parameter table: stacked experts' and a tied head's said so."""
    if name == "lm_head" and net.tie_embeddings:
        return "LM head (tied: the embedding)"
    if name in ("w1", "w3", "w2") and net.experts:
        return LABELS[name].replace("SwiGLU", "experts").replace("(", "(E x ")
    return LABELS[name]


def tensor_share(net, t: int, j: int, ep: int = 1, e: int = 0) -> dict[str, tuple[int, int]]:
    """Tensor rank j of t's (and ep rank e of ep's) ranges: kv heads, query heads (their groups), ffn channels,
    vocabulary rows, experts."""
    group = net.heads // net.kv
    k0, k1 = block_range(net.kv, t, j)
    return {
        "kv": (k0, k1),
        "heads": (k0 * group, k1 * group),
        "ffn": block_range(net.ffn, t, j),
        "vocab": block_range(net.vocab, t, j),
        "experts": block_range(net.experts, ep, e),
    }


def cut(net, t: int, j: int, ep: int = 1, e: int = 0) -> dict[str, tuple[int, int]]:
    """Tensor rank j's (and ep rank e's) ranges of the table's splits, heads and kv heads as columns."""
    share, d = tensor_share(net, t, j, ep, e), net.head_size
    columns = lambda key: (share[key][0] * d, share[key][1] * d)  # noqa: E731
    return {"heads": columns("heads"), "kv": columns("kv"), **{k: share[k] for k in ("ffn", "vocab", "experts")}}


def initial_unit(net, unit: int) -> np.ndarray:
    """Unit `unit`'s flat parameters at step 0: the same on every rank, for every mesh. A tied head starts as the
    embedding (and stays equal to it: their gradients are summed)."""
    kind = unit_kinds(net)[unit]
    if kind == "head" and net.tie_embeddings:
        return initial_unit(net, 0)
    rng = np.random.default_rng((net.seed, 5, unit))
    layout = Flat(table(net, kind))
    flat = np.empty(layout.size, dtype=net.dtype)
    if kind == "norm":
        flat[...] = 1
    elif kind in ("embed", "head"):
        flat[...] = STD * rng.standard_normal(flat.size)
    else:
        initialize_block(layout.named(flat), rng, net.layers)
    return flat


def initialize_block(pieces: dict[str, np.ndarray], rng: np.random.Generator, layers: int) -> None:
    """A block's pieces by name, in their flat order: gains (g...) 1, matrices (w...) N(0, 0.02), the residual
    outputs Wo and W2 N(0, 0.02 / sqrt(2 L)), biases 0 (GPT-2's and Megatron's)."""
    residual = STD / np.sqrt(2 * layers)
    for name, view in pieces.items():
        if name[0] == "g":
            view[...] = 1
        elif name[0] == "w":
            view[...] = (residual if name in ("wo", "w2") else STD) * rng.standard_normal(view.shape)
        else:
            view[...] = 0


def check_llama(net) -> None:
    """Every reason the LM's sizes cannot work, naming the flag."""
    if net.vocab < 2:
        raise ValueError(f"--vocab must be >= 2 tokens, got {net.vocab}")
    if net.hidden % net.heads:
        raise ValueError(f"--hidden {net.hidden} must be a multiple of --heads {net.heads} (head size h/a)")
    if net.head_size % 2:
        raise ValueError(f"--hidden / --heads = {net.head_size}: RoPE rotates pairs, the head size must be even")
    if not 1 <= net.kv <= net.heads or net.heads % net.kv:
        raise ValueError(f"--kv-heads {net.kv_heads} must divide --heads {net.heads} (each kv head serves a group)")
    if net.integers:
        raise ValueError("--integers is for the MLP: softmax's exp makes no integer exact")
    if not net.norm_eps > 0:
        raise ValueError(f"--norm-eps must be > 0, got {net.norm_eps}")
    if not (net.rope_base > 0 and np.isfinite(net.rope_base)):
        raise ValueError(f"--rope-base must be a number > 0, got {net.rope_base}")
    check_experts(net)


ROUTERS = ("softmax", "sigmoid")
EXPERT_ACTIVATIONS = ("silu", "gelu")  # SwiGLU's, Grok-1's gated GELU (tanh approximation, as jax.nn.gelu)


def check_experts(net) -> None:
    """Every reason the mixture-of-experts flags cannot work, naming the flag."""
    if net.experts < 0 or net.experts == 1:
        raise ValueError(f"--experts must be 0 (a dense FFN) or >= 2, got {net.experts}")
    if not net.experts:
        moe = {name: getattr(net, name) for name, default in MOE_FIELDS.items() if getattr(net, name) != default}
        if moe:
            flags = ", ".join("--" + name.replace("_", "-") for name in moe)
            raise ValueError(f"{flags}: a mixture of experts' flags, add --experts E")
        return
    if net.moe_every < 1:
        raise ValueError(f"--moe-every must be >= 1 (every layer: 1), got {net.moe_every}")
    if not 1 <= net.top_k <= net.experts:
        raise ValueError(f"--top-k must be in [1, --experts {net.experts}], got {net.top_k}")
    if net.router not in ROUTERS:
        raise ValueError(f"--router must be one of {', '.join(ROUTERS)}, got {net.router!r}")
    if net.expert_activation not in EXPERT_ACTIVATIONS:
        raise ValueError(
            f"--expert-activation must be one of {', '.join(EXPERT_ACTIVATIONS)}, got {net.expert_activation!r}"
        )
    if not (net.aux_loss >= 0 and np.isfinite(net.aux_loss)):
        raise ValueError(f"--aux-loss must be a weight >= 0 (0: off), got {net.aux_loss}")
    if not (net.capacity_factor >= 0 and np.isfinite(net.capacity_factor)):
        raise ValueError(f"--capacity-factor must be >= 0 (0: dropless), got {net.capacity_factor}")
    if not (net.bias_balance >= 0 and np.isfinite(net.bias_balance)):
        raise ValueError(f"--bias-balance must be a step >= 0 (0: off), got {net.bias_balance}")


MOE_FIELDS = {
    "top_k": 2,
    "router": "softmax",
    "renormalize": False,
    "aux_loss": 0.0,
    "capacity_factor": 0.0,
    "bias_balance": 0.0,
    "expert_activation": "silu",
    "moe_every": 1,
}
LM_FIELDS = {
    "vocab": 64,
    "kv_heads": 0,
    "tie_embeddings": False,
    "rope_base": 10000.0,
    "norm_eps": 1e-5,
    "experts": 0,
    **MOE_FIELDS,
}


def check_not_lm(net) -> None:
    """A model without tokens refuses the language model's flags (they would be silently ignored)."""
    given = [name for name, default in LM_FIELDS.items() if getattr(net, name) != default]
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise ValueError(f"{flags}: the language model's (--model llama), not the {net.model}'s")
