"""The one planner, for every model: each layout (pp x dp/fsdp x ep x cp x tp, SP, recomputation; ep for a mixture
of experts) of a model on a cluster, or the mlp-* presets on every mesh of their axes, estimated by one function
from the same cost function the composition tests assert at small scale; and the training state alone for a raw
parameter count (ZeRO's Figure 1 setting).

The cost of a layout is evaluated exactly (cost.cost) for the ranks that hold the most of each pipeline stage
(cost.representatives; a preset: every rank); the step time adds compute (the matmul flops at the cluster's
rate, stretched by the schedule's bubble) and communication (bytes per axis over its link), with no overlap
assumed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from spmd.layout import block_size
from spmd.model.config import Net
from spmd.model.precision import Precision
from spmd.parallel.context import RING, CpCore
from spmd.parallel.cost import cost, pair_traffic, representatives, state_memory, uniform_exchanged
from spmd.parallel.dims import Dims
from spmd.parallel.layout import RECOMPUTE, Layout
from spmd.parallel.schedules import ideal_bubble
from spmd.parallel.sharding import ZERO
from spmd.parallel.strategy import Composition
from spmd.plan.cluster import Cluster, Estimate
from spmd.trainers.presets import PRESETS, Preset
from spmd.transport.mesh import Mesh

COMPUTED_ITEMSIZE = 4  # the presets' costs are evaluated in float32, then scaled: every figure is elements x bytes


@dataclass(frozen=True)
class Choices:
    """What the search may pick: recomputation, cp variant, ZeRO stages of the fsdp axis, the largest cp; a mesh
    given (--mesh): only its layouts."""

    recompute: tuple[str, ...] = RECOMPUTE
    cp: CpCore = RING
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


def estimate_layout(
    net: Net,
    mesh: Mesh,
    composition: Composition,
    cluster: Cluster,
    name: str = "",
    scale: tuple[int, int] = (1, 1),
    every_rank: bool = False,
) -> Estimate:
    """One layout on the cluster; ValueError if it cannot run (the reason named). `name`: the row's (default: the
    layout described); `scale` (n, d): every byte figure times n / d (a float32 evaluation at --bytes n). The
    ranks costed: cost.representatives (the fullest among them), or `every_rank` (also the one that sends the
    most where uneven blocks make a ring's senders differ: what the measured runs are checked against)."""
    layout = composition.layout(mesh)
    layout.check(net)
    ranks = range(mesh.size) if every_rank else representatives(layout)
    plans = layout.for_ranks(net, ranks)  # each derived once, asked twice
    c = cost(net, layout, plans, alike_stages=True)
    for tally, plan in zip(c.traffic, plans, strict=True):  # over ep: the pairs' rows, as if routed uniformly
        moved = pair_traffic(net, uniform_exchanged(net, layout, plan))
        tally.sent.update(moved.sent)
        tally.received.update(moved.received)
    scaled = lambda nbytes: nbytes * scale[0] // scale[1]  # noqa: E731
    worst = max(range(len(plans)), key=lambda i: sum(c.memory[i].values()))
    memory = {kind: scaled(n) for kind, n in c.memory[worst].items()}
    links = cluster.links(mesh)
    comm = max(sum(scaled(t.sent[axis]) / cluster.bandwidth(links[axis]) for axis in mesh.names) for t in c.traffic)
    bubble = ideal_bubble(composition.pipeline, Dims(mesh).size("pp"), net.microbatches, net.chunks)
    compute = max(c.flops) / cluster.flops_per_s / (1 - bubble)
    sent = {axis: max(scaled(t.sent[axis]) for t in c.traffic) for axis in mesh.names}
    fits = sum(memory.values()) <= cluster.memory_bytes
    return Estimate(name or layout_name(layout, net), mesh, memory, sent, links, compute, comm, fits)


def layout_name(layout: Layout, net: Net) -> str:
    """A layout's row: its description, shortened, and its micro-batches."""
    name = (
        layout.describe()
        .replace("mesh ", "")
        .replace("fsdp shards as ", "")
        .replace("FSDP (ZeRO-3)", "ZeRO-3")
        .replace(" recomputation", " recompute")
    )
    return f"{name}, m {net.microbatches}"


def ranked(estimates: list[Estimate]) -> list[Estimate]:
    """Fitting ones first, fastest first; the rest by their peak."""
    return sorted(estimates, key=lambda e: (not e.fits, e.step_seconds if e.fits else e.peak))


def plan_layouts(net: Net, cluster: Cluster, choices: Choices = Choices()):
    """Every layout that can run, ranked; and those refused, with why."""
    estimates, refused = [], []
    for mesh, composition, model in candidates(net, cluster.devices, cluster.per_node, choices):
        try:
            estimates.append(estimate_layout(model, mesh, composition, cluster))
        except ValueError as exc:
            refused.append((composition.layout(mesh).describe(), mesh, str(exc)))
    return ranked(estimates), refused


def preset_meshes(preset: Preset, devices: int) -> list[Mesh]:
    """Every mesh of the preset's axes over `devices` (2-D: each divisor for the last axis)."""
    if len(preset.axes) == 1:
        return [Mesh({preset.axes[0]: devices})]
    outer, inner = preset.axes
    return [Mesh({outer: devices // t, inner: t}) for t in range(1, devices + 1) if devices % t == 0]


def preset_net(preset: Preset, shape: dict, microbatches: int, stages: int) -> Net:
    """The MLP of `shape` (Net's fields) as `preset` runs it, in float32: a pipeline streams `microbatches`,
    an interleaved one 2 chunks a rank where the layers allow (micro-batches not a multiple of the stages are
    refused: listed as refused)."""
    chunks = max(1, min(2, shape["layers"] // stages)) if preset.chunked and stages > 1 else 1
    m = microbatches if preset.pipelined else 1
    return preset.net(**shape, microbatches=m, chunks=chunks, dtype="float32")


def plan_presets(
    shape: dict,
    microbatches: int,
    element_bytes: int,
    cluster: Cluster,
    names: list[str] | None = None,
    mesh: Mesh | None = None,
):
    """The mlp-* presets on every mesh of their axes (or `mesh`, for those of its axes), ranked, with the same
    estimate as every layout; and those that cannot run, why."""
    estimates, refused = [], []
    for name in names or PRESETS:
        preset = PRESETS[name]
        meshes = preset_meshes(preset, cluster.devices) if mesh is None else [mesh] * (mesh.names == preset.axes)
        for candidate in meshes:
            try:
                net = preset_net(preset, shape, microbatches, candidate.size if preset.pipelined else 1)
                candidate = preset.validate(net, cluster.devices, candidate)
                scale = (element_bytes, COMPUTED_ITEMSIZE)
                estimates.append(estimate_layout(net, candidate, preset.composition, cluster, name, scale, True))
            except ValueError as exc:
                refused.append((name, candidate, str(exc)))
    return ranked(estimates), refused


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
