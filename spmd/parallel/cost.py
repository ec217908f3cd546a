"""A composed run's closed-form cost per rank: payload bytes per mesh axis, bytes held by kind, matmul flops.

Derived from the block's communication points (per layer and micro-batch: the tensor axis's enter and
leave in forward; leave's conjugate, enter again and enter's conjugate, and each replicated gain's
gradient, in backward) and the axis sizes, not written per combination; the tests compare it with what
the ranks measure, to the byte.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from spmd.collectives.cost import (
    all_gather_bytes,
    all_reduce_bytes,
    all_to_all_bytes,
    broadcast_bytes,
    reduce_scatter_bytes,
)
from spmd.layout import block_sizes, largest_block
from spmd.model.blocks import BLOCK_KIND, BLOCK_KINDS, EXPERT_KIND, Block, elements, nbytes
from spmd.model.config import Net
from spmd.model.optimizers import STATE
from spmd.model.registry import TensorPoints, spec_of
from spmd.parallel.accounting import Tally, TrainCost, memory
from spmd.parallel.block import block_positions, blocks_for, merged_scratch, stash_sizes
from spmd.parallel.layout import Layout
from spmd.parallel.pipeline_sim import executor_slots, stashed
from spmd.parallel.rank_plan import Piece, RankPlan
from spmd.parallel.schedules import rank_of, schedule_named, stage_of


def saved_elements(net: Net, layout: Layout, plan: RankPlan, rows) -> int:
    """What a dense layer keeps for its backward (activations), besides its input: its kept arrays."""
    return elements(
        blocks_for(net, layout, plan, layout.sp and layout.dims.size("tp") > 1)[BLOCK_KIND].saved_shapes(rows)
    )


def gather_buffer(sharding, fsdp: int, widths: list[int], overlap: bool) -> int:
    """ZeRO-3's gathered parameters: one unit at a time, as wide as the widest (two with overlap: the next one
    arriving while this one computes), or every unit without resharding (none on 1 rank)."""
    if fsdp == 1:
        return 0
    return (2 if overlap else 1) * max(widths) if sharding.reshard_after_forward else sum(widths)


def unit_shares(plan: RankPlan) -> tuple[list[int], list[int], list[tuple[Piece, ...]]]:
    """Per unit the rank holds: its width (the tensor slice), its shard, its pieces (how it is sharded)."""
    return [u.size for u in plan.units], [u.shard_size for u in plan.units], [u.pieces for u in plan.units]


def shard_traffic(
    tally: Tally, pieces: tuple[Piece, ...], rf: int, re: int, nbytes: int, scatter: bool, times: int = 1
):
    """`times` gathers (or reduce-scatters) of a unit's pieces: over fsdp, and (FSDP over ep) each fsdp block over
    ep."""
    collective = reduce_scatter_bytes if scatter else all_gather_bytes
    for piece in pieces:
        tally.add("fsdp", collective(list(piece.fsdp), rf, nbytes), times)
        if piece.ep:
            tally.add("ep", collective(list(piece.ep), re, nbytes), times)


def reduction_sizes(layout: Layout, net: Net, plan: RankPlan) -> tuple[int, int]:
    """The largest chunk a reduce-scatter or all-reduce of this rank handles (0: none): of activations (the tp
    axis's, in the compute dtype) and of gradients (in the reduction dtype). The loss's all-reduces (and the
    cross-entropy's, a few elements a row) have their own scratch, counted nowhere."""
    d = layout.dims
    t, f, dp, cp = d.size("tp"), d.size("fsdp"), d.size("dp"), d.size("cp")
    sp = layout.sp and t > 1
    rows = plan.largest_rows
    widths, shards, _ = unit_shares(plan)
    parts = shards if layout.sharding.optimizer else widths
    act, grad = [], []
    if t > 1:  # (SP's all-reduce of a gain's gradient, h elements, has its own scratch, as the loss)
        act.append(largest_block(rows.matmul, t) * net.hidden if sp else largest_block(rows.matmul * net.hidden, t))
    if f > 1 and layout.sharding.optimizer:  # (FSDP over ep: each fsdp block over ep, smaller)
        grad.append(max(largest_block(p.stop - p.start, f) for u in plan.units for p in u.pieces))
    for size in (cp, dp):
        if size > 1:
            grad.append(max(largest_block(part, size) for part in parts))
    if d.size("ep") > 1:  # the parts' dense prefixes
        grad.append(max(largest_block(u.ep_summed, d.size("ep")) for u in plan.units))
    return max(act, default=0), max(grad, default=0)


def separate_grad_workspace(layout: Layout, net: Net) -> bool:
    """Whether gradient reductions get a workspace of their own: their dtype differs from the activations', or
    they run in the background (overlap) while the tensor axis reduces activations."""
    policy = net.policy
    return policy.reduce != policy.compute or (layout.overlap and layout.dims.size("tp") > 1)


def reduction_bytes(layout: Layout, net: Net, plan: RankPlan) -> int:
    """Bytes of the reduction workspaces (3 buffers each): one shared, or one each (separate_grad_workspace)."""
    act, grad = reduction_sizes(layout, net, plan)
    policy = net.policy
    if not separate_grad_workspace(layout, net):
        return 3 * max(act, grad) * policy.compute.itemsize
    return 3 * (act * policy.compute.itemsize + grad * policy.reduce.itemsize)


def state_memory(
    policy,
    optimizer: str,
    sharding,
    fsdp: int,
    widths: list[int],
    shards: list[int],
    microbatches: int,
    overlap: bool = False,
) -> dict[str, int]:
    """Bytes of a rank's training state: units of `widths` elements, sharded `shards` a rank over fsdp as
    `sharding` says. Parameters (and ZeRO-3's gather buffer), fp32 master weights (mixed precision, sharded
    as the optimizer state), gradients (and the one-unit buffer, as wide as the widest, that accumulates or
    reduces a unit's), the optimizer's state. With overlap: a second gather buffer and a second unit gradient
    (one reducing)."""
    s, g, state = policy.compute.itemsize, policy.reduce.itemsize, policy.state.itemsize
    grads_sharded = sharding.grads and microbatches == 1
    parts = sum(shards) if sharding.optimizer else sum(widths)  # what this rank's optimizer updates
    reducing = (2 if overlap and fsdp > 1 else 1) * max(widths)  # the unit gradients before their reduce-scatter
    return {
        "params": s
        * (sum(shards) + gather_buffer(sharding, fsdp, widths, overlap) if sharding.params else sum(widths)),
        "master": state * parts if policy.mixed else 0,
        "grads": g
        * (sum(shards) + reducing if grads_sharded else sum(widths) + (max(widths) if microbatches > 1 else 0)),
        "optimizer": state * len(STATE[optimizer]) * parts,
    }


def representatives(layout: Layout) -> list[int]:
    """The ranks among which the fullest and busiest are, the planner evaluates only these: for each pipeline
    stage and cp coordinate (the zigzag gives cp ranks other than the first the most tokens), coordinate 0 on
    every other axis (block splits give the first block the most)."""
    dims = layout.dims
    return [
        dims.mesh.rank_of({axis: stage if axis == "pp" else c if axis == "cp" else 0 for axis in dims.mesh.names})
        for stage in range(dims.size("pp"))
        for c in range(dims.size("cp"))
    ]


def tensor_traffic(
    tally: Tally,
    points: TensorPoints,
    rows,
    t: int,
    j: int,
    sp: bool,
    h: int,
    s: int,
    g: int,
    state: int,
    times: int = 1,
) -> None:
    """`times` units' (or micro-batches') tensor-axis bytes for one micro-batch, from their declared points
    (registry.TensorPoints)."""
    if t == 1:
        return
    if sp:
        split = block_sizes(rows.matmul, t)
        tally.add("tp", all_gather_bytes(split, j, h * s), points.gathers * times)
        tally.add("tp", reduce_scatter_bytes(split, j, h * s), points.scatters * times)
        tally.add("tp", all_reduce_bytes(h, t, j, g), points.gains * times)
    else:
        tally.add("tp", all_reduce_bytes(rows.matmul * h, t, j, s), points.reduces * times)
    if points.cross_entropy:  # the row maxima, then [sum of exponentials, target logit] a row
        tally.add("tp", all_reduce_bytes(rows.matmul, t, j, state), times)
        tally.add("tp", all_reduce_bytes(2 * rows.matmul, t, j, state), times)
    if points.gates:  # a mixture of experts' gates' gradients (the rows whole on every tp rank)
        tally.add("tp", all_reduce_bytes(points.gates * rows.matmul, t, j, state), times)


def cost(net: Net, layout: Layout, plans: list[RankPlan] | None = None, alike_stages: bool = False) -> TrainCost:
    """Per rank planned in `plans` (default: every rank of the mesh, in order): its bytes per axis, its bytes held
    by kind and its matmul flops. `alike_stages` (the planner's): ranks of one stage_signature share their
    micro-batches' and gradients' traffic and their flops, costed once (what they hold is costed for each)."""
    d = layout.dims
    traffic, held, flops = [], [], []
    slots_of = executor_slots(
        layout.schedule, d.size("pp"), net.microbatches, net.chunks
    )  # every stage's, simulated once
    code: dict[tuple, UnitCode] = {}  # ranks alike but for their pipeline stage build their units' code once
    costed: dict[tuple, tuple[Tally, int]] = {}
    for plan in (layout.for_rank(net, r) for r in range(d.mesh.size)) if plans is None else plans:
        coords = tuple(d.coord(axis, plan.rank) for axis in ("tp", "ep", "cp"))
        key = (plan.share, coords, frozenset(plan.kinds), plan.largest_rows)
        if key not in code:
            code[key] = unit_code(net, layout, plan)
        signature = stage_signature(net, layout, plan) if alike_stages else (plan.rank,)
        if signature not in costed:
            costed[signature] = (unit_traffic(net, layout, plan), step_flops(net, layout, plan))
        shared, rank_flops = costed[signature]
        tally = Tally(Counter(shared.sent), Counter(shared.received))
        step_end_traffic(tally, net, layout, plan)
        traffic.append(tally)
        held.append(rank_memory(net, layout, plan, slots_of[d.coord("pp", plan.rank)], code[key]))
        flops.append(rank_flops)
    return TrainCost(traffic, held, flops)


def stage_signature(net: Net, layout: Layout, plan: RankPlan) -> tuple:
    """What unit_traffic and step_flops read of a rank beyond its coordinates off the pp axis: the kinds of its
    chunks' units (units of a kind are alike but for their index) and its pipeline neighbours (pp_sends)."""
    d = layout.dims
    off_pp = tuple(d.coord(axis, plan.rank) for axis in d.mesh.names if axis != "pp")
    kinds = tuple(tuple(spec_of(net).kind(net, u) for u in chunk) for chunk in plan.chunks)
    return off_pp, kinds, pp_sends(net, layout, d.coord("pp", plan.rank))


def pp_sends(net: Net, layout: Layout, rp: int) -> tuple[int, int]:
    """How many of pipeline rank rp's chunks send a micro-batch's rows on to another rank in forward, and back in
    backward (V placement's turn at rank p - 1 stays on the rank)."""
    p, v = layout.dims.size("pp"), net.chunks
    placement = schedule_named(layout.schedule).placement
    stages = [stage_of(rp, c, p, placement) for c in range(v)]
    on = sum(s_ < p * v - 1 and rank_of(s_ + 1, p, placement) != rp for s_ in stages)
    back = sum(s_ > 0 and rank_of(s_ - 1, p, placement) != rp for s_ in stages)
    return on, back


@dataclass(frozen=True)
class UnitCode:
    """What a rank's units' code needs, read from the code itself: one Block a kind, the bytes each kind keeps for
    backward of one micro-batch, and the bytes of the scratch they share. It reads the rank's share, its tp, ep and
    cp coordinates, kinds and largest rows only, so ranks alike in these (the stages of a pipeline) share it."""

    blocks: dict[str, Block]
    kept: dict[str, int]
    scratch: int


def unit_code(net: Net, layout: Layout, plan: RankPlan) -> UnitCode:
    s, state = net.itemsize, net.policy.state.itemsize
    blocks = blocks_for(net, layout, plan, layout.sp and layout.dims.size("tp") > 1)
    rows = plan.largest_rows
    kept = {kind: nbytes(block.saved_shapes(rows), block.dtypes, s, state) for kind, block in blocks.items()}
    shapes, dtypes, _ = merged_scratch(blocks.values(), rows)
    return UnitCode(blocks, kept, nbytes(shapes, dtypes, s, state))


def unit_traffic(net: Net, layout: Layout, plan: RankPlan) -> Tally:
    """A rank's micro-batches' and gradients' bytes per axis."""
    tally = Tally()
    microbatch_traffic(tally, net, layout, plan)
    gradient_traffic(tally, net, layout, plan)
    return tally


def microbatch_traffic(tally: Tally, net: Net, layout: Layout, plan: RankPlan) -> None:
    """Per micro-batch: the tensor axis's points, cp's attention, ZeRO-3's gathers, ep's counts, pp's rows. s: bytes
    of a compute element (activations, parameters), g: of a gradient (the reduction dtype)."""
    d, s, h = layout.dims, net.itemsize, net.hidden
    policy, spec = net.policy, spec_of(net)
    g, state = policy.reduce.itemsize, policy.state.itemsize
    t, f, p, cp, ep = d.size("tp"), d.size("fsdp"), d.size("pp"), d.size("cp"), d.size("ep")
    sp, sharding = layout.sp and t > 1, layout.sharding
    j, rf, re = (d.coord(a, plan.rank) for a in ("tp", "fsdp", "ep"))
    on, back = pp_sends(net, layout, d.coord("pp", plan.rank))
    kinds = plan.kinds
    n_blocks = sum(kind in BLOCK_KINDS for kind in kinds)
    n_moe = kinds.count(EXPERT_KIND)  # the layers with a mixture of experts
    _, _, pieces = unit_shares(plan)
    forwards = 2 if layout.recompute == "full" else 1  # full recomputation runs each block's forward again
    # units of one kind, and micro-batches of equal rows, cost alike: each tallied once, times how many
    points = {kind: spec.points(net, kind, forwards if kind in BLOCK_KINDS else 1) for kind in kinds}
    for rows, n in microbatch_rows(plan).items():
        for kind, units_of_kind in Counter(kinds).items():
            tensor_traffic(tally, points[kind], rows, t, j, sp, h, s, g, state, n * units_of_kind)
        if cp > 1 and spec.has_attention:
            context_traffic(tally, net, layout, plan, rows, forwards, n_blocks, n)
        if sharding.params and f > 1 and sharding.reshard_after_forward:  # for forward, again for backward
            for alike, units_alike in Counter(pieces).items():
                shard_traffic(tally, alike, rf, re, s, False, 2 * n * units_alike)
        if cp > 1 and n_moe:
            routing_counts_traffic(tally, net, layout, plan, rows, forwards * n_moe * n)
        if ep > 1 and n_moe:  # each forward's counts: E / ep numbers (int64) to every other ep rank
            tally.add("ep", all_to_all_bytes([[8 * (net.experts // ep)] * ep] * ep, re), forwards * n_moe * n)
        if p > 1:  # a micro-batch's rows cross each stage boundary to another rank: on in forward, back in backward
            act = rows.local * h * s
            tally.add("pp", (act * on, act * back), n)
            tally.add("pp", (act * back, act * on), n)


def tied_exchanged(net: Net, plan: RankPlan, parts: list[int]) -> list[int]:
    """The optimizer parts of the tied weights whose other copy is on another stage's rank."""
    tied = {u for pair in spec_of(net).tied(net) for u in pair}
    units = [u.unit for u in plan.units]
    return [part for u, part in zip(units, parts, strict=True) if u in tied and not tied <= set(units)]


def gradient_traffic(tally: Tally, net: Net, layout: Layout, plan: RankPlan) -> None:
    """Once a step, per unit: ZeRO-3's gather kept for the step, the gradient's reduction over fsdp (and ZeRO-1/2's
    gather of the updated shard), its all-reduces over cp, dp and ep; a tied weight's over pp."""
    d, s, g, sharding = layout.dims, net.itemsize, net.policy.reduce.itemsize, layout.sharding
    f, dp, cp, ep = d.size("fsdp"), d.size("dp"), d.size("cp"), d.size("ep")
    rf, rd, rc, re = (d.coord(a, plan.rank) for a in ("fsdp", "dp", "cp", "ep"))
    widths, shards, pieces = unit_shares(plan)
    parts = shards if sharding.optimizer else widths
    for c, part in zip(pieces, parts, strict=True):
        if sharding.params and f > 1 and not sharding.reshard_after_forward:  # once a step, kept
            shard_traffic(tally, c, rf, re, s, False)
        if sharding.optimizer and f > 1:
            shard_traffic(tally, c, rf, re, g, True)
            if not sharding.params:
                shard_traffic(tally, c, rf, re, s, False)
        for axis, size, r in (("cp", cp, rc), ("dp", dp, rd)):
            if size > 1:
                tally.add(axis, all_reduce_bytes(part, size, r, g))
    for u in plan.units if ep > 1 else ():  # the dense part of each unit's (shard of its) gradient
        tally.add("ep", all_reduce_bytes(u.ep_summed, ep, re, g))
    for part in tied_exchanged(net, plan, parts):  # a tied weight's gradient, to and from the other end of the pipeline
        tally.add("pp", (part * g, part * g))


def step_end_traffic(tally: Tally, net: Net, layout: Layout, plan: RankPlan) -> None:
    """After the update: the balancing bias's loads, the gradient norm, the loss summed and broadcast."""
    d, rank, state = layout.dims, plan.rank, net.policy.state.itemsize
    t, f, dp, p, cp, ep = d.size("tp"), d.size("fsdp"), d.size("dp"), d.size("pp"), d.size("cp"), d.size("ep")
    j, rf, rd, rp, rc, re = (d.coord(a, rank) for a in ("tp", "fsdp", "dp", "pp", "cp", "ep"))
    sp, n_moe = layout.sp and t > 1, plan.kinds.count(EXPERT_KIND)
    if net.experts and net.bias_balance:  # each layer's loads (E a layer, float64), over the batch's ranks
        for axis, size, r in (("dp", dp, rd), ("fsdp", f, rf), ("ep", ep, re), ("cp", cp, rc)):
            if size > 1 and n_moe:
                tally.add(axis, all_reduce_bytes(n_moe * net.experts, size, r, 8))
    if net.clip_grad > 0:  # the squared gradient norm, summed over every rank
        tally.add("world", all_reduce_bytes(1, d.mesh.size, rank, 8))
    for axis, size, r in (
        ("tp", t if sp else 1, j),
        ("cp", cp, rc),
        ("ep", ep, re),
        ("fsdp", f, rf),
        ("dp", dp, rd),
    ):
        if size > 1:
            tally.add(axis, all_reduce_bytes(1, size, r, state))  # the loss
    if p > 1:
        placement = schedule_named(layout.schedule).placement
        tally.add("pp", broadcast_bytes(state, p, rp, root=rank_of(p * net.chunks - 1, p, placement)))


def rank_memory(net: Net, layout: Layout, plan: RankPlan, slots: int, code: UnitCode | None = None) -> dict[str, int]:
    """A rank's bytes held by kind: its state, its slots' activations (and stashes), its buffers. `code`: its
    unit_code, when the caller has it."""
    d, s, h = layout.dims, net.itemsize, net.hidden
    policy, sharding = net.policy, layout.sharding
    g, state = policy.reduce.itemsize, policy.state.itemsize
    f, p, m, v = d.size("fsdp"), d.size("pp"), net.microbatches, net.chunks
    chunks, kinds = plan.chunks, plan.kinds
    schedule = schedule_named(layout.schedule)
    rp, depth = d.coord("pp", plan.rank), max(map(len, chunks))
    widths, shards, _ = unit_shares(plan)
    parts = shards if sharding.optimizer else widths
    exchanged = tied_exchanged(net, plan, parts)
    rows = plan.largest_rows
    code = code or unit_code(net, layout, plan)
    blocks, kept = code.blocks, code.kept
    positions = block_positions(chunks, kinds)  # full recomputation: one layer's of each kind, refilled
    kept_layers = (
        sum(kept[kind] for kind in blocks if kind in BLOCK_KINDS)
        if layout.recompute == "full"
        else slots * sum(kept[kind] for here in positions for kind in here)
    )
    rerun = rows.local * h * s if layout.recompute == "full" else 0
    # split schedules: the stashes, each what one micro-batch's deferred weight gradients keep from I to W
    stashes = (
        stashed(layout.schedule, p, m, rp, v) if any(blocks[kind].defers for kind in kinds) and schedule.split else 0
    )
    products, values = stash_sizes(blocks, chunks, kinds, rows) if stashes else (0, 0)
    return memory(
        **state_memory(policy, net.optimizer, sharding, f, widths, shards, m, layout.overlap),
        activations=s * slots * (depth + 1) * rows.local * h
        + kept_layers
        + slots * sum(kept[kind] for kind in blocks if kind not in BLOCK_KINDS)
        + stashes * (products * s + values * g),
        buffers=code.scratch
        + rerun
        + reduction_bytes(layout, net, plan)
        + (state * max(parts) if net.optimizer == "adamw" else 0)  # AdamW's update scratch
        + (g * max(exchanged) if exchanged else 0),  # the tied gradient's other copy
    )


def pair_traffic(net, exchanged) -> Tally:
    """A mixture of experts' all-to-alls of rows over ep, from the pairs a rank sent to and received from other ep
    ranks (engine.exchanged: in forwards, in backwards): where tokens go is the routing's, so the closed form
    takes the counts. Forward: a pair's row (compute dtype) and gate (state dtype) out, its output back;
    backward: its output gradient out, its input gradient and its gate's gradient back."""
    tally = Tally()
    if not any(exchanged):  # no pair left its rank (or no experts)
        return tally
    row, gate = net.hidden * net.itemsize, net.policy.state.itemsize
    out_f, in_f, out_b, in_b = (int(n) for n in exchanged)
    tally.add(
        "ep",
        (
            out_f * (row + gate) + in_f * row + out_b * row + in_b * (row + gate),
            in_f * (row + gate) + out_f * row + in_b * row + out_b * (row + gate),
        ),
    )
    return tally


def uniform_exchanged(net: Net, layout: Layout, plan: RankPlan) -> list[int]:
    """engine.exchanged's four counts for one step if the routing were uniform (each pair's expert on any ep rank
    alike) and nothing dropped: what the planner assumes, where no routing has happened yet."""
    ep = layout.dims.size("ep")
    if ep == 1 or not net.experts:
        return [0, 0, 0, 0]
    blocks = plan.kinds.count(EXPERT_KIND)
    forwards = 2 if layout.recompute == "full" else 1
    mine = sum(plan.rows[k].matmul * net.top_k * n for k, n in plan.alike)
    every = sum(plan.group_pairs[k] * n for k, n in plan.alike)
    out, into = blocks * mine * (ep - 1) // ep, blocks * (every - mine) // ep
    return [forwards * out, forwards * into, out, into]


def routing_counts_traffic(tally: Tally, net: Net, layout: Layout, plan: RankPlan, rows, times: int) -> None:
    """`times` forwards' all-gathers over cp of a mixture of experts' pairs per (sequence, chunk held, expert)
    (int64), under a capacity or the balancing loss (routing_counts.WholeSequences); nothing otherwise."""
    if net.aux_loss or net.capacity_factor:
        held = [rows.sequences * len(chunks) * net.experts * 8 for chunks in layout.token_chunks(net)]
        tally.add("cp", all_gather_bytes(held, layout.dims.coord("cp", plan.rank), 1), times)


def context_traffic(
    tally: Tally, net: Net, layout: Layout, plan: RankPlan, rows, forwards: int, layers: int, times: int = 1
) -> None:
    """One micro-batch's (`times` such) attention traffic over cp, every layer: the layout's cp core's."""
    c, scale = layout.dims.coord("cp", plan.rank), rows.sequences * net.itemsize  # bytes a token and channel
    layout.cp.traffic(tally, plan.share, layout.tokens(net), scale, c, forwards, layers * times)


def attention_flops(net: Net, layout: Layout, plan: RankPlan, rows) -> int:
    """Matmul flops of one forward of the attention core (scores, then P V) on one micro-batch."""
    share, d, cp = plan.share, net.head_size, layout.dims.size("cp")
    if cp == 1:
        return 4 * rows.sequences * share.heads * net.seq**2 * d
    return layout.cp.flops(rows.sequences, share.heads, d, net.seq, cp, layout.dims.coord("cp", plan.rank))


def step_flops(net: Net, layout: Layout, plan: RankPlan) -> int:
    """Matmul flops of this rank's step: forward 2 per multiply-add, backward twice the forward; recomputed
    scores (ring attention and selective recomputation recompute P) and reruns (full) on top."""
    spec, share, kinds = spec_of(net), plan.share, plan.kinds
    rescored = layout.recompute == "selective" or (layout.dims.size("cp") > 1 and layout.cp.rescores)
    total = 0
    for rows, n in microbatch_rows(plan).items():  # equal rows, equal flops
        core = attention_flops(net, layout, plan, rows) if spec.has_attention else 0
        for kind, units in Counter(kinds).items():
            layer = kind in BLOCK_KINDS
            forward = spec.flops(net, kind, share, rows.matmul) + (core if layer else 0)
            again = core // 2 if rescored and layer else 0
            total += n * units * (3 * forward + again + (forward if layout.recompute == "full" and layer else 0))
    return total


def microbatch_rows(plan: RankPlan) -> Counter:
    """{rows: how many of the rank's micro-batches have them} (Layout.alike_microbatches)."""
    alike: Counter = Counter()
    for k, n in plan.alike:
        alike[plan.rows[k]] += n
    return alike
