"""A composed run as the training job sees a strategy: validate, build a rank, the closed-form cost,
the step table, the predicted bubble, the single-device reference."""

from __future__ import annotations

from dataclasses import dataclass, replace

from spmd.model.blocks import Role
from spmd.model.config import PIPELINE_MICROBATCHES_PER_STAGE, Net
from spmd.model.reference import reference_train
from spmd.model.registry import role_of, spec_of
from spmd.observe.schedule import Cell, Schedule
from spmd.parallel.accounting import TrainCost
from spmd.parallel.context import RING, CpCore
from spmd.parallel.cost import cost
from spmd.parallel.dims import Dims
from spmd.parallel.engine import ComposedRank
from spmd.parallel.layout import Layout
from spmd.parallel.pipeline_sim import schedule
from spmd.parallel.schedules import ideal_bubble
from spmd.transport.group import Group
from spmd.transport.mesh import Mesh


def default_microbatches(stages: int) -> int:
    """Without --microbatches: 2 a stage for a pipeline, the batch whole otherwise."""
    return PIPELINE_MICROBATCHES_PER_STAGE * stages if stages > 1 else 1


@dataclass(frozen=True)
class Composition:
    """`python -m spmd train`: any mesh of pp, dp, fsdp, ep, cp, tp; what fsdp shards, SP, the pipeline schedule,
    how attention crosses cp, what is recomputed."""

    zero: int = 3
    reshard: bool = True
    sp: bool = False
    pipeline: str = "1f1b"
    cp: CpCore = RING  # --cp as its core (context.core_named)
    recompute: str = "none"
    overlap: bool = True

    @staticmethod
    def reference(net: Net):
        return reference_train(net)

    def layout(self, mesh: Mesh) -> Layout:
        return Layout(
            Dims(mesh),
            zero=self.zero,
            reshard=self.reshard,
            sp=self.sp,
            schedule=self.pipeline,
            cp=self.cp,
            recompute=self.recompute,
            overlap=self.overlap,
        )

    def validate(self, net: Net, world_size: int, mesh: Mesh | None = None) -> Mesh:
        mesh = mesh or Mesh({"dp": world_size})
        mesh.check_world(world_size)
        self.layout(mesh).check(net)
        return mesh

    def build(self, world: Group, mesh: Mesh, net: Net) -> ComposedRank:
        return ComposedRank(world, self.layout(mesh), net)

    def cost(self, net: Net, mesh: Mesh) -> TrainCost:
        return cost(net, self.layout(mesh))

    def describe(self, mesh: Mesh) -> str:
        return self.layout(mesh).describe()

    def bubble(self, net: Net, mesh: Mesh) -> float:
        return ideal_bubble(self.pipeline, Dims(mesh).size("pp"), net.microbatches, net.chunks)

    def schedule(self, net: Net, mesh: Mesh) -> Schedule:
        """The step table: layer by layer without a pipeline, else the pipeline's, under the layer's collectives."""
        layout, dims = self.layout(mesh), Dims(mesh)
        each, after = layer_collectives(layout, dims, net)
        more: tuple[Schedule, ...] = ()
        if dims.size("cp") > 1 and spec_of(net).has_attention:
            more = (layout.cp.schedule(net.seq, dims.size("cp"), layout.for_rank(net, 0).share.heads),)
        if dims.size("pp") == 1:
            return replace(layer_table(layout, dims, net, after), more=more)
        table = schedule(self.pipeline, dims.size("pp"), net.microbatches, net.chunks)
        intro = (
            f"{net.model} on {layout.describe()}. Per layer and micro-batch: {'; '.join(each) or 'local'}. "
            f"After the last micro-batch: {'; '.join(after)}.\n{table.intro}"
        )
        return Schedule(intro, table.steps, more)


def layer_collectives(layout: Layout, dims: Dims, net: Net) -> tuple[list[str], list[str]]:
    """(what each layer runs on the other axes, per micro-batch; what the step runs after the last one)."""
    spec = spec_of(net)
    passes = spec.passes
    each = []
    if dims.size("tp") > 1 and spec.loss_unit(net):
        each.append(
            "tp: the embedding's RS (SP) or AR of its rows; the head's vocab-parallel cross-entropy: AR MAX "
            "of the row maxima, AR SUM of [sum exp, target logit] (backward: no collective but dx's "
            + ("RS)" if layout.sp else "AR)")
        )
    if dims.size("cp") > 1 and spec.has_attention:
        each.append(layout.cp.collectives)
    if dims.size("ep") > 1 and net.experts:
        each.append(
            "ep: the mixture of experts' dispatch (A2A the counts, then each pair's row and gate to its "
            "expert's rank) and combine (A2A the outputs back); backward: A2A dy out, dx and the gates' "
            "gradients back"
        )
    if dims.size("tp") > 1:
        each.append(
            f"tp: {passes} x (AG in, RS out; backward AG dy, AG in again, RS dx, AR gain grad)"
            if layout.sp
            else f"tp: {passes} x (AR out; backward AR dx)"
        )
    if layout.sharding.params and dims.size("fsdp") > 1:
        each.append(
            "fsdp: AG the layer before its forward and again before its backward"
            if layout.sharding.reshard_after_forward
            else "fsdp: AG the layer before its first forward of the step (kept until the update)"
        )
    after = []
    if layout.sharding.optimizer and dims.size("fsdp") > 1:
        if layout.sharding.grads and net.microbatches == 1:
            each.append("fsdp: RS the layer's gradient as its backward ends")
        else:
            after.append("RS each layer's gradient over fsdp")
    reduced = [axis for axis in ("cp", "dp") if dims.size(axis) > 1]
    if reduced:
        after.append(f"AR it over {' and '.join(reduced)}")
    if dims.size("ep") > 1:
        after.append("AR each gradient's dense part (all but the experts') over ep")
    spec = spec_of(net)
    if spec.tied(net):
        after.append("sum the tied weight's two gradients" + (" (exchanged over pp)" if dims.size("pp") > 1 else ""))
    if net.clip_grad > 0:
        after.append("AR the squared gradient norm over the world; clip")
    after.append(
        f"{net.optimizer.upper() if net.optimizer == 'sgd' else 'AdamW'} on what this rank owns"
        + (
            "; AG the layer over fsdp"
            if layout.sharding.optimizer and not layout.sharding.params and dims.size("fsdp") > 1
            else ""
        )
    )
    return each, after


def layer_table(layout: Layout, dims: Dims, net: Net, after: list[str]) -> Schedule:
    """Every rank does the same, layer by layer: the collectives of each layer's forward and backward, by axis."""
    gather = "AG W{l} over fsdp; " if layout.sharding.params and dims.size("fsdp") > 1 else ""
    again = gather if layout.sharding.reshard_after_forward else ""
    tp, sp = dims.size("tp") > 1, layout.sp and dims.size("tp") > 1
    forward = gather + (
        "AG X{l}g over tp; W{l} forward; RS y over tp" if sp else "W{l} forward; AR over tp" if tp else "W{l} forward"
    )
    has_attention = spec_of(net).has_attention
    if dims.size("cp") > 1 and has_attention:
        forward += layout.cp.forward_text
    dispatch = "; dispatch and combine: A2A counts, rows, gates over ep, outputs back" if dims.size("ep") > 1 else ""
    if layout.recompute == "full":
        again += "rerun W{l} forward; "
    backward = again + (
        "AG dy, AG X{l}g over tp; W{l} backward; RS dx over tp; AR dg{l} over tp"
        if sp
        else "W{l} backward; AR over tp"
        if tp
        else "W{l} backward"
    )
    if dims.size("cp") > 1 and has_attention:
        backward += layout.cp.backward_text
    returned = "; A2A dy over ep, dx and gate gradients back" if dims.size("ep") > 1 else ""
    scatter = (
        "; RS dW{l} over fsdp" if layout.sharding.grads and net.microbatches == 1 and dims.size("fsdp") > 1 else ""
    )
    # a mixture of experts' layer adds its all-to-alls over ep
    layer = {
        Role.BLOCK: (forward, backward + scatter),
        Role.EXPERTS: (forward + dispatch, backward + returned + scatter),
    }
    same = lambda text: [Cell(text) for _ in range(dims.mesh.size)]  # noqa: E731
    texts = {**layer, **end_units(layout, dims, gather, again)}
    roles = [role_of(net, kind) for kind in spec_of(net).kinds(net)]
    steps = [(f"fwd {i}", same(texts[role][0].format(l=i))) for i, role in enumerate(roles)]
    steps += [(f"bwd {i}", same(texts[role][1].format(l=i))) for i, role in reversed(list(enumerate(roles)))]
    steps.append(("update", same("; ".join(after))))
    twice = " (a layer: attention, then its MLP, each so)" if spec_of(net).passes == 2 else ""
    return Schedule(
        f"{net.model} on {layout.describe()}{twice}: AG all-gather, RS reduce-scatter, AR all-reduce.", steps
    )


def end_units(layout: Layout, dims: Dims, gather: str, again: str) -> dict[Role, tuple[str, str]]:
    """(forward, backward) of the units that are not blocks (the LM's embedding, final norm, head), by role."""
    tp, sp = dims.size("tp") > 1, layout.sp and dims.size("tp") > 1
    scatter = "; RS rows over tp" if sp else "; AR rows over tp" if tp else ""
    loss = "; AR MAX row maxima, AR SUM [sum exp, target logit] over tp" if tp else ""
    fsdp_rs = "; RS dW{l} over fsdp" if layout.sharding.grads and dims.size("fsdp") > 1 else ""
    return {
        Role.EMBEDDING: (
            gather + "embedding lookup (own vocabulary rows)" + scatter,
            again + ("AG dy over tp; " if sp else "") + "scatter-add dE" + fsdp_rs,
        ),
        Role.NORM: (
            gather + "final RMSNorm",
            again + "final RMSNorm backward" + ("; AR dg over tp" if sp else "") + fsdp_rs,
        ),
        Role.HEAD: (
            gather + ("AG x over tp; " if sp else "") + "logits of own vocabulary columns" + loss,
            again + ("AG x over tp; " if sp else "") + "dz = p - onehot; dW, dx" + scatter + fsdp_rs,
        ),
    }
