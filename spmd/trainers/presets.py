"""The mlp-* strategies as presets of the composed engine: each one fixed mesh axes and a Composition.

`python -m spmd mlp-fsdp` is `python -m spmd train --model mlp --mesh fsdp=N` with one token a sequence;
the presets keep their names, flags and reports, and run on the same engine, cost model and checks as
every composition (spmd/parallel).
"""

from __future__ import annotations

from dataclasses import replace

from spmd.model.config import Net
from spmd.parallel.strategy import Composition
from spmd.trainers.strategy import TrainingStrategy
from spmd.workloads.mlp import MLP


def as_net(mlp: MLP | Net, **more) -> Net:
    """The MLP run as the composed engine's model: each token a sequence of one (rows are independent);
    `more`: Net's other fields (optimizer, precision, ...). A Net is already one."""
    if isinstance(mlp, Net):
        return mlp
    fields = dict(
        model="mlp",
        layers=mlp.layers,
        hidden=mlp.hidden,
        ffn=mlp.ffn,
        heads=1,
        seq=1,
        batch=mlp.tokens,
        microbatches=mlp.microbatches,
        chunks=mlp.chunks,
        steps=mlp.steps,
        dtype=mlp.dtype,
        lr=mlp.lr,
        momentum=mlp.momentum,
        integers=mlp.integers,
        seed=mlp.seed,
    )
    return Net(**{**fields, **more})


def in_preset_words(message: str, name: str, mlp: MLP | Net) -> str:
    """The engine's message in the preset's flags: its rows are --tokens (a token a sequence), its sequence
    parallelism is the command itself (it has no --sp)."""
    net = as_net(mlp)
    message = message.replace(f"--batch {net.batch} ", f"--tokens {net.batch} ")
    message = message.replace(" sequences, fewer than --microbatches", " rows, fewer than --microbatches")
    return message.replace(
        "--sp: a micro-batch of",
        f"{name}: --tokens {net.batch} in --microbatches {net.microbatches} make a micro-batch of",
    )


def preset(name: str, summary: str, axes: tuple[str, ...], composition: Composition) -> TrainingStrategy:
    def check(mlp, mesh) -> None:
        try:
            composition.layout(mesh).check(as_net(mlp))
        except ValueError as exc:
            raise ValueError(in_preset_words(str(exc), name, mlp)) from None

    pipeline = axes == ("pp",)
    return TrainingStrategy(
        name=name,
        summary=summary,
        axes=axes,
        build=lambda world, mesh, mlp: composition.build(world, mesh, as_net(mlp)),
        cost=lambda mlp, mesh: composition.cost(as_net(mlp), mesh),
        check=check,
        schedule=lambda mlp, mesh: composition.schedule(as_net(mlp), mesh),
        microbatched=pipeline,
        bubble=(lambda mlp, mesh: composition.bubble(as_net(mlp), mesh)) if pipeline else None,
        chunked=pipeline and composition.pipeline == "interleaved-1f1b",
        describe=lambda mesh: composition.describe(mesh),
        reference=lambda mlp: composition.reference(as_net(mlp)),
        blocking=lambda: preset(name, summary, axes, replace(composition, overlap=False)),
    )


PRESETS = [
    preset("mlp-dp", "MLP training, data parallel: batch split, gradients all-reduced", ("dp",), Composition()),
    preset("mlp-zero1", "MLP training, ZeRO-1: optimizer state sharded", ("fsdp",), Composition(zero=1)),
    preset("mlp-zero2", "MLP training, ZeRO-2: optimizer state and gradients sharded", ("fsdp",), Composition(zero=2)),
    preset(
        "mlp-fsdp",
        "MLP training, FSDP (ZeRO-3): parameters, gradients, optimizer sharded",
        ("fsdp",),
        Composition(zero=3),
    ),
    preset(
        "mlp-tp",
        "MLP training, Megatron tensor parallel: W1 by columns, W2 by rows, 2 all-reduces a layer",
        ("tp",),
        Composition(),
    ),
    preset(
        "mlp-sp",
        "MLP training, Megatron sequence parallel around TP: rows split between the matmuls",
        ("tp",),
        Composition(sp=True),
    ),
    preset(
        "mlp-pp-gpipe",
        "MLP training, pipeline parallel (GPipe): layers split into stages, micro-batches streamed",
        ("pp",),
        Composition(pipeline="gpipe"),
    ),
    preset(
        "mlp-pp-1f1b",
        "MLP training, pipeline parallel (1F1B): at most p - r micro-batches in flight",
        ("pp",),
        Composition(pipeline="1f1b"),
    ),
    preset(
        "mlp-pp-interleaved",
        "MLP training, interleaved 1F1B: v model chunks per rank (--chunks)",
        ("pp",),
        Composition(pipeline="interleaved-1f1b"),
    ),
    preset(
        "mlp-fsdp-tp",
        "MLP training, FSDP over one mesh axis x tensor parallel over the other",
        ("fsdp", "tp"),
        Composition(),
    ),
]
