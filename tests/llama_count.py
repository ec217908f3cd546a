"""An independent count of Llama-style decoder sizes from a model's shape (parameters by kind, training flops per
token), written apart from the model's spec: the tests check the spec's counts (spmd.plan.lm_report) against it.

A Llama block is RMSNorm -> grouped-query attention (Wq: h x h, Wk and Wv: h x kv_heads * head_dim, Wo: h x h,
no biases) -> RMSNorm -> SwiGLU (W1 and W3: h x f, W2: f x h); the model is a token embedding (V x h), the
blocks, a final RMSNorm (h) and an LM head (h x V), untied in Llama 3. Each RMSNorm has one weight vector of h.
Rotary position embeddings have no parameters.
A mixture of experts (--experts E, Grok-1's layer) puts E SwiGLU FFNs and a router (h x E) in each block's FFN
place; a token passes through top_k of them, so its active parameters count top_k experts, not E.
"""

from __future__ import annotations

from dataclasses import dataclass

from spmd.model.llama import llama_ffn  # Llama's width rule (checked against the published widths)
from spmd.usage import UsageError

# (kind, the table's label, whether the kind is one per block)
KINDS = (
    ("embedding", "embedding (V x h)", False),
    ("attention.wq", "attention Wq (h x H*Q)", True),
    ("attention.wk", "attention Wk (h x kv*Q)", True),
    ("attention.wv", "attention Wv (h x kv*Q)", True),
    ("attention.wo", "attention Wo (H*Q x h)", True),
    ("swiglu.w1", "SwiGLU W1 (h x f, gate)", True),
    ("swiglu.w3", "SwiGLU W3 (h x f, up)", True),
    ("swiglu.w2", "SwiGLU W2 (f x h, down)", True),
    ("router", "router (h x E)", True),
    ("norms", "norms (2 RMSNorm of h)", True),
    ("final_norm", "final norm (RMSNorm of h)", False),
    ("lm_head", "LM head (h x V)", False),
)


@dataclass(frozen=True)
class LlamaShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tie_embeddings: bool = False
    context: int = 8192  # the sequence length a training step runs at
    experts: int = 0  # a mixture of experts in each FFN's place (0: dense)
    top_k: int = 2  # experts a token passes through

    def __post_init__(self):
        for flag in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "context"):
            value = getattr(self, flag)
            if not (isinstance(value, int) and value >= 1):
                name = "--seq" if flag == "context" else "--" + flag.replace("_", "-")
                raise UsageError(f"{name} must be a whole number >= 1, got {value}")
        if self.hidden % self.heads:
            raise UsageError(f"--hidden {self.hidden} is not a multiple of --heads {self.heads} (head dim h / heads)")
        if self.heads % self.kv_heads:
            raise UsageError(
                f"--heads {self.heads} is not a multiple of --kv-heads {self.kv_heads} "
                "(grouped-query attention shares each kv head among heads / kv-heads query heads)"
            )
        if self.experts and not 1 <= self.top_k <= self.experts:
            raise UsageError(f"--top-k must be in [1, --experts {self.experts}], got {self.top_k}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


PRESETS: dict[str, LlamaShape] = {
    # Meta's Llama 3 model card / params.json: ffn_dim_multiplier 1.3, multiple_of 1024 (8B) and 4096 (70B)
    "llama3-8b": LlamaShape(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256, context=8192),
    "llama3-70b": LlamaShape(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256, context=8192),
    # torchtitan's debug model: dim 256, 6 layers, 16 heads (kv heads = heads), vocab 2048, ffn by Llama's rule
    # with multiple_of 256 (768); its debug training runs at seq_len 2048
    "debug": LlamaShape(layers=6, hidden=256, heads=16, kv_heads=16, ffn=llama_ffn(256), vocab=2048, context=2048),
    # xai-org/grok-1's model.py: 64 layers, emb 6144, 48 query and 8 kv heads of 128, 8 experts top-2 of widening
    # factor 8 (32768 with its rounding), vocab 131072, seq 8192, the embedding tied to the head. Counted here with
    # spmd's block (2 RMSNorms, SwiGLU experts); Grok-1's 4 norms a block add 2 x 64 x 6144 = 0.8 M
    "grok-1": LlamaShape(
        layers=64,
        hidden=6144,
        heads=48,
        kv_heads=8,
        ffn=32768,
        vocab=131072,
        tie_embeddings=True,
        context=8192,
        experts=8,
        top_k=2,
    ),
}


def block_parameters(shape: LlamaShape) -> dict[str, int]:
    """One block's parameters by kind (a mixture of experts: every expert's SwiGLU, and the router)."""
    h, kv_width, f, e = shape.hidden, shape.kv_heads * shape.head_dim, shape.ffn, max(1, shape.experts)
    return {
        "attention.wq": h * h,
        "attention.wk": h * kv_width,
        "attention.wv": h * kv_width,
        "attention.wo": h * h,
        "swiglu.w1": e * h * f,
        "swiglu.w3": e * h * f,
        "swiglu.w2": e * f * h,
        "router": h * shape.experts,
        "norms": 2 * h,
    }


def llama_parameters(shape: LlamaShape) -> dict[str, int]:
    """Parameters by kind (the per-block kinds summed over the layers); a tied LM head adds none."""
    block = block_parameters(shape)
    embedding = shape.vocab * shape.hidden
    return {
        "embedding": embedding,
        **{kind: n * shape.layers for kind, n in block.items()},
        "final_norm": shape.hidden,
        "lm_head": 0 if shape.tie_embeddings else embedding,
    }


def total_parameters(shape: LlamaShape) -> int:
    return sum(llama_parameters(shape).values())


def flop_parameters(shape: LlamaShape) -> int:
    """The N of the flops convention: the active parameters but the input embedding table, plus the head's h x V."""
    return (
        active_parameters(shape)
        - shape.vocab * shape.hidden
        + (shape.vocab * shape.hidden if shape.tie_embeddings else 0)
    )


def flops_per_token(shape: LlamaShape, seq: int) -> int:
    """Training flops (forward + backward) per token at sequence length seq: 6N + 12 L H Q T, N counting a
    token's top_k experts only."""
    return 6 * flop_parameters(shape) + 12 * shape.layers * shape.heads * shape.head_dim * seq


def idle_parameters(shape: LlamaShape) -> int:
    """Parameters a token does not pass through: the experts it is not routed to (E - top_k a block)."""
    return (shape.experts - shape.top_k) * 3 * shape.hidden * shape.ffn * shape.layers if shape.experts else 0


def active_parameters(shape: LlamaShape) -> int:
    """Parameters a token passes through: all but the experts it is not routed to."""
    return total_parameters(shape) - idle_parameters(shape)


def resolve_shape(
    preset: str | None,
    layers: int | None = None,
    hidden: int | None = None,
    heads: int | None = None,
    kv_heads: int | None = None,
    ffn: int | None = None,
    vocab: int | None = None,
    seq: int | None = None,
    tie_embeddings: bool | None = None,
    experts: int | None = None,
    top_k: int | None = None,
) -> LlamaShape:
    """The preset's shape with every given flag in its place (and only those); without a preset, --layers,
    --hidden, --vocab and --seq are needed and the rest default as Llama's do: heads h / 128, kv heads = heads,
    ffn by Llama's rule, untied."""
    if preset is not None:
        if preset not in PRESETS:
            raise UsageError(f"--preset {preset!r} is not one of {', '.join(PRESETS)}")
        base = PRESETS[preset]
    else:
        for flag, value in (("--layers", layers), ("--hidden", hidden), ("--vocab", vocab), ("--seq", seq)):
            if value is None:
                raise UsageError(f"--model llama needs {flag} (or a --preset: {', '.join(PRESETS)})")
        assert layers is not None and hidden is not None and vocab is not None and seq is not None
        default_heads = heads if heads is not None else max(1, hidden // 128)
        kv = kv_heads if kv_heads is not None else default_heads
        base = LlamaShape(
            layers, hidden, default_heads, kv, ffn or llama_ffn(hidden), vocab, False, seq, experts or 0, top_k or 2
        )
    return LlamaShape(
        layers=base.layers if layers is None else layers,
        hidden=base.hidden if hidden is None else hidden,
        heads=base.heads if heads is None else heads,
        kv_heads=base.kv_heads if kv_heads is None else kv_heads,
        ffn=base.ffn if ffn is None else ffn,
        vocab=base.vocab if vocab is None else vocab,
        tie_embeddings=base.tie_embeddings if tie_embeddings is None else tie_embeddings,
        context=base.context if seq is None else seq,
        experts=base.experts if experts is None else experts,
        top_k=base.top_k if top_k is None else top_k,
    )
