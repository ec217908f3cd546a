"""The mlp-* commands as presets of `python -m spmd train`: plain data, each fixed mesh axes and a Composition.

`python -m spmd mlp-fsdp` is `python -m spmd train --model mlp --mesh fsdp=N` with one token a sequence, its rows
spelled --tokens: the same parser (spmd/harness/compose_cli.py, the flags a preset has), engine, cost model and
checks as every composition (spmd/parallel). What a preset adds is its words: a refusal names the flags of its
own command (--tokens, not --batch; the command itself, not --sp), never one it does not have.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import ClassVar

from spmd.model.config import Net
from spmd.parallel.schedules import schedule_named
from spmd.parallel.strategy import Composition, default_microbatches
from spmd.transport.mesh import Mesh, resolve_mesh

# Net's fields a preset takes as flags, with its own spelling, default and help where train's do not fit: its rows
# are --tokens (one token a sequence), --steps and --microbatches default from the run.
MLP_FLAGS: dict[str, dict] = {
    "layers": {},
    "hidden": {},
    "ffn": {},
    "batch": {
        "flag": "tokens",
        "default": 64,
        "metavar": "TOKENS",
        "help": "rows of X per step (batch x sequence; default %(default)s)",
    },
    "microbatches": {"help": "pipelines: micro-batches per step (default 2 per stage)"},
    "chunks": {"help": "interleaved pipelines: model chunks per rank, v (default 2)"},
    "steps": {"default": None, "help": "optimizer steps (default 2; 1 with --integers)"},
    "dtype": {},
    "lr": {"help": "learning rate > 0 (default 0.2 / (tokens x hidden): the loss is a sum; AdamW 1e-3)"},
    "momentum": {},
    "integers": {
        "help": "small integer inputs and weights: one step, bitwise equal to the single-device step "
        "(refused at sizes where a sum could round)"
    },
    "seed": {"help": "the initial weights' and the data's"},
    "optimizer": {},
    "precision": {},
    "reduce_dtype": {},
    "weight_decay": {},
}


@dataclass(frozen=True)
class Preset:
    """An mlp-* command: `train` with the MLP, one token a sequence, these mesh axes and this composition.

    Attributes:
        name: the command (`python -m spmd <name>`).
        summary: one line for --help.
        axes: its mesh axes, in order (1 axis: all ranks by default).
        composition: what the fsdp axis shards, SP, the pipeline schedule (--no-overlap sets its overlap).
        fixed: the Net fields the command sets itself; flags: the Net fields it takes as flags, with their
            spelling, default and help where they are not train's (MLP_FLAGS).
    """

    name: str
    summary: str
    axes: tuple[str, ...]
    composition: Composition = Composition()
    fixed: ClassVar[dict] = {"model": "mlp", "seq": 1, "heads": 1}
    flags: ClassVar[dict[str, dict]] = MLP_FLAGS

    @property
    def pipelined(self) -> bool:
        """It streams the batch in micro-batches (the others take it whole)."""
        return "pp" in self.axes

    @property
    def chunked(self) -> bool:
        """It runs several model chunks per rank (the others exactly 1)."""
        return self.pipelined and schedule_named(self.composition.pipeline).chunked

    def flag(self, field: str) -> str:
        """The command's flag for Net's `field`."""
        return "--" + self.flags.get(field, {}).get("flag", field).replace("_", "-")

    def words(self, message: str) -> str:
        """A message of Net, the composition or a checkpoint in this command's flags (--tokens for --batch); a
        field it fixes named as such (a checkpoint of train's with --seq 8: "mlp-dp's fixed seq differs")."""
        for field, spelled in self.flags.items():
            if "flag" in spelled:
                message = re.sub(rf"--{field.replace('_', '-')}\b", self.flag(field), message)
        for field in self.fixed:
            message = re.sub(rf"--{field}\b", f"{self.name}'s fixed {field}", message)
        return message

    def fields_of(self, keywords: dict) -> dict:
        """Keywords spelled as this command's flags (tokens=, layers=, ...) as Net's fields; a TypeError names one
        it does not take."""
        names = {self.flag(f)[2:].replace("-", "_"): f for f in self.flags}
        unknown = [k for k in keywords if k not in names]
        if unknown:
            raise TypeError(f"{self.name} takes no {unknown[0]}= (its keywords: {', '.join(names)})")
        return {names[k]: v for k, v in keywords.items()}

    def net(self, **fields) -> Net:
        """The run of these Net fields and the fixed ones; a ValueError in this command's flags."""
        try:
            return Net(**{**fields, **self.fixed})
        except ValueError as exc:
            raise ValueError(self.words(str(exc))) from None

    def mesh(self, world_size: int, mesh: Mesh | None = None) -> Mesh:
        """`mesh` checked against the preset's axes and the world, or the default: one axis over every rank."""
        return resolve_mesh(self.name, self.axes, world_size, mesh)

    def resolve(self, world_size: int, mesh: Mesh | None = None, **fields) -> tuple[Net, Mesh]:
        """The run and its mesh from the flags given (Net's names; None: the command's default): micro-batches 2
        a stage for a pipeline (at most a row each), 2 chunks for an interleaved one, 1 step with --integers."""
        mesh = self.mesh(world_size, mesh)
        given = {k: v for k, v in fields.items() if v is not None}
        rows = given.get("batch", self.flags["batch"]["default"])
        stages = mesh.axis_size("pp") if self.pipelined else 1
        given.setdefault("batch", rows)
        given.setdefault("microbatches", min(default_microbatches(stages), rows))
        given.setdefault("chunks", 2 if self.chunked else 1)
        given.setdefault("steps", 1 if given.get("integers") else Net().steps)
        net = self.net(**given)
        return net, self.validate(net, world_size, mesh)

    def validate(self, net: Net, world_size: int, mesh: Mesh | None = None) -> Mesh:
        """The mesh, after every check of the preset against the world and the run, in the command's words."""
        mesh = self.mesh(world_size, mesh)
        if net.microbatches != 1 and not self.pipelined:
            raise ValueError(f"strategy {self.name!r} takes the batch whole: micro-batches are for pipelines")
        if net.chunks != 1 and not self.chunked:
            raise ValueError(
                f"strategy {self.name!r} runs one model chunk per rank: --chunks is for "
                "interleaved pipelines (mlp-pp-interleaved)"
            )
        self.check_rows(net, mesh)
        try:
            self.composition.layout(mesh).check(net)
        except ValueError as exc:
            raise ValueError(self.words(str(exc))) from None
        return mesh

    def check_rows(self, net: Net, mesh: Mesh) -> None:
        """Every rank and micro-batch gets a row (the composition's own check speaks of sequences and --sp)."""
        data = [axis for axis in mesh.names if axis in ("dp", "fsdp")]
        ranks = math.prod(mesh.axis_size(axis) for axis in data)
        fewest, tokens = net.batch // ranks, self.flag("batch")
        if fewest == 0:
            raise ValueError(f"{tokens} {net.batch} over {ranks} {' x '.join(data)} ranks leaves a rank no row")
        if fewest < net.microbatches:
            raise ValueError(
                f"{tokens} {net.batch} give {fewest} rows, fewer than --microbatches {net.microbatches}: "
                "a micro-batch would get no row"
            )
        tp = mesh.axis_size("tp") if "tp" in mesh.names else 1
        if self.composition.sp and fewest // net.microbatches < tp:
            raise ValueError(
                f"{self.name}: {tokens} {net.batch} split over the tp={tp} ranks between the matmuls "
                "leaves a rank no row"
            )

    def with_overlap(self, overlap: bool) -> Composition:
        """The composition to run: overlapped collectives, or blocking ones (--no-overlap)."""
        return replace(self.composition, overlap=overlap)


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        Preset("mlp-dp", "MLP training, data parallel: batch split, gradients all-reduced", ("dp",)),
        Preset("mlp-zero1", "MLP training, ZeRO-1: optimizer state sharded", ("fsdp",), Composition(zero=1)),
        Preset(
            "mlp-zero2", "MLP training, ZeRO-2: optimizer state and gradients sharded", ("fsdp",), Composition(zero=2)
        ),
        Preset(
            "mlp-fsdp",
            "MLP training, FSDP (ZeRO-3): parameters, gradients, optimizer sharded",
            ("fsdp",),
            Composition(zero=3),
        ),
        Preset(
            "mlp-tp",
            "MLP training, Megatron tensor parallel: W1 by columns, W2 by rows, 2 all-reduces a layer",
            ("tp",),
        ),
        Preset(
            "mlp-sp",
            "MLP training, Megatron sequence parallel around TP: rows split between the matmuls",
            ("tp",),
            Composition(sp=True),
        ),
        Preset(
            "mlp-pp-gpipe",
            "MLP training, pipeline parallel (GPipe): layers split into stages, micro-batches streamed",
            ("pp",),
            Composition(pipeline="gpipe"),
        ),
        Preset(
            "mlp-pp-1f1b",
            "MLP training, pipeline parallel (1F1B): at most p - r micro-batches in flight",
            ("pp",),
            Composition(pipeline="1f1b"),
        ),
        Preset(
            "mlp-pp-interleaved",
            "MLP training, interleaved 1F1B: v model chunks per rank (--chunks)",
            ("pp",),
            Composition(pipeline="interleaved-1f1b"),
        ),
        Preset("mlp-fsdp-tp", "MLP training, FSDP over one mesh axis x tensor parallel over the other", ("fsdp", "tp")),
    ]
}
