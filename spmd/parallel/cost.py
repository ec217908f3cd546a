"""A composed run's closed-form cost per rank: payload bytes per mesh axis, bytes held by kind, matmul flops.

Derived from the block's communication points (per layer and micro-batch: the tensor axis's enter and
leave in forward; leave's conjugate, enter again and enter's conjugate, and each replicated gain's
gradient, in backward) and the axis sizes, not written per combination; the tests compare it with what
the ranks measure, to the byte.
"""

from __future__ import annotations

from spmd.collectives.cost import all_gather_bytes, all_reduce_bytes, broadcast_bytes, reduce_scatter_bytes
from spmd.layout import block_sizes, largest_block
from spmd.model.config import Net
from spmd.parallel.accounting import Tally, TrainCost, memory
from spmd.parallel.layout import Layout
from spmd.parallel.schedules import executor_slots

# Per layer, how often a block passes each communication point (a transformer layer is attention + MLP).
PASSES = {"mlp": 1, "transformer": 2}


def saved_elements(net: Net, layout: Layout, rank: int, rows) -> int:
    """What a layer keeps for its backward (activations), besides its input."""
    share = layout.share(net, rank)
    mlp = rows.matmul * share.ffn
    if net.model == "mlp":
        return mlp
    w = share.attention
    return rows.local * net.hidden + 4 * rows.matmul * w + rows.sequences * share.heads * net.seq ** 2 + mlp


def scratch_elements(net: Net, layout: Layout, rank: int, rows, sp: bool) -> int:
    """The block's shared scratch (buffers): see MLPBlock/TransformerBlock.scratch_shapes."""
    share, h = layout.share(net, rank), net.hidden
    mlp = 2 * rows.local * h + rows.matmul * h + 2 * rows.matmul * share.ffn + (3 * rows.matmul * h if sp else 0)
    if net.model == "mlp":
        return mlp
    return mlp + rows.matmul * h + 4 * rows.matmul * share.attention + 3 * net.seq ** 2 + 2 * net.seq


def gather_buffer(sharding, fsdp: int, layers: int, width: int) -> int:
    """ZeRO-3's gathered parameters: one layer at a time, or every layer without resharding (none on 1 rank)."""
    if fsdp == 1:
        return 0
    return width if sharding.reshard_after_forward else layers * width


def largest_reduction(layout: Layout, net: Net, rank: int) -> int:
    """The largest chunk any reduce-scatter or all-reduce of this rank handles (0: none)."""
    d = layout.dims
    t, f, dp = d.size("tp"), d.size("fsdp"), d.size("dp")
    sp = layout.sp and t > 1
    width, rows = layout.layer_size(net, rank), layout.largest_rows(net, rank)
    (lo, hi), _ = layout.shard(net, rank)
    chunks = [1] if (sp or f > 1 or dp > 1) else []  # the loss
    if t > 1:
        chunks += [largest_block(rows.matmul, t) * net.hidden, largest_block(net.hidden, t)] if sp else \
            [largest_block(rows.matmul * net.hidden, t)]
    if f > 1 and layout.sharding.optimizer:
        chunks.append(largest_block(width, f))
    if dp > 1:
        chunks.append(largest_block(hi - lo if layout.sharding.optimizer else width, dp))
    return max(chunks, default=0)


def cost(net: Net, layout: Layout) -> TrainCost:
    d, s, h = layout.dims, net.itemsize, net.hidden
    t, f, dp, p = d.size("tp"), d.size("fsdp"), d.size("dp"), d.size("pp")
    sp, v, m, sharding = layout.sp and t > 1, net.chunks, net.microbatches, layout.sharding
    traffic, held, flops = [], [], []
    for rank in range(d.mesh.size):
        j, rf, rd, rp = (d.coord(a, rank) for a in ("tp", "fsdp", "dp", "pp"))
        chunks = layout.chunks(net, rank)
        n, depth = sum(map(len, chunks)), max(map(len, chunks))
        width = layout.layer_size(net, rank)
        (lo, hi), counts = layout.shard(net, rank)
        shard = hi - lo
        tally = Tally()
        passes = PASSES[net.model]
        for k in range(m):
            rows = layout.rows(net, rank, k)
            if t > 1 and sp:  # per pass: AG enter, RS leave; backward AG dy, AG again, RS dx, AR of the gain
                split = block_sizes(rows.matmul, t)
                gather, scatter = all_gather_bytes(split, j, h * s), reduce_scatter_bytes(split, j, h * s)
                tally.add("tp", gather, 3 * passes * n)
                tally.add("tp", scatter, 2 * passes * n)
                tally.add("tp", all_reduce_bytes(h, t, j, s), passes * n)
            elif t > 1:  # per pass: AR of leave's partial output, AR of enter's input gradient
                tally.add("tp", all_reduce_bytes(rows.matmul * h, t, j, s), 2 * passes * n)
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
            tally.add("fsdp", reduce_scatter_bytes(counts, rf, s), n)
            if not sharding.params:
                tally.add("fsdp", all_gather_bytes(counts, rf, s), n)
        if dp > 1:
            tally.add("dp", all_reduce_bytes(shard if sharding.optimizer else width, dp, rd, s), n)
        for axis, size, r in (("tp", t if sp else 1, j), ("fsdp", f, rf), ("dp", dp, rd)):
            if size > 1:
                tally.add(axis, all_reduce_bytes(1, size, r, s))  # the loss
        if p > 1:
            tally.add("pp", broadcast_bytes(s, p, rp, root=p - 1))
        traffic.append(tally)
        rows = layout.largest_rows(net, rank)
        grads_sharded = sharding.grads and m == 1
        slots = executor_slots(layout.schedule, p, m, v)[rp]
        largest = largest_reduction(layout, net, rank)
        held.append(memory(
            s,
            params=n * shard + gather_buffer(sharding, f, n, width) if sharding.params else n * width,
            grads=n * shard + width if grads_sharded else n * width + (width if m > 1 else 0),
            optimizer=n * shard if sharding.optimizer else n * width,
            activations=slots * ((depth + 1) * rows.local * h + depth * saved_elements(net, layout, rank, rows)),
            buffers=scratch_elements(net, layout, rank, rows, sp) + 3 * largest,
        ))
        flops.append(step_flops(net, layout, rank))
    return TrainCost(traffic, held, flops)


def step_flops(net: Net, layout: Layout, rank: int) -> int:
    """Matmul flops of this rank's step: forward 2 per multiply-add, backward twice the forward."""
    share, h = layout.share(net, rank), net.hidden
    n = sum(map(len, layout.chunks(net, rank)))
    total = 0
    for k in range(net.microbatches):
        rows = layout.rows(net, rank, k)
        forward = 2 * 2 * rows.matmul * h * share.ffn
        if net.model == "transformer":
            forward += 2 * 4 * rows.matmul * h * share.attention  # Q, K, V, O
            forward += 2 * 2 * rows.sequences * share.heads * net.seq ** 2 * net.head_size  # scores, P V
        total += 3 * forward * n
    return total
