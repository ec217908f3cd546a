"""The planner at real scale: every composed layout (pp x dp/fsdp x ep x cp x tp, SP, recomputation; ep for a
mixture of experts) of the transformer or the LM on a cluster, from the same cost function the composition
tests assert at small scale; and the training state alone for a raw parameter count (ZeRO's Figure 1 setting).

The cost of a layout is evaluated exactly (cost.cost) for the ranks that hold the most of each pipeline stage
(cost.representatives); the step time adds compute (the matmul flops at the cluster's rate, stretched by the
schedule's bubble) and communication (bytes per axis over its link), with no overlap assumed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from spmd.layout import block_size
from spmd.model.config import Net
from spmd.model.precision import Precision
from spmd.parallel.context import DEFAULT_CP
from spmd.parallel.cost import cost, pair_traffic, representatives, state_memory, uniform_exchanged
from spmd.parallel.dims import Dims
from spmd.parallel.layout import RECOMPUTE, Layout
from spmd.parallel.schedules import ideal_bubble
from spmd.parallel.sharding import ZERO
from spmd.parallel.strategy import Composition
from spmd.plan.estimate import Cluster, Estimate, inside_a_node
from spmd.transport.mesh import Mesh


@dataclass(frozen=True)
class Choices:
    """What the search may pick: recomputation, cp variant, ZeRO stages of the fsdp axis, the largest cp; a mesh
    given (--mesh): only its layouts."""

    recompute: tuple[str, ...] = RECOMPUTE
    cp: str = DEFAULT_CP
    zero: tuple[int, ...] = tuple(sorted(ZERO))
    max_cp: int = 4
    pipeline: str = "1f1b"
    mesh: Mesh | None = None


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(net: Net, devices: int, per_node: int, choices: Choices):
    """(mesh, Composition, Net) of every layout to try: tp within a node, data axes dp (replicated) or fsdp
    at each ZeRO stage, 2 micro-batches a pipeline stage (fewer if the batch runs out)."""
    if choices.mesh is not None:
        yield from mesh_candidates(net, choices.mesh, choices)
        return
    for tp in (t for t in divisors(devices) if t <= min(per_node, net.heads)):
        for cp in (c for c in divisors(devices // tp) if c <= choices.max_cp):
            for pp in (p for p in divisors(devices // (tp * cp)) if p <= net.layers):
                batch = devices // (tp * cp * pp)  # the ranks the batch is split over: dp or fsdp, x ep
                per_rank = block_size(net.batch, batch, batch - 1)
                microbatches = max(1, min(2 * pp if pp > 1 else 1, per_rank))
                if per_rank < 1 or (pp > 1 and microbatches < pp):
                    continue
                # a mixture of experts: its experts over ep (a divisor of E), the rest of the data axis dp or fsdp
                for ep in (e for e in divisors(batch) if net.experts % e == 0) if net.experts else (1,):
                    data = batch // ep
                    for axis, zero in [("dp", 3), *(("fsdp", z) for z in choices.zero)]:
                        mesh = Mesh(
                            {a: n for a, n in (("pp", pp), (axis, data), ("ep", ep), ("cp", cp), ("tp", tp)) if n > 1}
                            or {"dp": 1}
                        )
                        for recompute in choices.recompute:
                            composition = Composition(
                                zero=zero, sp=tp > 1, cp=choices.cp, recompute=recompute, pipeline=choices.pipeline
                            )
                            yield mesh, composition, replace(net, microbatches=microbatches)
                        if data == 1:
                            break  # no data axis: the ZeRO stages are all the same


def mesh_candidates(net: Net, mesh: Mesh, choices: Choices):
    """The layouts of one mesh as given: each ZeRO stage if it has an fsdp axis, each recomputation; micro-batches
    as candidates() picks them. One that cannot run is refused by estimate_layout, with why."""
    size = lambda axis: mesh.axis_size(axis) if axis in mesh.names else 1  # noqa: E731
    pp, data = size("pp"), size("dp") * size("fsdp") * size("ep")
    microbatches = max(1, min(2 * pp if pp > 1 else 1, block_size(net.batch, data, data - 1)))
    for zero in choices.zero if size("fsdp") > 1 else (3,):
        for recompute in choices.recompute:
            composition = Composition(
                zero=zero, sp=size("tp") > 1, cp=choices.cp, recompute=recompute, pipeline=choices.pipeline
            )
            yield mesh, composition, replace(net, microbatches=microbatches)


def estimate_layout(net: Net, mesh: Mesh, composition: Composition, cluster: Cluster) -> Estimate:
    layout = composition.layout(mesh)
    layout.check(net)
    plans = [layout.for_rank(net, rank) for rank in representatives(layout)]  # each derived once, asked twice
    c = cost(net, layout, plans)
    for tally, plan in zip(c.traffic, plans, strict=True):  # over ep: the pairs' rows, as if routed uniformly
        moved = pair_traffic(net, uniform_exchanged(net, layout, plan))
        tally.sent.update(moved.sent)
        tally.received.update(moved.received)
    worst = max(range(len(plans)), key=lambda i: sum(c.memory[i].values()))
    links = {
        axis: "-" if mesh.axis_size(axis) == 1 else "node" if inside_a_node(mesh, axis, cluster.per_node) else "network"
        for axis in mesh.names
    }
    bandwidth = {"node": cluster.intra_bytes_per_s, "network": cluster.inter_bytes_per_s, "-": float("inf")}
    comm = max(sum(t.sent[axis] / bandwidth[links[axis]] for axis in mesh.names) for t in c.traffic)
    bubble = ideal_bubble(composition.pipeline, Dims(mesh).size("pp"), net.microbatches, net.chunks)
    compute = max(c.flops) / cluster.flops_per_s / (1 - bubble)
    sent = {axis: max(t.sent[axis] for t in c.traffic) for axis in mesh.names}
    fits = sum(c.memory[worst].values()) <= cluster.memory_bytes
    name = (
        layout.describe()
        .replace("mesh ", "")
        .replace("fsdp shards as ", "")
        .replace("FSDP (ZeRO-3)", "ZeRO-3")
        .replace(" recomputation", " recompute")
    )
    return Estimate(f"{name}, m {net.microbatches}", mesh, c.memory[worst], sent, links, compute, comm, fits)


def plan_layouts(net: Net, cluster: Cluster, choices: Choices = Choices()):
    """Every layout that can run: fitting ones first, fastest first; and those refused, with why."""
    estimates, refused = [], []
    for mesh, composition, model in candidates(net, cluster.devices, cluster.per_node, choices):
        try:
            estimates.append(estimate_layout(model, mesh, composition, cluster))
        except ValueError as exc:
            refused.append((composition.layout(mesh).describe(), mesh, str(exc)))
    estimates.sort(key=lambda e: (not e.fits, e.step_seconds if e.fits else e.peak))
    return estimates, refused


STAGES = {
    "DP": ("dp", 3),
    "ZeRO-1 (P_os)": ("fsdp", 1),
    "ZeRO-2 (P_os+g)": ("fsdp", 2),
    "ZeRO-3 (P_os+g+p)": ("fsdp", 3),
}


def state_per_device(parameters: int, layers: int, devices: int, policy: Precision, optimizer: str) -> dict:
    """ZeRO's Figure 1 setting: the training state alone (no activations) of `parameters` in `layers` equal
    layers, per device, under DP and each ZeRO stage over `devices`: {stage: bytes by kind}. The blocking
    engine's (--no-overlap): with overlap, ZeRO-2 and 3 hold a second layer buffer each (cost.state_memory)."""
    if parameters % layers:
        raise ValueError(f"--parameters {parameters} is not a multiple of --layers {layers} (equal layers)")
    width = parameters // layers
    table = {}
    for name, (axis, zero) in STAGES.items():
        layout = Layout(Dims(Mesh({axis: devices})), zero=zero)
        shard = block_size(width, devices, 0) if axis == "fsdp" else width
        table[name] = state_memory(
            policy, optimizer, layout.sharding, devices if axis == "fsdp" else 1, [width] * layers, [shard] * layers, 1
        )
    return table
