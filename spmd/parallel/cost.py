"""A composed run's closed-form cost per rank: payload bytes per mesh axis, bytes held by kind, matmul flops.

Derived from the block's communication points (per layer and micro-batch: the tensor axis's enter and
leave in forward; leave's conjugate, enter again and enter's conjugate, and each replicated gain's
gradient, in backward) and the axis sizes, not written per combination; the tests compare it with what
the ranks measure, to the byte.
"""

from __future__ import annotations

from spmd.collectives.cost import (
    all_gather_bytes,
    all_reduce_bytes,
    all_to_all_bytes,
    broadcast_bytes,
    reduce_scatter_bytes,
    ring_shift_bytes,
)
from spmd.layout import block_range, block_sizes, largest_block
from spmd.model.blocks import elements
from spmd.model.config import Net
from spmd.model.optimizers import STATE
from spmd.parallel.accounting import Tally, TrainCost, memory
from spmd.parallel.block import block_for
from spmd.parallel.context import work_table
from spmd.parallel.layout import Layout
from spmd.parallel.schedules import executor_slots

# Per layer, how often a block passes each communication point (a transformer layer is attention + MLP).
PASSES = {"mlp": 1, "transformer": 2}


def saved_elements(net: Net, layout: Layout, rank: int, rows) -> int:
    """What a layer keeps for its backward (activations), besides its input: the block's kept arrays."""
    return elements(block_for(net, layout, rank, layout.sp and layout.dims.size("tp") > 1).saved_shapes(rows))


def scratch_elements(net: Net, layout: Layout, rank: int, rows, sp: bool) -> int:
    """The block's shared scratch (buffers), and the rerun forward's output under full recomputation."""
    rerun = rows.local * net.hidden if layout.recompute == "full" else 0
    return elements(block_for(net, layout, rank, sp).scratch_shapes(rows)) + rerun


def gather_buffer(sharding, fsdp: int, layers: int, width: int, overlap: bool) -> int:
    """ZeRO-3's gathered parameters: one layer at a time (two with overlap: the next one arriving while this one
    computes), or every layer without resharding (none on 1 rank)."""
    if fsdp == 1:
        return 0
    return (2 if overlap else 1) * width if sharding.reshard_after_forward else layers * width


def reduction_sizes(layout: Layout, net: Net, rank: int) -> tuple[int, int]:
    """The largest chunk a reduce-scatter or all-reduce of this rank handles (0: none): of activations (the tp
    axis's, in the compute dtype) and of gradients (in the reduction dtype). The loss is reduced in float64 by a
    1-element all-reduce with its own scratch, in the state dtype (a few bytes, counted nowhere)."""
    d = layout.dims
    t, f, dp, cp = d.size("tp"), d.size("fsdp"), d.size("dp"), d.size("cp")
    sp = layout.sp and t > 1
    width, rows = layout.layer_size(net, rank), layout.largest_rows(net, rank)
    (lo, hi), _ = layout.shard(net, rank)
    act, grad = [], []
    if t > 1:  # (SP's all-reduce of a gain's gradient, h elements, has its own scratch, as the loss)
        act.append(largest_block(rows.matmul, t) * net.hidden if sp else largest_block(rows.matmul * net.hidden, t))
    if f > 1 and layout.sharding.optimizer:
        grad.append(largest_block(width, f))
    for size in (cp, dp):
        if size > 1:
            grad.append(largest_block(hi - lo if layout.sharding.optimizer else width, size))
    return max(act, default=0), max(grad, default=0)


def separate_grad_workspace(layout: Layout, net: Net) -> bool:
    """Whether gradient reductions get a workspace of their own: their dtype differs from the activations', or
    they run in the background (overlap) while the tensor axis reduces activations."""
    policy = net.policy
    return policy.reduce != policy.compute or (layout.overlap and layout.dims.size("tp") > 1)


def reduction_bytes(layout: Layout, net: Net, rank: int) -> int:
    """Bytes of the reduction workspaces (3 buffers each): one shared, or one each (separate_grad_workspace)."""
    act, grad = reduction_sizes(layout, net, rank)
    policy = net.policy
    if not separate_grad_workspace(layout, net):
        return 3 * max(act, grad) * policy.compute.itemsize
    return 3 * (act * policy.compute.itemsize + grad * policy.reduce.itemsize)


def state_memory(policy, optimizer: str, sharding, fsdp: int, layers: int, width: int, shard: int,
                 microbatches: int, overlap: bool = False) -> dict[str, int]:
    """Bytes of a rank's training state: `layers` layers of `width` elements, sharded `shard` a rank over fsdp
    as `sharding` says. Parameters (and ZeRO-3's gather buffer), fp32 master weights (mixed precision, sharded
    as the optimizer state), gradients (and the one-layer buffer that accumulates or reduces a layer's), the
    optimizer's state. With overlap: a second gather buffer and a second layer gradient (one reducing)."""
    s, g, state = policy.compute.itemsize, policy.reduce.itemsize, policy.state.itemsize
    grads_sharded = sharding.grads and microbatches == 1
    part = shard if sharding.optimizer else width  # what this rank's optimizer updates of a layer
    reducing = (2 if overlap and fsdp > 1 else 1) * width  # the layer gradients before their reduce-scatter
    return {
        "params": s * (layers * shard + gather_buffer(sharding, fsdp, layers, width, overlap) if sharding.params
                       else layers * width),
        "master": state * layers * part if policy.mixed else 0,
        "grads": g * (layers * shard + reducing if grads_sharded
                      else layers * width + (width if microbatches > 1 else 0)),
        "optimizer": state * len(STATE[optimizer]) * layers * part,
    }


def representatives(layout: Layout) -> list[int]:
    """The ranks among which the fullest and busiest are, the planner evaluates only these: for each pipeline
    stage and cp coordinate (the zigzag gives cp ranks other than the first the most tokens), coordinate 0 on
    every other axis (block splits give the first block the most)."""
    dims = layout.dims
    return [dims.mesh.rank_of({axis: stage if axis == "pp" else c if axis == "cp" else 0 for axis in dims.mesh.names})
            for stage in range(dims.size("pp")) for c in range(dims.size("cp"))]


def cost(net: Net, layout: Layout, ranks: list[int] | None = None) -> TrainCost:
    """Per rank of `ranks` (default: every rank of the mesh, in order). s: bytes of a compute element
    (activations, parameters), g: of a gradient (the reduction dtype)."""
    d, s, h = layout.dims, net.itemsize, net.hidden
    policy = net.policy
    g, state = policy.reduce.itemsize, policy.state.itemsize
    t, f, dp, p, cp = d.size("tp"), d.size("fsdp"), d.size("dp"), d.size("pp"), d.size("cp")
    sp, v, m, sharding = layout.sp and t > 1, net.chunks, net.microbatches, layout.sharding
    traffic, held, flops = [], [], []
    slots_of = executor_slots(layout.schedule, p, m, v)  # every stage's, simulated once
    for rank in range(d.mesh.size) if ranks is None else ranks:
        j, rf, rd, rp, rc = (d.coord(a, rank) for a in ("tp", "fsdp", "dp", "pp", "cp"))
        chunks = layout.chunks(net, rank)
        n, depth = sum(map(len, chunks)), max(map(len, chunks))
        width = layout.layer_size(net, rank)
        (lo, hi), counts = layout.shard(net, rank)
        shard = hi - lo
        tally = Tally()
        passes = PASSES[net.model]
        forwards = 2 if layout.recompute == "full" else 1  # full recomputation runs each forward again
        for k in range(m):
            rows = layout.rows(net, rank, k)
            if t > 1 and sp:  # per pass: AG enter, RS leave; backward AG dy, AG again, RS dx, AR of the gain
                split = block_sizes(rows.matmul, t)
                gather, scatter = all_gather_bytes(split, j, h * s), reduce_scatter_bytes(split, j, h * s)
                tally.add("tp", gather, (forwards + 2) * passes * n)
                tally.add("tp", scatter, (forwards + 1) * passes * n)
                tally.add("tp", all_reduce_bytes(h, t, j, g), passes * n)
            elif t > 1:  # per pass: AR of leave's partial output, AR of enter's input gradient
                tally.add("tp", all_reduce_bytes(rows.matmul * h, t, j, s), (forwards + 1) * passes * n)
            if cp > 1 and net.model == "transformer":
                context_traffic(tally, net, layout, rank, rows, forwards, n)
            if sharding.params and f > 1 and sharding.reshard_after_forward:  # for forward, again for backward
                tally.add("fsdp", all_gather_bytes(counts, rf, s), 2 * n)
            if p > 1:  # a micro-batch's rows cross each stage boundary: on in forward, back in backward
                on, back = v - (rp == p - 1), v - (rp == 0)
                act = rows.local * h * s
                tally.add("pp", (act * on, act * back))
                tally.add("pp", (act * back, act * on))
        if sharding.params and f > 1 and not sharding.reshard_after_forward:  # once a step, kept
            tally.add("fsdp", all_gather_bytes(counts, rf, s), n)
        if sharding.optimizer and f > 1:
            tally.add("fsdp", reduce_scatter_bytes(counts, rf, g), n)
            if not sharding.params:
                tally.add("fsdp", all_gather_bytes(counts, rf, s), n)
        for axis, size, r in (("cp", cp, rc), ("dp", dp, rd)):
            if size > 1:
                tally.add(axis, all_reduce_bytes(shard if sharding.optimizer else width, size, r, g), n)
        for axis, size, r in (("tp", t if sp else 1, j), ("cp", cp, rc), ("fsdp", f, rf), ("dp", dp, rd)):
            if size > 1:
                tally.add(axis, all_reduce_bytes(1, size, r, state))  # the loss
        if p > 1:
            tally.add("pp", broadcast_bytes(state, p, rp, root=p - 1))
        traffic.append(tally)
        rows = layout.largest_rows(net, rank)
        slots = slots_of[rp]
        kept_layers = 1 if layout.recompute == "full" else slots * depth  # full: one layer's, refilled
        part = shard if sharding.optimizer else width  # what this rank's optimizer updates of a layer
        held.append(memory(
            **state_memory(policy, net.optimizer, sharding, f, n, width, shard, m, layout.overlap),
            activations=s * (slots * (depth + 1) * rows.local * h + kept_layers * saved_elements(net, layout, rank,
                                                                                                 rows)),
            buffers=s * scratch_elements(net, layout, rank, rows, sp) + reduction_bytes(layout, net, rank)
            + (state * part if net.optimizer == "adamw" else 0),  # AdamW's update scratch
        ))
        flops.append(step_flops(net, layout, rank))
    return TrainCost(traffic, held, flops)


def context_traffic(tally: Tally, net: Net, layout: Layout, rank: int, rows, forwards: int, layers: int) -> None:
    """One micro-batch's attention traffic over cp, every layer: ring, the K/V blocks passed cp - 1 times per
    forward and again in backward, their dK/dV accumulators cp times; Ulysses, per forward all-to-alls of Q, K, V
    to heads and O back, in backward dO to heads and dQ, dK, dV back."""
    d, s = layout.dims, net.itemsize
    cp, c, n = d.size("cp"), d.coord("cp", rank), rows.sequences
    tokens, width = layout.tokens(net), layout.share(net, rank).attention
    if layout.cp == "ring":
        block = [n * t * width * s for t in tokens]
        shift = lambda step: ring_shift_bytes([block[(r - step) % cp] for r in range(cp)], c)  # noqa: E731
        for step in range(cp):
            if step < cp - 1:
                tally.add("cp", shift(step), 2 * (forwards + 1) * layers)  # K and V, each forward and backward
            tally.add("cp", shift(step), 2 * layers)  # dK and dV
        return
    heads = [layout.share(net, rank).head_size * (hi - lo) for lo, hi in
             (block_range(layout.share(net, rank).heads, cp, g) for g in range(cp))]
    to_heads = [[n * tokens[q] * heads[r] * s for r in range(cp)] for q in range(cp)]
    to_tokens = [[n * tokens[r] * heads[q] * s for r in range(cp)] for q in range(cp)]
    tally.add("cp", all_to_all_bytes(to_heads, c), (3 * forwards + 1) * layers)
    tally.add("cp", all_to_all_bytes(to_tokens, c), (forwards + 3) * layers)


def attention_flops(net: Net, layout: Layout, rank: int, rows) -> int:
    """Matmul flops of one forward of the attention core (scores, then P V) on one micro-batch."""
    share, d, cp = layout.share(net, rank), net.head_size, layout.dims.size("cp")
    if cp == 1:
        return 4 * rows.sequences * share.heads * net.seq ** 2 * d
    if layout.cp == "ulysses":
        lo, hi = block_range(share.heads, cp, layout.dims.coord("cp", rank))
        return 4 * rows.sequences * (hi - lo) * net.seq ** 2 * d
    pieces = work_table(net.seq, cp)[layout.dims.coord("cp", rank)][2]
    return 4 * rows.sequences * share.heads * pieces * d


def step_flops(net: Net, layout: Layout, rank: int) -> int:
    """Matmul flops of this rank's step: forward 2 per multiply-add, backward twice the forward; recomputed
    scores (ring attention and selective recomputation recompute P) and reruns (full) on top."""
    share, h = layout.share(net, rank), net.hidden
    n = sum(map(len, layout.chunks(net, rank)))
    total = 0
    for k in range(net.microbatches):
        rows = layout.rows(net, rank, k)
        forward = 2 * 2 * rows.matmul * h * share.ffn
        again = 0
        if net.model == "transformer":
            core = attention_flops(net, layout, rank, rows)
            forward += 2 * 4 * rows.matmul * h * share.attention + core  # Q, K, V, O, and the core
            rescored = layout.recompute == "selective" or (layout.dims.size("cp") > 1 and layout.cp == "ring")
            again = core // 2 if rescored else 0
        total += (3 * forward + again + (forward if layout.recompute == "full" else 0)) * n
    return total
