"""The blocks a rank of a composed run computes with: the model's units, with the attention core its
layout calls for (whole sequences, ring or Ulysses over cp; P kept or recomputed)."""

from __future__ import annotations

from collections.abc import Sequence

from spmd.model.attention import AttentionCore, LocalAttention
from spmd.model.blocks import BLOCK_KINDS, Block
from spmd.model.config import Net
from spmd.model.registry import spec_of
from spmd.parallel.expert import ExpertParallel
from spmd.parallel.layout import Layout
from spmd.parallel.rank_plan import RankPlan
from spmd.parallel.routing_counts import WholeSequences
from spmd.transport.group import Group


def attention_core(net: Net, layout: Layout, plan: RankPlan, cp_group: Group | None) -> AttentionCore:
    share, cp = plan.share, layout.dims.size("cp")
    keep_probs = layout.recompute != "selective"
    if cp == 1:
        return LocalAttention(share.heads, share.head_size, net.seq, keep_probs)
    c, chunks = layout.dims.coord("cp", plan.rank), layout.token_chunks(net)
    return layout.cp.attention(cp_group, c, share, net.seq, chunks, keep_probs)


def blocks_for(
    net: Net, layout: Layout, plan: RankPlan, sp: bool, cp_group: Group | None = None, ep_group: Group | None = None
) -> dict[str, Block]:
    """The code of `plan`'s rank for each kind of unit it holds, one object a kind (cp_group and ep_group None: for
    their shapes only, as the closed-form cost asks)."""
    spec, share, d = spec_of(net), plan.share, layout.dims
    t, j = d.size("tp"), d.coord("tp", plan.rank)
    kinds = set(plan.kinds)
    core = attention_core(net, layout, plan, cp_group) if spec.has_attention and kinds & set(BLOCK_KINDS) else None
    ep = ExpertParallel(d.size("ep"), d.coord("ep", plan.rank), ep_group)
    cp = WholeSequences(layout.token_chunks(net), d.coord("cp", plan.rank), cp_group)  # a mixture of experts' counts
    return {kind: spec.unit(net, kind, share, sp, core, j, t, ep, cp) for kind in sorted(kinds)}


def merged_scratch(blocks, rows) -> tuple[dict, dict, dict]:
    """(shapes, dtypes, row axes) of the scratch a rank's units share: one array a name (units that name the same
    array agree on its shape)."""
    shapes: dict[str, tuple] = {}
    dtypes: dict[str, str] = {}
    cut: dict[str, str] = {}
    for block in blocks:
        for name, shape in block.scratch_shapes(rows).items():
            if shapes.setdefault(name, shape) != shape:
                raise AssertionError(f"scratch {name!r}: {shapes[name]} and {shape}")
        dtypes.update(block.dtypes)
        cut.update(block.scratch_rows)
    return shapes, dtypes, cut


def stash_sizes(blocks: dict[str, Block], chunks: Sequence[Sequence[int]], kinds: list[str], rows) -> tuple[int, int]:
    """Elements of one slot's weight-gradient stash under a split schedule: the most any of the rank's chunks
    keeps from I to W for one micro-batch (products' operands, gains' gradients), summed over its units."""
    sizes, at = [], 0
    for chunk in chunks:
        parts = [blocks[kind].stash_sizes(rows) for kind in kinds[at : at + len(chunk)] if blocks[kind].defers]
        sizes.append((sum(p for p, _ in parts), sum(v for _, v in parts)))
        at += len(chunk)
    return max(p for p, _ in sizes), max(v for _, v in sizes)


def block_positions(chunks: Sequence[Sequence[int]], kinds: list[str]) -> list[list[str]]:
    """Per position of a layer in a chunk (its j-th layer), the kinds of layer (dense, mixture of experts) found
    there in any of the rank's chunks: what a slot keeps activations for."""
    positions: list[set[str]] = []
    at = 0
    for chunk in chunks:
        layers = [kind for kind in kinds[at : at + len(chunk)] if kind in BLOCK_KINDS]
        positions += [set() for _ in range(len(layers) - len(positions))]
        for j, kind in enumerate(layers):
            positions[j].add(kind)
        at += len(chunk)
    return [sorted(kinds_here) for kinds_here in positions]
