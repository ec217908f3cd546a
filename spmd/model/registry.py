"""The model registry: everything the engine, the cost model, the checkpoint and the planner ask of a model.

A model is units (spmd.model.llama has the LM's: embedding, blocks, final norm, head), each one flat vector of
parameters. A spec answers, for a model: its units' kinds and their roles (the step table's rows), which are
blocks (the pipeline splits those), each kind's parameter table and a rank's cut of it (spmd.model.params;
Tabled derives from them a unit's size for a tensor rank's share, where that share lives in the full unit and
which of its elements a rank saves), its initial values, the code that computes it (a Block), the pairs of
units that are one tied weight, and each unit's tensor-axis communication points (the closed-form cost
multiplies them). Nothing outside spmd/model/ tests a model's name: adding a model is its files and one line in
MODELS below.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

import numpy as np

from spmd.layout import block_range
from spmd.model import dense, dense_reference, gpt2, gpt2_reference, llama, llama_reference, params
from spmd.model.blocks import BLOCK_KIND, BLOCK_KINDS, EMBED_KIND, EXPERT_KIND, Block, Role, Share
from spmd.model.decode import CachedDecoder, Decoder
from spmd.model.fields import NetFields
from spmd.model.gpt2_decode import GPT2Decoder
from spmd.model.llama_block import LlamaBlock
from spmd.model.mlp import MLPBlock
from spmd.model.moe import ExpertAxis, MoEFFN, SequenceAxis
from spmd.model.params import Cut, Table
from spmd.model.tokens import token_batch
from spmd.model.transformer import TransformerBlock
from spmd.model.vocab import Embedding, FinalNorm, Head


@dataclass(frozen=True)
class TensorPoints:
    """A unit's tensor-axis collectives per micro-batch. Under SP: all-gathers and reduce-scatters of its rows
    (h wide), all-reduces of a replicated gain's gradient (h elements); without: all-reduces of its rows (h
    wide); in both the loss's all-reduces (cross_entropy: a MAX of one element a row, a SUM of two) and a mixture
    of experts' gates' gradients (gates: top_k elements a row, all-reduced once in backward, in the state dtype)."""

    gathers: int = 0
    scatters: int = 0
    gains: int = 0
    reduces: int = 0
    cross_entropy: bool = False
    gates: int = 0


def block_points(passes: int, forwards: int, gates: int = 0) -> TensorPoints:
    """A block's points: per pass of the tensor axis, AG enter and RS leave in each forward; in backward AG dy, AG
    the input again, RS dx, AR the gain (under SP); without SP an AR of the rows for each forward and backward;
    a mixture of experts' `gates` (top_k)."""
    return TensorPoints(
        gathers=(forwards + 2) * passes,
        scatters=(forwards + 1) * passes,
        gains=passes,
        reduces=(forwards + 1) * passes,
        gates=gates,
    )


class Tabled:
    """What a spec derives from its units' parameter tables (spmd.model.params): a unit's size and dense prefix
    under a share, where a rank's slice lives in the whole unit, which of its elements a rank holds first, and
    each unit's own share of the table (what its code lays out)."""

    def table(self, net: NetFields, kind: str) -> Table:
        """A unit kind's parameter table, whole."""
        raise NotImplementedError

    def cut(self, net: NetFields, t: int, j: int, ep: int = 1, e: int = 0) -> Cut:
        """Tensor rank j's (and ep rank e's) ranges of the table's splits."""
        raise NotImplementedError

    def local(self, net: NetFields, kind: str, share: Share) -> Table:
        return params.local(self.table(net, kind), params.share_cut(share))

    def unit_size(self, net: NetFields, kind: str, share: Share) -> int:
        return sum(params.local_sizes(self.table(net, kind), params.share_cut(share)))

    def dense_prefix(self, net: NetFields, kind: str, share: Share) -> int:
        """Elements at the start of a unit that are not experts' (all of them but a mixture of experts' block)."""
        return params.dense_prefix(self.table(net, kind), params.share_cut(share))

    def tensor_slice(self, net: NetFields, kind: str, t: int, j: int, ep: int = 1, e: int = 0) -> np.ndarray:
        return params.tensor_index(self.table(net, kind), self.cut(net, t, j, ep, e))

    def first_holders(self, net: NetFields, kind: str, j: int, e: int, over_ep: bool) -> np.ndarray:
        """Per element of the whole unit, whether tp rank j of ep rank e is the first to hold it."""
        return params.first_holders(self.table(net, kind), j, e, over_ep)


class DenseSpec(Tabled):
    """spmd's MLP: L identical blocks, a squared error on the last one's rows (the transformer's below)."""

    name = "mlp"
    has_attention = False
    reads_tokens = False  # whether it trains on token ids (--data) with a mean token loss, or on rows of numbers
    tied_by_default = False  # whether its embedding and head are one weight unless --no-tie-embeddings says
    passes = 1  # how often a block passes the tensor axis's enter/leave pair (attention, then MLP: 2)
    shape: tuple[str, ...] = ("model", "layers", "hidden", "ffn")  # what the parameters' layout depends on
    roles: ClassVar[dict[str, Role]] = {BLOCK_KIND: Role.BLOCK}  # the role of each kind of its units

    def check(self, net: NetFields) -> None:
        """Every reason this model cannot take the run's sizes and flags, naming the flag (after the common
        ones: sizes >= 1, the optimizer's, the learning rate's)."""
        llama.check_not_lm(net)
        if net.integers:
            dense.check_exact(net)

    def reference(self, net: NetFields) -> tuple[list[float], list[np.ndarray]]:
        """The model's own single-device oracle: (loss per step, final units)."""
        return dense_reference.dense_train(net, self)

    def default_ffn(self, hidden: int) -> int:
        """The ffn width a shape given without one gets (the planner's): 4 h, GPT-2's and the MLP's."""
        return 4 * hidden

    def sgd_lr(self, net: NetFields) -> float:
        """SGD's default rate: the loss is a sum over the rows, so scaled by their number and width."""
        return 0.2 / (net.tokens * net.hidden)

    def initial_unit(self, net: NetFields, unit: int) -> np.ndarray:
        """Unit `unit`'s flat parameters at step 0: the same on every rank, for every mesh."""
        return dense.mlp_initial(net, unit)

    def batch_data(self, net: NetFields, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(X, target) of step `step`: the rows the first unit reads and the last one's targets."""
        return dense.rows(net, step)

    def summary(self, fields: dict) -> tuple[str, str]:
        """(the model's title, its shape beyond layers, h and f) for a report, from a run's fields."""
        return "MLP", ""

    def decoder(self, net: NetFields, units: list[np.ndarray], biases: dict | None = None) -> CachedDecoder:
        """A key/value-cache decoder of the trained units (spmd.model.decode): a language model's only."""
        raise ValueError(f"generate decodes a language model's checkpoints; this one is --model {net.model}")

    def kinds(self, net: NetFields) -> list[str]:
        return ["block"] * net.layers

    def kind(self, net: NetFields, unit: int) -> str:
        return "block"

    def unit_count(self, net: NetFields) -> int:
        return net.layers

    def block_units(self, net: NetFields) -> list[int]:
        return list(range(net.layers))

    def share(self, net: NetFields, t: int, j: int, ep: int = 1, e: int = 0) -> Share:
        heads = block_range(net.heads, t, j) if self.has_attention else (0, 0)
        f0, f1 = block_range(net.ffn, t, j)
        return Share(ffn=f1 - f0, heads=heads[1] - heads[0], head_size=net.head_size)

    def table(self, net: NetFields, kind: str) -> Table:
        return dense.table(net, self.has_attention)

    def cut(self, net: NetFields, t: int, j: int, ep: int = 1, e: int = 0) -> Cut:
        return dense.cut(net, self.has_attention, t, j)

    def unit(self, net: NetFields, kind: str, share: Share, sp: bool, core, j: int, t: int, ep=None, cp=None) -> Block:
        table = self.local(net, kind, share)
        if self.has_attention:
            return TransformerBlock(table, net.hidden, share, net.seq, sp, core)
        return MLPBlock(table, net.hidden, share, net.seq, sp)

    def tied(self, net: NetFields) -> list[tuple[int, int]]:
        return []

    def check_tensor(self, net: NetFields, t: int) -> None:
        """Every reason tp=t cannot split the model (besides --ffn), naming the flag."""
        if self.has_attention and net.heads < t:
            raise ValueError(f"--heads {net.heads} is fewer than tp={t}: a tensor-parallel rank would hold no head")

    def loss_unit(self, net: NetFields) -> bool:
        """Whether the last unit computes the loss (else the engine's squared error on the last rows)."""
        return False

    def points(self, net: NetFields, kind: str, forwards: int) -> TensorPoints:
        return block_points(self.passes, forwards)

    def flops(self, net: NetFields, kind: str, share: Share, matmul_rows: int) -> int:
        """Matmul flops of one forward of a unit on `matmul_rows` rows, the attention core's left out."""
        h = net.hidden
        return 2 * 2 * matmul_rows * h * share.ffn + (
            2 * 4 * matmul_rows * h * share.attention if self.has_attention else 0
        )


class TransformerSpec(DenseSpec):
    """spmd's pre-norm transformer: the MLP's loss and data, a block that passes the tensor axis twice."""

    name = "transformer"
    has_attention = True
    passes = 2
    shape = ("model", "layers", "hidden", "ffn", "heads")

    def check(self, net: NetFields) -> None:
        if net.hidden % net.heads:
            raise ValueError(f"--hidden {net.hidden} must be a multiple of --heads {net.heads} (head size h/a)")
        if net.integers:
            raise ValueError("--integers is for the MLP: softmax's exp makes no integer exact")
        llama.check_not_lm(net)

    def initial_unit(self, net: NetFields, unit: int) -> np.ndarray:
        return dense.transformer_initial(net, unit)

    def summary(self, fields: dict) -> tuple[str, str]:
        return "transformer", f", {fields['heads']} heads, {fields['batch']} sequences of {fields['seq']}"


class LlamaSpec(Tabled):
    """The Llama-style LM (spmd.model.llama): embedding, blocks, final norm, head with cross-entropy."""

    name = "llama"
    source: Any = llama  # the module whose table, label and labels give the parameter table
    has_attention = True
    reads_tokens = True
    tied_by_default = False
    passes = 2
    shape: tuple[str, ...] = (
        "model",
        "layers",
        "hidden",
        "ffn",
        "heads",
        "kv_heads",
        "vocab",
        "tie_embeddings",
        "experts",
        "moe_every",
    )
    reference = staticmethod(llama_reference.reference_train)
    roles: ClassVar[dict[str, Role]] = {
        EMBED_KIND: Role.EMBEDDING,
        BLOCK_KIND: Role.BLOCK,
        EXPERT_KIND: Role.EXPERTS,
        "norm": Role.NORM,
        "head": Role.HEAD,
    }

    def check(self, net: NetFields) -> None:
        llama.check_llama(net)

    def default_ffn(self, hidden: int) -> int:
        """Llama's rule: 2/3 of 4 h, up to a multiple of 256."""
        return llama.llama_ffn(hidden)

    def sgd_lr(self, net: NetFields) -> float:
        """SGD's default rate on the mean token loss: a rate of the field's usual size."""
        return 0.5

    def initial_unit(self, net: NetFields, unit: int) -> np.ndarray:
        return llama.initial_unit(net, unit)

    def batch_data(self, net: NetFields, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, next tokens) of step `step`, each (batch x seq,): the seeded bigram chain."""
        return token_batch(net.vocab, net.batch, net.seq, net.seed, step)

    def summary(self, fields: dict) -> tuple[str, str]:
        shape = f", {fields['heads']} heads, {fields['batch']} sequences of {fields['seq']}"
        return "Llama-style LM", shape + (
            f", vocabulary {fields['vocab']}, {fields['kv_heads'] or fields['heads']} "
            "kv heads" + (", tied embeddings" if fields["tie_embeddings"] else "") + moe_summary(fields)
        )

    def decoder(self, net: NetFields, units: list[np.ndarray], biases: dict | None = None) -> CachedDecoder:
        return Decoder(net, units, biases)

    def kinds(self, net: NetFields) -> list[str]:
        return llama.unit_kinds(net)

    def table(self, net: NetFields, kind: str) -> Table:
        return self.source.table(net, kind)

    def cut(self, net: NetFields, t: int, j: int, ep: int = 1, e: int = 0) -> Cut:
        return llama.cut(net, t, j, ep, e)

    def label(self, net: NetFields, name: str) -> str:
        """A piece's row in the planner's parameter table (pieces of one label are summed)."""
        return self.source.label(net, name)

    def labels(self, net: NetFields) -> list[str]:
        """The parameter table's rows, in their order."""
        return self.source.labels(net)

    def kind(self, net: NetFields, unit: int) -> str:
        """kinds(net)[unit] without listing the others (the planner asks per unit)."""
        return llama.unit_kind(net, unit)

    def unit_count(self, net: NetFields) -> int:
        """len(kinds(net)): the embedding, the blocks, the final norm and the head."""
        return net.layers + 3

    def block_units(self, net: NetFields) -> list[int]:
        return list(range(1, net.layers + 1))

    def share(self, net: NetFields, t: int, j: int, ep: int = 1, e: int = 0) -> Share:
        r = llama.tensor_share(net, t, j, ep, e)
        size = lambda key: r[key][1] - r[key][0]  # noqa: E731
        return Share(
            ffn=size("ffn"),
            heads=size("heads"),
            head_size=net.head_size,
            kv_heads=size("kv"),
            vocab=size("vocab"),
            experts=r["experts"],
        )

    def unit(
        self,
        net: NetFields,
        kind: str,
        share: Share,
        sp: bool,
        core,
        j: int,
        t: int,
        ep: ExpertAxis | None = None,
        cp: SequenceAxis | None = None,
    ) -> Block:
        vocab, table = llama.tensor_share(net, t, j)["vocab"], self.local(net, kind, share)
        state = net.policy.state
        if kind == "embed":
            return Embedding(table, net.hidden, vocab, sp)
        if kind == "norm":
            return FinalNorm(table, net.hidden, net.norm_eps)
        if kind == "head":
            return Head(table, net.hidden, vocab, sp, net.tokens, state)
        ffn = MoEFFN(net, net.hidden, share.ffn, lead=j == 0, ep=ep, cp=cp) if kind == "moe" else None
        return LlamaBlock(table, net.hidden, share, sp, core, net.rope_base, net.norm_eps, state, ffn)

    def tied(self, net: NetFields) -> list[tuple[int, int]]:
        return [(0, net.layers + 2)] if net.tie_embeddings else []

    def check_tensor(self, net: NetFields, t: int) -> None:
        if net.kv < t:
            raise ValueError(
                f"--kv-heads {net.kv} is fewer than tp={t}: tp splits the kv heads (each with its "
                f"query group), a tensor-parallel rank would hold none"
            )
        if net.vocab < t:
            raise ValueError(f"--vocab {net.vocab} is smaller than tp={t}: a rank would hold no vocabulary row")

    def loss_unit(self, net: NetFields) -> bool:
        return True

    def points(self, net: NetFields, kind: str, forwards: int) -> TensorPoints:
        if kind == "embed":  # forward: leave (RS / AR); backward: leave's conjugate (AG under SP)
            return TensorPoints(gathers=1, scatters=1, reduces=1)
        if kind == "norm":  # its gain's gradient, under SP
            return TensorPoints(gains=1)
        if kind == "head":  # forward: enter, the loss; backward: enter again, enter's conjugate
            return TensorPoints(gathers=2, scatters=1, reduces=1, cross_entropy=True)
        return block_points(self.passes, forwards, net.top_k if kind == EXPERT_KIND else 0)

    def flops(self, net: NetFields, kind: str, share: Share, matmul_rows: int) -> int:
        h, m = net.hidden, matmul_rows
        if kind == "head":
            return 2 * m * h * share.vocab
        if kind in BLOCK_KINDS:  # a mixture of experts: each row through its top_k experts, and the router
            moe = kind == "moe"
            ffn = 2 * 3 * m * h * share.ffn * (net.top_k if moe else 1) + (2 * m * h * net.experts if moe else 0)
            return 2 * m * h * (2 * share.attention + 2 * share.kv_width) + ffn
        return 0


class GPT2Spec(LlamaSpec):
    """The GPT-2-style LM (spmd.model.gpt2): the Llama's ends and splits, its own block, norm and positions."""

    name = "gpt2"
    source: Any = gpt2
    shape = ("model", "layers", "hidden", "ffn", "heads", "vocab", "seq", "tie_embeddings")
    reference = staticmethod(gpt2_reference.reference_train)
    tied_by_default = True  # GPT-2 ties its embedding and head

    def check(self, net: NetFields) -> None:
        gpt2.check_gpt2(net)

    def default_ffn(self, hidden: int) -> int:
        return 4 * hidden

    def initial_unit(self, net: NetFields, unit: int) -> np.ndarray:
        return gpt2.initial_unit(net, unit)

    def summary(self, fields: dict) -> tuple[str, str]:
        tied = ", tied embeddings" if fields["tie_embeddings"] else ""
        shape = f", {fields['heads']} heads, {fields['batch']} sequences of {fields['seq']}"
        return "GPT-2-style LM", shape + f", vocabulary {fields['vocab']}, learned positions{tied}"

    def decoder(self, net: NetFields, units: list[np.ndarray], biases: dict | None = None) -> CachedDecoder:
        """The key/value-cache decoder: learned positions at the cache's length, LayerNorm, GELU, the head."""
        return GPT2Decoder(net, units, biases)

    def unit(
        self,
        net: NetFields,
        kind: str,
        share: Share,
        sp: bool,
        core,
        j: int,
        t: int,
        ep: ExpertAxis | None = None,
        cp: SequenceAxis | None = None,
    ) -> Block:
        vocab, table = llama.tensor_share(net, t, j)["vocab"], self.local(net, kind, share)
        if kind == "embed":
            return gpt2.PositionalEmbedding(table, net.hidden, vocab, sp, lead=j == 0)
        if kind == "norm":
            return gpt2.FinalLayerNorm(table, net.hidden, net.norm_eps)
        if kind == "head" and net.tie_embeddings:
            return gpt2.TiedHead(table, net.hidden, vocab, sp, net.tokens, net.policy.state)
        if kind == "head":
            return Head(table, net.hidden, vocab, sp, net.tokens, net.policy.state)
        return gpt2.GPT2Block(table, net.hidden, share, sp, core, net.norm_eps)

    def check_tensor(self, net: NetFields, t: int) -> None:
        if net.heads < t:
            raise ValueError(f"--heads {net.heads} is fewer than tp={t}: a tensor-parallel rank would hold no head")
        if net.vocab < t:
            raise ValueError(f"--vocab {net.vocab} is smaller than tp={t}: a rank would hold no vocabulary row")

    def points(self, net: NetFields, kind: str, forwards: int) -> TensorPoints:
        """The Llama's, but a block's replicated vectors are 3 a pass (a norm's gain and bias, the row-split
        matmul's bias) and the final norm's 2."""
        if kind == "norm":
            return TensorPoints(gains=2)
        if kind == "block":
            return replace(block_points(self.passes, forwards), gains=3 * self.passes)
        return super().points(net, kind, forwards)

    def flops(self, net: NetFields, kind: str, share: Share, matmul_rows: int) -> int:
        if kind == "block":  # Wq, Wk, Wv, Wo (h x a d each), W1 and W2 (h x f each)
            return 2 * matmul_rows * net.hidden * (4 * share.attention + 2 * share.ffn)
        return super().flops(net, kind, share, matmul_rows)


def parameters(net: NetFields) -> int:
    """The model's parameters, a tied weight's second copy not counted again."""
    seconds = {b for _, b in spec_of(net).tied(net)}
    return sum(size for u, size in enumerate(full_sizes(net)) if u not in seconds)


def role_of(net: NetFields, kind: str) -> Role:
    """The role of `kind` among the model's units; a LookupError for a kind its spec does not name."""
    roles = spec_of(net).roles
    if kind not in roles:
        raise LookupError(f"--model {net.model} has no unit kind {kind!r} (its kinds: {', '.join(roles)})")
    return roles[kind]


def full_sizes(net: NetFields) -> list[int]:
    """Elements of each unit, whole (one tensor rank)."""
    spec = spec_of(net)
    return [spec.unit_size(net, kind, spec.share(net, 1, 0)) for kind in spec.kinds(net)]


def shape_of(net: NetFields) -> dict:
    """The fields the model's parameter layout depends on (a checkpoint fits a run when they agree)."""
    return {name: getattr(net, name) for name in spec_of(net).shape}


def summary(fields: dict) -> tuple[str, str]:
    """(the model's title, its shape beyond layers, h and f) for a report, from a run's fields (a Net as a dict;
    the MLP workload's has no model field)."""
    return MODELS[fields.get("model", "mlp")].summary(fields)


def moe_summary(fields: dict) -> str:
    """ ", 8 experts (top-2, softmax, aux 0.01, capacity 1.25)" for a mixture of experts; "" for a dense FFN."""
    if not fields.get("experts"):
        return ""
    rules = [
        f"top-{fields['top_k']}",
        fields["router"] + (" renormalized" if fields["renormalize"] else ""),
        *(["gated GELU"] if fields.get("expert_activation") == "gelu" else []),
        *([f"every {fields['moe_every']} layers from the first"] if fields.get("moe_every", 1) > 1 else []),
        *([f"aux {fields['aux_loss']:g}"] if fields["aux_loss"] else []),
        f"capacity {fields['capacity_factor']:g}" if fields["capacity_factor"] else "dropless",
    ]
    return f", {fields['experts']} experts ({', '.join(rules)})"


MODELS: dict[str, DenseSpec | LlamaSpec] = {
    spec.name: spec for spec in (DenseSpec(), TransformerSpec(), LlamaSpec(), GPT2Spec())
}


def spec_of(net: NetFields):
    return MODELS[net.model]
