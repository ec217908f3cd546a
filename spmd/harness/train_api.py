"""Training from Python, as dp_mat_mul is matmul from Python: one call runs a composition's steps on threads.

import spmd
run = spmd.train(model="llama", mesh="pp=2,tp=2", tie_embeddings=True, vocab=257, steps=3)
run.losses, run.memory[0], run.traffic[0]["tp"], run.units[0]
run = spmd.train(preset="mlp-fsdp", devices=4, layers=4, hidden=64, steps=3)  # an mlp-* command's flags
run.losses, run.memory[0]["params"], run.traffic[0]["fsdp"], run.units[0]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from spmd.data.loader import Corpus
from spmd.harness.loop import evaluations, train_loop
from spmd.model.config import Net
from spmd.model.registry import full_sizes
from spmd.parallel.context import DEFAULT_CP, core_named
from spmd.transport.group import Group
from spmd.transport.mesh import Mesh, bytes_by_axis
from spmd.transport.threads import run_threads


def train_mlp(strategy: str, devices: int = 4, mesh: str | Mesh | None = None, **flags) -> ComposedRun:
    """spmd.train with the mlp-* command `strategy`: `flags` spelled as its flags (tokens=, layers=, ...)."""
    return train(preset=strategy, devices=devices, mesh=mesh, **flags)


@dataclass(frozen=True)
class ComposedRun:
    """What a composed run left: the loss (and, when clipping, the global gradient norm) per step; per rank the
    bytes it held by kind and the bytes it sent and received per mesh axis in one step (measured); every unit's
    final parameters (fp32 masters under mixed precision), assembled from the ranks that own them."""

    net: Net
    mesh: Mesh
    layout: str
    losses: list[float]
    grad_norms: list[float] | None
    memory: list[dict[str, int]]
    traffic: list[dict[str, tuple[int, int]]]
    units: list[np.ndarray]
    validation: list[tuple[int, float]] = field(default_factory=list)  # (step, loss) with data= and eval_every=
    data: str | None = None
    biases: dict[int, np.ndarray] = field(default_factory=dict)  # --bias-balance: each MoE unit's, as trained

    def generate(
        self,
        prompt: str | None = None,
        max_tokens: int = 200,
        temperature: float = 0.8,
        top_k: int = 40,
        seed: int = 0,
        *,
        top_p: float = 1.0,
        stop: str | Sequence[str] | None = None,
        sample: int = 0,
    ) -> str:
        """Text sampled from the trained LM after `prompt` (None: where a document starts), its corpus's
        tokenizer, a key/value cache: the prompt and the new text, cut before the first `stop` text in the new
        text. `sample` i is the CLI's --num-samples sample i + 1 (seeded by (seed, i)). The CLI's path:
        spmd.harness.sampling; a control out of range raises ValueError naming the argument."""
        from spmd.data.tokenizer import load_tokenizer
        from spmd.harness.sampling import Controls, TextSampler, stop_texts

        if self.data is None:
            raise ValueError("this run trained on synthetic tokens (no data=): there is no tokenizer for text")
        controls = Controls(max_tokens, temperature, top_k, top_p, stop_texts(stop), seed)
        sampler = TextSampler(
            self.net,
            self.units,
            self.biases,
            load_tokenizer(self.data),
            prompt,
            controls,
            name=str,
            prompt_flag="prompt",
        )
        return sampler.text(sample)


def train(
    model: str | None = None,
    mesh: str | Mesh | None = None,
    devices: int | None = None,
    *,
    preset: str | None = None,
    zero: int = 3,
    reshard: bool = True,
    sp: bool = False,
    pipeline: str = "1f1b",
    cp: str = DEFAULT_CP,
    recompute: str = "none",
    overlap: bool = True,
    data: str | None = None,
    eval_every: int = 0,
    eval_tokens: int = 4096,
    **config,
) -> ComposedRun:
    """Train `model` (a name of spmd.model.registry.MODELS; by default Net's, the MLP) on `mesh` (default dp
    over `devices`) on threads, as `python -m spmd train` does; config goes to spmd.model.Net (layers, hidden,
    vocab, optimizer, clip_grad, ...).

        run = spmd.train(model="llama", mesh="fsdp=2,tp=2", sp=True, steps=3, optimizer="adamw")
        run.losses, run.memory[0]["params"], run.traffic[0]["tp"], run.units[0]

    With data=DIR (a prepared corpus) the LM trains on its tokens, validation losses every eval_every steps, and
    run.generate(prompt) samples text. preset="mlp-fsdp" (any mlp-* command): its settings, config spelled as its
    flags (tokens=, layers=, ...; python -m spmd mlp-fsdp --help).
    """
    from spmd.parallel.strategy import Composition  # the engine: imported when a run starts

    parsed = Mesh.parse(mesh) if isinstance(mesh, str) else mesh
    size = parsed.size if parsed is not None else devices or 1
    if devices is not None and devices != size:
        raise ValueError(f"mesh {parsed} spans {size} devices, not devices={devices}")
    layout = Composition(zero=zero, reshard=reshard, sp=sp, pipeline=pipeline, cp=core_named(cp), recompute=recompute)
    if preset is not None:
        if model is not None or data is not None or layout != Composition():
            raise ValueError(
                f"preset={preset!r} sets the model and the layout: give model=, data= and zero= ... without it"
            )
        strategy, net, chosen = preset_run(preset, size, parsed, overlap, config)
        return run_composition(strategy, net, chosen, net, None, None)
    if model is not None:  # else Net's default
        config = {**config, "model": model}
    corpus = None
    if data is not None:
        probe = Net(**config)  # for the corpus's sizes; the vocabulary is the corpus's
        corpus = Corpus(data, probe.seq, probe.batch, probe.seed)
        config = {**config, "vocab": corpus.vocab}
    net = Net(**config)
    source = corpus if corpus is not None else net
    evals = evaluations(corpus, eval_tokens, eval_every)
    strategy = replace(layout, overlap=overlap)
    chosen = strategy.validate(net, size, parsed)
    return run_composition(strategy, net, chosen, source, evals, data)


def preset_run(name: str, size: int, mesh: Mesh | None, overlap: bool, flags: dict):
    """(the composition, the run, its mesh) of the mlp-* command `name` with these flags, as its command line."""
    from spmd.trainers.presets import PRESETS

    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; one of {', '.join(PRESETS)}")
    preset = PRESETS[name]
    net, chosen = preset.resolve(size, mesh, **preset.fields_of(flags))
    return preset.with_overlap(overlap), net, chosen


def run_composition(strategy, net: Net, chosen: Mesh, source, evals, data: str | None) -> ComposedRun:
    """Every rank of `strategy` on threads, the batches from `source` (the corpus, or the run's own)."""

    def rank_fn(comm, rank):
        engine = strategy.build(Group.world(comm, rank), chosen, net)
        done = train_loop(engine, source.batch_data, net.steps, evals=evals)
        traffic = per_axis(comm.traffic(rank), chosen, net.steps)  # evaluations included when there are any
        biases = {} if engine.experts is None else {u: b.copy() for u, b in engine.experts.bias.items()}
        validation = [(v["step"], v["loss"]) for v in done.validation]
        return done.losses, done.grad_norms, engine.arena.by_kind(), traffic, engine.owned(), validation, biases

    return composed_run(net, chosen, strategy.describe(chosen), run_threads(chosen.size, rank_fn), data)


def composed_run(net: Net, mesh: Mesh, layout: str, results: list, data: str | None) -> ComposedRun:
    """The run the ranks' results make: rank 0's losses, every rank's figures, the units assembled."""
    units = [np.zeros(size_, dtype=net.policy.state) for size_ in full_sizes(net)]
    for result in results:
        for unit, index, values in result[4]:
            units[unit][index] = values
    losses, norms = results[0][0], results[0][1]
    biases = {u: b for r in results for u, b in r[6].items()}  # the same on every rank holding the unit
    return ComposedRun(
        net,
        mesh,
        layout,
        losses,
        norms if net.clip_grad > 0 else None,
        [r[2] for r in results],
        [r[3] for r in results],
        units,
        results[0][5],
        data,
        biases,
    )


def per_axis(traffic, mesh: Mesh, steps: int) -> dict[str, tuple[int, int]]:
    """Bytes (sent, received) a step over each mesh axis and the world (mesh.bytes_by_axis), where any moved."""
    return {
        axis: (sent // steps, received // steps)
        for axis, (sent, received) in bytes_by_axis(traffic, mesh).items()
        if sent or received
    }
