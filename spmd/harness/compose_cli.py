"""`python -m spmd train`: one training entry for every composition, and its mlp-* presets.

python -m spmd train --model transformer --mesh pp=2,fsdp=2,tp=2 --sp --pipeline interleaved-1f1b --check
python -m spmd train --model transformer --mesh fsdp=2,cp=2,tp=2 --cp ring --check
python -m spmd train --model llama --mesh pp=2,tp=2 --tie-embeddings --vocab 257 --kv-heads 2 --check
python -m spmd mlp-fsdp --tokens 64 --check   # train's parser with the preset applied (spmd/trainers/presets.py)
"""

from __future__ import annotations

import argparse
import functools

from spmd.data.loader import Corpus
from spmd.harness.config_file import parse_with_config
from spmd.harness.net_flags import add_net_flags, net_fields
from spmd.harness.run_flags import add_run_flags, launch_size, run_job
from spmd.model.config import Net
from spmd.model.registry import MODELS
from spmd.parallel.context import CP_VARIANTS, DEFAULT_CP, core_named
from spmd.parallel.dims import AXES
from spmd.parallel.layout import RECOMPUTE
from spmd.parallel.schedules import SCHEDULES, schedule_named
from spmd.parallel.sharding import ZERO
from spmd.parallel.strategy import Composition, default_microbatches
from spmd.trainers.presets import PRESETS, Preset
from spmd.transport.mesh import Mesh
from spmd.usage import Parser, UsageError, fail


def pipeline_kind(text: str) -> str:
    """--pipeline's value: a registered schedule, or zbv made for given times (its error names the problem)."""
    try:
        return schedule_named(text).name  # as the schedule names itself (zbv:1,2,1 for "zbv: 1, 2.0, 1")
    except ValueError as bad:
        raise argparse.ArgumentTypeError(str(bad)) from None


TRAIN = (
    "Train a model written once (an MLP, a pre-norm transformer, or a Llama-style language model on synthetic "
    "bigram tokens) with every parallelism composed on one mesh, on MPI ranks or threads."
)


def build_parser(preset: Preset | None = None) -> Parser:
    """`train`'s parser, or with `preset` applied an mlp-* command's: only the flags it has (its layout and the
    model's other fields are the preset's), spelled as it spells them (--tokens)."""
    axes = "" if preset is None else ",".join(f"{axis}=N" for axis in preset.axes)
    p = (Parser if preset is None else functools.partial(PresetParser, preset))(
        prog="python -m spmd " + (preset.name if preset else "train"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=TRAIN
        if preset is None
        else f"{preset.summary}. The MLP (Y = X + relu((X g) W1) W2 per layer) as python -m spmd train --model "
        f"mlp --mesh {axes} runs it, one token a sequence, on MPI ranks or threads.",
        epilog=None
        if preset is None
        else "the mlp-* commands:\n" + "\n".join(f"  {t.name:<20} {t.summary}" for t in PRESETS.values()),
    )
    if preset is None:
        add_layout_flags(p)
    else:
        default = f"{preset.axes[0]} over every rank" if len(preset.axes) == 1 else "none: give both"
        p.add_argument("--mesh", metavar=axes, help=f"its named mesh axes, last fastest (default: {default})")
    add_net_flags(p, None if preset is None else preset.flags)
    if preset is None:
        add_data_flags(p.add_argument_group("real text (--model llama)"))
    else:
        p.set_defaults(data=None, eval_every=0, eval_tokens=0)  # the MLP trains on its own rows, never on text
    add_run_flags(p)
    return p


class PresetParser(Parser):
    """An mlp-* command's parser: a flag of train's it does not have is named as train's (or as the command spells
    it), not guessed at."""

    def __init__(self, preset: Preset, **options):
        super().__init__(**options)
        self.preset = preset

    def closest(self, message: str) -> str:
        if not message.startswith("unrecognized arguments:"):
            return ""
        train = build_parser()._option_string_actions
        spelled = {"--" + f.replace("_", "-"): self.preset.flag(f) for f, w in self.preset.flags.items() if "flag" in w}
        hints, others = [], []
        for word in message.split(":", 1)[1].split():
            flag = word.split("=", 1)[0]
            if flag in spelled:
                hints.append(f"{flag}: {self.prog} spells it {spelled[flag]}")
            elif flag in train:
                hints.append(f"{flag} is python -m spmd train's: {self.prog} sets it itself")
            else:
                others.append(word)
        ours = "; " + "; ".join(hints) if hints else ""
        return ours + super().closest("unrecognized arguments: " + " ".join(others))


def add_layout_flags(p) -> None:
    """How the run lays the model out: the mesh and each axis's choices."""
    p.add_argument(
        "--mesh",
        metavar="AXIS=N,...",
        help=f"any of the axes {', '.join(AXES)}, in that order (default dp over every rank)",
    )
    p.add_argument("--sp", action="store_true", help="sequence parallel on the tp axis (Megatron SP)")
    p.add_argument(
        "--cp",
        choices=CP_VARIANTS,
        help="how attention crosses the cp axis: ring (K/V blocks around the ring, zigzag causal "
        "balance; the default) or ulysses (all-to-all to a head split and back)",
    )
    p.add_argument(
        "--recompute",
        choices=RECOMPUTE,
        default="none",
        help="activation recomputation: none, selective (attention's core: P is not kept), or full "
        "(keep each layer's input, rerun its forward in backward)",
    )
    p.add_argument(
        "--pipeline",
        type=pipeline_kind,
        default="1f1b",
        metavar="|".join([*SCHEDULES, "zbv:T_F,T_B,T_W"]),
        help="the pipeline schedule; zbv:T_F,T_B,T_W makes ZB-V's order for those times of one chunk "
        "action (a run's bubble line prints them)",
    )
    p.add_argument(
        "--zero",
        type=int,
        choices=sorted(ZERO),
        default=3,
        help="what the fsdp axis shards: 1 optimizer state, 2 and gradients, 3 and parameters (default)",
    )
    p.add_argument(
        "--no-reshard",
        dest="reshard",
        action="store_false",
        help="ZeRO-3: keep each gathered layer from its forward to the update (one gather a step, "
        "the whole model held) instead of resharding after forward",
    )


def add_data_flags(d) -> None:
    """Real text: the corpus and its evaluations."""
    d.add_argument(
        "--data",
        metavar="DIR",
        help="a corpus from python -m spmd data prepare: train on its tokens "
        "(each rank reads only its rows, through a memory map); the vocabulary is its tokenizer's",
    )
    d.add_argument(
        "--eval-every",
        type=int,
        default=0,
        metavar="N",
        help="with --data: the validation loss and perplexity every N steps and after the last",
    )
    d.add_argument(
        "--eval-tokens",
        type=int,
        default=4096,
        metavar="M",
        help="validation tokens each evaluation reads (whole batches; default 4096)",
    )


def main(argv=None, preset: Preset | None = None) -> int:
    """`python -m spmd train`, or with `preset` its mlp-* command."""
    parser = build_parser(preset)
    args = parse_with_config(parser, argv)
    data = None
    try:
        mesh = None if args.mesh is None else Mesh.parse(args.mesh)
        backend, size = launch_size(args, mesh)
        if preset is not None:
            net, mesh = preset.resolve(size, mesh, **net_fields(args))  # every check before any rank starts
            strategy = preset.with_overlap(args.overlap)
        else:
            strategy, net, mesh, data = composed(args, mesh, size)
    except (ValueError, TypeError, UsageError, OSError) as exc:
        fail(parser.prog, str(exc))
    return run_job(parser, args, strategy, net, mesh, backend, data, preset)


def composed(args, mesh: Mesh | None, size: int) -> tuple[Composition, Net, Mesh, dict | None]:
    """train's composition, run, mesh and corpus (described as a checkpoint records it), every check made."""
    strategy = Composition(
        zero=args.zero,
        reshard=args.reshard,
        sp=args.sp,
        pipeline=args.pipeline,
        cp=core_named(args.cp or DEFAULT_CP),
        recompute=args.recompute,
        overlap=args.overlap,
    )
    if args.cp and (mesh is None or "cp" not in mesh.names):
        raise UsageError(f"--cp {args.cp} chooses how attention crosses the cp axis: give --mesh a cp axis (cp=2, ...)")
    stages = mesh.axis_size("pp") if mesh is not None and "pp" in mesh.names else 1
    # `is None`, not `or`: --microbatches 0 and --chunks 0 are mistakes to name, not requests for a default
    microbatches = args.microbatches if args.microbatches is not None else default_microbatches(stages)
    chunks = args.chunks if args.chunks is not None else (2 if schedule_named(args.pipeline).chunked else 1)
    corpus = open_corpus(args)
    vocab = corpus.vocab if corpus else args.vocab or Net().vocab
    net = Net(**{**net_fields(args), "microbatches": microbatches, "chunks": chunks, "vocab": vocab})
    mesh = strategy.validate(net, size, mesh)
    data = (
        None
        if corpus is None
        else {**corpus.describe(), "seed": net.seed, "batch": net.batch, "seq": net.seq, "path": args.data}
    )
    if corpus is not None and args.eval_every:
        corpus.eval_batches(args.eval_tokens)  # enough validation tokens: refused here, not on the ranks
    return strategy, net, mesh, data


def open_corpus(args) -> Corpus | None:
    """--data's corpus, checked before any rank starts (and --vocab against its tokenizer), or None."""
    if args.eval_every < 0 or args.eval_tokens < 1:
        raise UsageError(
            f"--eval-every must be >= 0 and --eval-tokens >= 1, got {args.eval_every} and {args.eval_tokens}"
        )
    if args.data is None:
        if args.eval_every:
            raise UsageError("--eval-every needs --data DIR (its validation tokens)")
        return None
    if not MODELS[args.model].reads_tokens:
        readers = " or ".join(name for name, spec in MODELS.items() if spec.reads_tokens)
        raise UsageError(f"--data feeds the language model's tokens: give --model {readers} (not {args.model})")
    corpus = Corpus(args.data, args.seq, args.batch, args.seed)
    if args.vocab is not None and args.vocab != corpus.vocab:
        raise UsageError(f"--vocab {args.vocab}, but --data {args.data}'s tokenizer has {corpus.vocab} tokens")
    return corpus
