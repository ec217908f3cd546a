"""The block a rank of a composed run computes with: the model's layer, with the attention core its
layout calls for (whole sequences, ring or Ulysses over cp; P kept or recomputed)."""

from __future__ import annotations

from spmd.model.attention import AttentionCore, LocalAttention
from spmd.model.blocks import Block
from spmd.model.config import Net
from spmd.model.mlp import MLPBlock
from spmd.model.transformer import TransformerBlock
from spmd.parallel.layout import Layout
from spmd.parallel.ring_attention import RingAttention
from spmd.parallel.ulysses import UlyssesAttention
from spmd.transport.group import Group


def attention_core(net: Net, layout: Layout, rank: int, cp_group: Group | None) -> AttentionCore:
    share, cp = layout.share(net, rank), layout.dims.size("cp")
    keep_probs = layout.recompute != "selective"
    if cp == 1:
        return LocalAttention(share.heads, share.head_size, net.seq, keep_probs)
    c, chunks = layout.dims.coord("cp", rank), layout.token_chunks(net)
    if layout.cp == "ring":  # keeps no probabilities either way
        return RingAttention(cp_group, c, share.heads, share.head_size, chunks)
    return UlyssesAttention(cp_group, c, share.heads, share.head_size, net.seq, chunks, keep_probs)


def block_for(net: Net, layout: Layout, rank: int, sp: bool, cp_group: Group | None = None) -> Block:
    """Rank `rank`'s block (cp_group None: for its shapes only, as the closed-form cost asks)."""
    share = layout.share(net, rank)
    if net.model == "mlp":
        return MLPBlock(net.hidden, share, net.seq, sp)
    return TransformerBlock(net.hidden, share, net.seq, sp, attention_core(net, layout, rank, cp_group))
