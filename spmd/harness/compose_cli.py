"""`python -m spmd train`: one training entry for every composition.

python -m spmd train --model transformer --mesh pp=2,fsdp=2,tp=2 --sp --pipeline interleaved-1f1b --check
python -m spmd train --model transformer --mesh fsdp=2,cp=2,tp=2 --cp ring --check
python -m spmd train --model llama --mesh pp=2,tp=2 --tie-embeddings --vocab 257 --kv-heads 2 --check
"""

from __future__ import annotations

import argparse

from spmd.data.loader import Corpus
from spmd.harness.config_file import parse_with_config
from spmd.harness.train_cli import (
    PIPELINE_MICROBATCHES_PER_STAGE,
    add_optimizer_flags,
    add_run_flags,
    default_microbatches,
    launch_size,
    optimizer_fields,
    run_job,
)
from spmd.model.config import Net
from spmd.model.llama import EXPERT_ACTIVATIONS, ROUTERS
from spmd.model.registry import MODELS
from spmd.parallel.context import CP_VARIANTS
from spmd.parallel.dims import AXES
from spmd.parallel.layout import RECOMPUTE
from spmd.parallel.schedules import SCHEDULES, schedule_named
from spmd.parallel.sharding import ZERO
from spmd.parallel.strategy import Composition
from spmd.transport.mesh import Mesh
from spmd.usage import Parser, UsageError, fail
from spmd.workloads.mlp import DTYPES


def pipeline_kind(text: str) -> str:
    """--pipeline's value: a registered schedule, or zbv made for given times (its error names the problem)."""
    try:
        return schedule_named(text).name  # as the schedule names itself (zbv:1,2,1 for "zbv: 1, 2.0, 1")
    except ValueError as bad:
        raise argparse.ArgumentTypeError(str(bad)) from None


def build_parser() -> Parser:
    p = Parser(
        prog="python -m spmd train",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train a model written once (an MLP, a pre-norm transformer, or a Llama-style language "
        "model on synthetic bigram tokens) with every parallelism composed on one mesh, on MPI "
        "ranks or threads.",
    )
    p.add_argument("--model", choices=MODELS, default="mlp", help="the model, written once for every layout")
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
    p.add_argument("--chunks", type=int, help="model chunks per pipeline rank (default 2 with interleaved-1f1b)")
    p.add_argument(
        "--zero",
        type=int,
        choices=sorted(ZERO),
        default=3,
        help="what the fsdp axis shards: 1 optimizer state, 2 and gradients, 3 and parameters (default)",
    )
    (
        p.add_argument(
            "--no-reshard",
            dest="reshard",
            action="store_false",
            help="ZeRO-3: keep each gathered layer from its forward to the update (one gather a step, "
            "the whole model held) instead of resharding after forward",
        ),
    )
    m = p.add_argument_group("the model and the batch")
    defaults = Net()
    for name, text in (
        ("layers", "L"),
        ("hidden", "h"),
        ("ffn", "f"),
        ("heads", "attention heads"),
        ("seq", "tokens a sequence"),
        ("batch", "sequences a step"),
    ):
        m.add_argument(
            f"--{name}", type=int, default=getattr(defaults, name), help=f"{text} (default {getattr(defaults, name)})"
        )
    m.add_argument(
        "--microbatches",
        type=int,
        help=f"micro-batches a step (default {PIPELINE_MICROBATCHES_PER_STAGE} per pipeline stage, "
        "1 without a pipeline: more is gradient accumulation)",
    )
    m.add_argument("--steps", type=int, default=defaults.steps, help="optimizer steps")
    m.add_argument("--dtype", choices=DTYPES, default=defaults.dtype, help="every array's (see --precision)")
    m.add_argument(
        "--lr",
        type=float,
        help="learning rate > 0 (default: AdamW 1e-3; SGD 0.2 / (tokens x hidden) on "
        "the dense models' summed loss, 0.5 on the LM's mean token loss)",
    )
    m.add_argument("--momentum", type=float, default=defaults.momentum, help="in [0, 1)")
    m.add_argument("--seed", type=int, default=0, help="the initial weights' and the synthetic data's")
    m.add_argument(
        "--integers",
        action="store_true",
        help="--model mlp: small integer data and weights, so every mesh is bitwise equal to one device",
    )
    lm = p.add_argument_group("the language model (--model llama)")
    lm.add_argument(
        "--vocab",
        type=int,
        help=f"tokens (default {defaults.vocab}, or with --data its tokenizer's; "
        "any size over any tp: uneven vocabulary shards)",
    )
    lm.add_argument(
        "--kv-heads",
        type=int,
        default=0,
        help="grouped-query attention's key/value heads, dividing --heads (default: as many as --heads)",
    )
    lm.add_argument(
        "--tie-embeddings",
        action="store_true",
        help="one weight for the embedding and the head (across pipeline stages: their gradients summed)",
    )
    lm.add_argument("--rope-base", type=float, default=defaults.rope_base, help="RoPE's base (default 10000)")
    lm.add_argument("--norm-eps", type=float, default=defaults.norm_eps, help="RMSNorm's epsilon (default 1e-5)")
    moe = p.add_argument_group("a mixture of experts (--model llama --experts E: Grok-1's, Mixtral's layer)")
    moe.add_argument(
        "--experts",
        type=int,
        default=0,
        metavar="E",
        help="SwiGLU experts in each block's FFN place, chosen by a router (default 0: a dense FFN)",
    )
    moe.add_argument(
        "--top-k",
        type=int,
        default=defaults.top_k,
        metavar="K",
        help=f"experts a token goes to (default {defaults.top_k}); a tie goes to the lower expert",
    )
    moe.add_argument(
        "--router", choices=ROUTERS, default=defaults.router, help=f"the router's scores (default {defaults.router})"
    )
    moe.add_argument(
        "--moe-every",
        type=int,
        default=defaults.moe_every,
        metavar="N",
        help="the experts in layers 0, N, 2N, ... only, the others dense (Megatron's --moe-layer-freq; "
        f"default {defaults.moe_every}: every layer)",
    )
    moe.add_argument(
        "--expert-activation",
        choices=EXPERT_ACTIVATIONS,
        default=defaults.expert_activation,
        help=f"the experts' gate: silu (SwiGLU) or gelu (Grok-1's gated GELU, tanh approximation; "
        f"default {defaults.expert_activation})",
    )
    moe.add_argument(
        "--renormalize",
        action="store_true",
        help="divide a token's gates by their sum (default: Grok-1's gates, the scores as they are)",
    )
    moe.add_argument(
        "--aux-loss",
        type=float,
        default=0.0,
        metavar="ALPHA",
        help="the Switch/GShard balancing loss's weight (alpha at perfect balance; default 0: off)",
    )
    moe.add_argument(
        "--capacity-factor",
        type=float,
        default=0.0,
        metavar="CF",
        help="an expert takes at most ceil(seq K / E CF) tokens of a sequence, the earliest (default 0: dropless)",
    )
    moe.add_argument(
        "--bias-balance",
        type=float,
        default=0.0,
        metavar="GAMMA",
        help="DeepSeek-V3's balancing without a loss: a bias per layer and expert that only chooses, "
        "moved by GAMMA after each step toward the mean load (default 0: off)",
    )
    d = p.add_argument_group("real text (--model llama)")
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
    loop = p.add_argument_group("the training loop")
    loop.add_argument(
        "--clip-grad",
        type=float,
        default=0.0,
        metavar="NORM",
        help="clip the global gradient norm (every parameter once over the mesh) to NORM; the norm is "
        "reported every step (default 0: off)",
    )
    loop.add_argument(
        "--lr-schedule",
        choices=("constant", "cosine"),
        default="constant",
        help="after --warmup: constant, or a cosine from --lr to --lr-min at the last step",
    )
    loop.add_argument("--warmup", type=int, default=0, help="steps of linear warmup from 0 to --lr (default 0)")
    loop.add_argument("--lr-min", type=float, default=0.0, help="the cosine's last learning rate (default 0)")
    add_optimizer_flags(m)
    add_run_flags(p)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parse_with_config(parser, argv)
    strategy = Composition(
        zero=args.zero,
        reshard=args.reshard,
        sp=args.sp,
        pipeline=args.pipeline,
        cp=args.cp or "ring",
        recompute=args.recompute,
        overlap=args.overlap,
    )
    try:
        mesh = None if args.mesh is None else Mesh.parse(args.mesh)
        if args.cp and (mesh is None or "cp" not in mesh.names):
            raise UsageError(
                f"--cp {args.cp} chooses how attention crosses the cp axis: give --mesh a cp axis (cp=2, ...)"
            )
        backend, size = launch_size(args, mesh)
        stages = mesh.axis_size("pp") if mesh is not None and "pp" in mesh.names else 1
        # `is None`, not `or`: --microbatches 0 and --chunks 0 are mistakes to name, not requests for a default
        microbatches = args.microbatches if args.microbatches is not None else default_microbatches(stages)
        chunks = args.chunks if args.chunks is not None else (2 if schedule_named(args.pipeline).chunked else 1)
        corpus = open_corpus(args)
        net = Net(
            model=args.model,
            layers=args.layers,
            hidden=args.hidden,
            ffn=args.ffn,
            heads=args.heads,
            seq=args.seq,
            batch=args.batch,
            microbatches=microbatches,
            chunks=chunks,
            steps=args.steps,
            dtype=args.dtype,
            lr=args.lr,
            momentum=args.momentum,
            seed=args.seed,
            integers=args.integers,
            vocab=corpus.vocab if corpus else args.vocab or Net().vocab,
            kv_heads=args.kv_heads,
            tie_embeddings=args.tie_embeddings,
            experts=args.experts,
            top_k=args.top_k,
            router=args.router,
            renormalize=args.renormalize,
            aux_loss=args.aux_loss,
            capacity_factor=args.capacity_factor,
            bias_balance=args.bias_balance,
            expert_activation=args.expert_activation,
            moe_every=args.moe_every,
            rope_base=args.rope_base,
            norm_eps=args.norm_eps,
            clip_grad=args.clip_grad,
            lr_schedule=args.lr_schedule,
            warmup=args.warmup,
            lr_min=args.lr_min,
            **optimizer_fields(args),
        )
        mesh = strategy.validate(net, size, mesh)
        data = (
            None
            if corpus is None
            else {**corpus.describe(), "seed": net.seed, "batch": net.batch, "seq": net.seq, "path": args.data}
        )
        if corpus is not None and args.eval_every:
            corpus.eval_batches(args.eval_tokens)  # enough validation tokens: refused here, not on the ranks
    except (ValueError, TypeError, UsageError) as exc:
        fail(parser.prog, str(exc))
    return run_job(parser, args, strategy, net, mesh, backend, data)


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
