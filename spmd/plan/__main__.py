"""python -m spmd.plan: which strategy and mesh fit a model on a cluster, and how fast, from the tested closed forms.

    python -m spmd.plan --layers 93 --hidden 16384 --seq 4096 --batch 8 --devices 64 --memory-gb 80
    python -m spmd.plan --model transformer --layers 62 --hidden 16384 --heads 128 --seq 4096 --batch 64 \
        --devices 64 --memory-gb 80 --optimizer adamw --precision bf16
    python -m spmd.plan --parameters 7.5e9 --layers 7500 --devices 64 --optimizer adamw --precision fp16 \
        --reduce-dtype fp16
    python -m spmd.plan --model llama --preset llama3-8b --devices 64 --batch 64 --optimizer adamw --precision bf16
    python -m spmd.plan --model gpt2 --preset gpt2-124m --devices 8 --batch 64
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter

from spmd.model.config import Net
from spmd.model.kernels import MEMORY_KINDS
from spmd.model.optimizers import OPTIMIZERS, STATE
from spmd.model.precision import PRECISIONS, Precision
from spmd.model.registry import MODELS, parameters
from spmd.parallel.context import CP_VARIANTS, DEFAULT_CP
from spmd.parallel.layout import RECOMPUTE
from spmd.plan.estimate import Cluster, Model, plan
from spmd.plan.layouts import Choices, plan_layouts, state_per_device
from spmd.plan.llama_sizes import PRESETS, llama_plan, shape_of_args
from spmd.trainers.presets import PRESETS as MLP_PRESETS
from spmd.transport.mesh import Mesh
from spmd.usage import Parser, UsageError, at_least, fail

GB = 1e9
ELEMENT_BYTES = (1, 2, 4, 8)  # fp8, bf16/fp16, fp32, fp64
# OpenAI's GPT-2 small (the 2019 paper's 117M, 124M as counted with its position table); counted by the engine's spec
GPT2_PRESETS: dict[str, dict] = {
    "gpt2-124m": dict(
        model="gpt2", layers=12, hidden=768, heads=12, ffn=3072, vocab=50257, seq=1024, tie_embeddings=True
    ),
}
LLAMA_FLAGS = ("kv_heads", "experts", "top_k")  # the planner's flags only a Llama-style shape has


def check_args(args) -> None:
    """Every number in range, naming its flag, before anything is estimated."""
    llama = MODELS[args.model].reads_tokens  # the LM: counts its own parameters, plans without --devices
    if args.devices is None and not llama:
        raise UsageError("the following arguments are required: --devices")
    if args.devices is None and args.memory_gb is not None:
        args.devices = 1  # --model llama: does the training state fit on one device
    if args.memory_gb is None:
        args.memory_gb = 80.0
    if not llama:
        for flag in ("preset", "vocab", "tie_embeddings", *LLAMA_FLAGS):
            if getattr(args, flag) is not None:
                raise UsageError(f"--{flag.replace('_', '-')} is for --model llama")
    elif args.parameters is not None:
        raise UsageError(f"--parameters is for a raw parameter count: --model {args.model} counts its own")
    if args.model == "gpt2":
        check_gpt2_args(args)
    if MODELS[args.model].has_attention and args.strategy:
        raise UsageError(
            f"--strategy chooses among the MLP's strategies (mlp-*); --model {args.model} is planned "
            "as composed layouts: give --mesh (pp=..,fsdp=..,tp=..) to plan one"
        )
    if args.parameters is not None:
        if not (args.parameters >= 1 and args.parameters == int(args.parameters)):
            raise UsageError(f"--parameters must be a whole number >= 1, got {args.parameters:g}")
        if args.layers is None:
            args.layers = 1
    elif not llama:  # llama: its shape is checked as it is built (spmd.plan.llama_sizes.resolve_shape)
        for flag in ("layers", "hidden", "seq", "batch"):
            if getattr(args, flag) is None:
                raise UsageError(f"--{flag} is required (or --parameters N for the training state alone)")
    for flag in (
        "layers",
        "hidden",
        "ffn",
        "heads",
        "kv_heads",
        "vocab",
        "seq",
        "batch",
        "microbatches",
        "devices",
        "per_node",
        "top",
        "max_cp",
    ):
        if getattr(args, flag) is not None:
            at_least("--" + flag.replace("_", "-"), getattr(args, flag), 1)
    for flag in ("memory_gb", "intra_gbs", "inter_gbs", "tflops"):
        value = getattr(args, flag)
        if not value > 0 or value == float("inf"):
            raise UsageError(f"--{flag.replace('_', '-')} must be a number > 0, got {value}")
    if args.mesh is not None and Mesh.parse(args.mesh).size != args.devices:
        raise UsageError(
            f"--mesh {args.mesh} spans {Mesh.parse(args.mesh).size} devices but --devices is "
            f"{args.devices}: make the product of the axes equal --devices"
        )


def check_gpt2_args(args) -> None:
    for flag in LLAMA_FLAGS:
        if getattr(args, flag) is not None:
            raise UsageError(f"--{flag.replace('_', '-')} is for --model llama, not gpt2")
    if args.preset is not None and args.preset not in GPT2_PRESETS:
        raise UsageError(f"--preset {args.preset} is a Llama's; --model gpt2 has {', '.join(GPT2_PRESETS)}")
    if args.preset is None and None in (args.layers, args.hidden, args.heads, args.vocab, args.seq):
        raise UsageError("--model gpt2 needs --layers, --hidden, --heads, --vocab and --seq (or --preset gpt2-124m)")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m spmd.plan", description=__doc__.splitlines()[0])
    m = p.add_argument_group("the model: spmd's MLP, Y = X + relu((X g) W1) W2 per layer, or its transformer")
    m.add_argument(
        "--model",
        choices=tuple(MODELS),
        default="mlp",
        help="mlp: the mlp-* strategies; transformer: every composed layout (pp, dp/fsdp, cp, tp); "
        "llama: a Llama-style model's parameters, flops per token and ZeRO-3 training state; "
        "gpt2: a GPT-2-style model's parameters and layouts",
    )
    m.add_argument(
        "--preset",
        choices=sorted([*PRESETS, *GPT2_PRESETS]),
        help="llama, gpt2: a published shape (the flags below override its fields)",
    )
    m.add_argument(
        "--parameters",
        type=float,
        help="a raw parameter count: the training state per device under "
        "DP and each ZeRO stage (ZeRO's Figure 1), in --layers layers",
    )
    m.add_argument("--layers", type=int, help="L (llama: the preset's when given)")
    m.add_argument("--hidden", type=int, help="h (llama: the preset's when given)")
    m.add_argument("--ffn", type=int, help="f (default 4 x hidden; llama: 2/3 of 4h up to a multiple of 256)")
    m.add_argument("--heads", type=int, help="transformer, llama: attention heads (default hidden / 128)")
    m.add_argument("--kv-heads", type=int, help="llama: key/value heads, grouped-query (default: --heads)")
    m.add_argument("--vocab", type=int, help="llama: vocabulary size")
    m.add_argument(
        "--tie-embeddings",
        action=argparse.BooleanOptionalAction,
        help="llama: the LM head is the embedding (default: the preset's; untied)",
    )
    m.add_argument(
        "--experts", type=int, help="llama: a mixture of experts in each FFN's place (default: the preset's; 0: dense)"
    )
    m.add_argument("--top-k", type=int, help="llama: experts a token passes through (default: the preset's; 2)")
    m.add_argument("--seq", type=int, help="sequence length")
    m.add_argument("--batch", type=int, help="sequences per step (tokens = seq x batch)")
    m.add_argument(
        "--bytes",
        dest="element_bytes",
        type=int,
        default=2,
        choices=ELEMENT_BYTES,
        help="bytes per element of weights, gradients, optimizer state and activations",
    )
    m.add_argument("--microbatches", type=int, default=8, help="pipelines: micro-batches per step")
    c = p.add_argument_group("the cluster")
    c.add_argument("--devices", type=int, help="required, except for --model llama")
    c.add_argument("--memory-gb", type=float, help="memory per device (80 when not given)")
    c.add_argument("--per-node", type=int, default=8, help="devices per node")
    c.add_argument("--intra-gbs", type=float, default=300.0, help="GB/s a device sends inside a node")
    c.add_argument("--inter-gbs", type=float, default=25.0, help="GB/s a device sends across nodes")
    c.add_argument("--tflops", type=float, default=400.0, help="sustained TFLOP/s per device")
    t = p.add_argument_group("training state and layouts (--model transformer, --parameters)")
    t.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    t.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="bf16",
        help="fp16/bf16: mixed, with fp32 master weights and optimizer state",
    )
    t.add_argument("--reduce-dtype", choices=PRECISIONS, default="", help="the gradients' dtype (mixed: fp32)")
    t.add_argument("--recompute", choices=RECOMPUTE, action="append", help="only these (default: each)")
    t.add_argument("--cp", choices=CP_VARIANTS, default=DEFAULT_CP, help="how attention crosses a cp axis")
    t.add_argument("--max-cp", type=int, default=4, help="the largest cp axis to try")
    p.add_argument("--strategy", action="append", choices=sorted(MLP_PRESETS), help="only these (repeatable)")
    p.add_argument("--mesh", metavar="AXIS=N,...", help="only this mesh")
    p.add_argument("--top", type=int, default=12, help="rows to print")
    return p


def format_plan(model: Model, cluster: Cluster, estimates, refused, top: int) -> str:
    lines = [
        f"model: {model.layers} layers, h {model.hidden}, f {model.ffn}, {model.tokens} tokens a step, "
        f"{model.parameters / 1e9:.1f} G parameters = {model.parameters * model.element_bytes / GB:.0f} GB "
        f"at {model.element_bytes} bytes (gradients and momentum as much again, each)",
        f"cluster: {cluster.devices} devices of {cluster.memory_bytes / GB:.0f} GB, {cluster.per_node} a node, "
        f"{cluster.intra_bytes_per_s / GB:.0f} GB/s inside a node, {cluster.inter_bytes_per_s / GB:.0f} GB/s across, "
        f"{cluster.flops_per_s / 1e12:.0f} TFLOP/s",
        "memory: GB per device (the fullest one); sent: GB per step per device, by mesh axis and link; "
        "step: compute + communication, no overlap assumed",
        "",
        f"{'strategy':<13} {'mesh':<16} "
        + " ".join(f"{k[:6]:>7}" for k in MEMORY_KINDS)
        + f" {'total':>7} {'fits':>4}  {'sent per axis (link)':<40} {'step s':>8}",
    ]
    for e in estimates[:top]:
        sent = (
            ", ".join(
                f"{axis} {e.sent[axis] / GB:.2f} ({e.links[axis]})"
                for axis in e.mesh.names
                if e.mesh.axis_size(axis) > 1
            )
            or "none"
        )
        lines.append(
            f"{e.strategy:<13} {str(e.mesh):<16} "
            + " ".join(f"{e.memory[k] / GB:7.1f}" for k in MEMORY_KINDS)
            + f" {e.peak / GB:7.1f} {'yes' if e.fits else 'NO':>4}  {sent:<40} {e.step_seconds:8.3f}"
        )
    if len(estimates) > top:
        lines.append(f"... {len(estimates) - top} more (--top)")
    fitting = sum(e.fits for e in estimates)
    lines.append(
        f"{fitting} of {len(estimates)} (strategy, mesh) pairs fit in {cluster.memory_bytes / GB:.0f} GB"
        + (f"; fastest: {estimates[0].strategy} on {estimates[0].mesh}" if fitting else "")
    )
    for name, mesh, why in refused:
        lines.append(f"cannot run {name} on {mesh}: {why}")
    return "\n".join(lines)


def format_state_table(parameters: int, layers: int, devices: int, policy: Precision, optimizer: str) -> str:
    table = state_per_device(parameters, layers, devices, policy, optimizer)
    per = {kind: policy.dtypes()[kind].itemsize for kind in ("params", "grads")}
    k = (4 if policy.mixed else 0) + policy.state.itemsize * len(STATE[optimizer])
    lines = [
        f"{parameters / 1e9:g} G parameters in {layers} layers on {devices} devices, {optimizer}, {policy.name} "
        f"(params {per['params']} B, grads {per['grads']} B, K = {k} B of optimizer state and master a "
        "parameter): GB per device, training state only",
        f"{'':<18} " + " ".join(f"{kind:>9}" for kind in ("params", "master", "grads", "optimizer")) + "     total",
    ]
    for name, memory in table.items():
        lines.append(
            f"{name:<18} "
            + " ".join(f"{memory[kind] / GB:9.3f}" for kind in ("params", "master", "grads", "optimizer"))
            + f" {sum(memory.values()) / GB:9.2f}"
        )
    return "\n".join(lines)


def transformer_plan(args, cluster: Cluster) -> str:
    heads = args.heads or max(1, args.hidden // 128)
    net = Net(
        model="transformer",
        layers=args.layers,
        hidden=args.hidden,
        ffn=args.ffn or 4 * args.hidden,
        heads=heads,
        seq=args.seq,
        batch=args.batch,
        optimizer=args.optimizer,
        precision=args.precision,
        reduce_dtype=args.reduce_dtype,
    )
    return layout_plan(args, cluster, net)


def layout_plan(args, cluster: Cluster, net: Net) -> str:
    """Every composed layout of `net` on the cluster, from the cost function the composition tests assert."""
    choices = Choices(
        recompute=tuple(args.recompute or RECOMPUTE),
        cp=args.cp,
        max_cp=args.max_cp,
        mesh=Mesh.parse(args.mesh) if args.mesh else None,
    )
    estimates, refused = plan_layouts(net, cluster, choices)
    params, heads = parameters(net), net.heads  # a tied head counted once
    head = [
        f"model: {net.model}, {net.layers} layers, h {net.hidden}, f {net.ffn}, {heads} heads, {net.seq} x "
        f"{net.batch} tokens a step, {params / 1e9:.1f} G parameters = {params * net.itemsize / GB:.0f} GB in "
        f"{net.precision}; {net.optimizer}",
        f"cluster: {cluster.devices} devices of {cluster.memory_bytes / GB:.0f} GB, {cluster.per_node} a node; "
        "memory: GB on the fullest device; step: compute (stretched by the bubble) + communication, no overlap; "
        "sent: GB a step over each mesh axis (the most a device sends; ep at uniform routing)",
        "",
    ]
    rows = merged_rows(
        [
            (
                e.strategy,
                " ".join(f"{e.memory[k] / GB:{max(len(k), 7)}.1f}" for k in MEMORY_KINDS)
                + f" {e.peak / GB:7.1f} {'yes' if e.fits else 'NO':>4} {e.step_seconds:8.2f}  "
                + ", ".join(f"{axis} {sent / GB:.2f}" for axis, sent in e.sent.items() if sent),
            )
            for e in estimates[: args.top]
        ]
    )
    width = max([len("layout"), *(len(name) for name, _ in rows)])  # never cut a layout's name
    head.append(
        f"{'layout':<{width}} "
        + " ".join(f"{k:>{max(len(k), 7)}}" for k in MEMORY_KINDS)
        + f" {'total':>7} {'fits':>4} {'step s':>8}  sent GB"
    )
    head += [f"{name:<{width}} {numbers}" for name, numbers in rows]
    fitting = sum(e.fits for e in estimates)
    head.append(
        f"{fitting} of {len(estimates)} layouts fit in {cluster.memory_bytes / GB:.0f} GB"
        + (f"; fastest: {estimates[0].strategy}" if fitting else "")
        + f"; {len(refused)} refused"
        + "".join(f"\n  {n} refused: {why}" for why, n in Counter(reason for *_, reason in refused).most_common())
    )
    return "\n".join(head)


def merged_rows(rows: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Neighbouring rows with the same numbers whose layouts differ in one part (as ZeRO-1 and ZeRO-2 can) as one
    row naming both ("ZeRO-1|ZeRO-2")."""
    merged: list[tuple[str, str]] = []
    for name, numbers in rows:
        if merged and merged[-1][1] == numbers:
            before, now = merged[-1][0].split(", "), name.split(", ")
            differ = [i for i, (a, b) in enumerate(zip(before, now, strict=False)) if a != b]
            if len(before) == len(now) and len(differ) == 1:
                i = differ[0]
                before[i] = f"{before[i]}|{now[i]}"
                merged[-1] = (", ".join(before), numbers)
                continue
        merged.append((name, numbers))
    return merged


def llama_net(args) -> Net:
    """The planned LM as the engine's model (the flags' shape, --batch sequences of its context a step)."""
    shape = shape_of_args(args)
    return Net(
        model="llama",
        layers=shape.layers,
        hidden=shape.hidden,
        ffn=shape.ffn,
        heads=shape.heads,
        kv_heads=shape.kv_heads,
        vocab=shape.vocab,
        tie_embeddings=shape.tie_embeddings,
        seq=shape.context,
        experts=shape.experts,
        top_k=shape.top_k,
        batch=args.batch,
        optimizer=args.optimizer,
        precision=args.precision,
        reduce_dtype=args.reduce_dtype,
    )


def cluster_of(args) -> Cluster:
    """The cluster of the flags, built here only."""
    return Cluster(
        args.devices, args.memory_gb * GB, args.per_node, args.intra_gbs * GB, args.inter_gbs * GB, args.tflops * 1e12
    )


def gpt2_net(args) -> Net:
    """The planned GPT-2 as the engine's model: the preset's fields, the flags given over them."""
    fields: dict = dict(GPT2_PRESETS[args.preset]) if args.preset else {"model": "gpt2"}
    for flag in ("layers", "hidden", "heads", "vocab", "seq", "tie_embeddings", "batch"):
        if getattr(args, flag) is not None:
            fields[flag] = getattr(args, flag)
    fields.setdefault("ffn", args.ffn or 4 * fields["hidden"])
    policy = dict(optimizer=args.optimizer, precision=args.precision, reduce_dtype=args.reduce_dtype)
    return Net(**fields, **policy)


def gpt2_plan(args) -> str:
    net = gpt2_net(args)
    n = parameters(net)
    tied = "tied embeddings" if net.tie_embeddings else "untied head"
    return (
        f"GPT-2-style {args.preset or 'model'}: {net.layers} layers, h {net.hidden}, f {net.ffn}, {net.heads} heads, "
        f"vocabulary {net.vocab}, {net.seq} positions, {tied}: {n:,} parameters ({n / 1e6:.1f} M)"
    )


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_args(args)
        if args.parameters is not None:
            print(
                format_state_table(
                    int(args.parameters),
                    args.layers,
                    args.devices,
                    Precision(args.precision, args.reduce_dtype),
                    args.optimizer,
                )
            )
            return 0
        spec = MODELS[args.model]
        if spec.reads_tokens:  # a language model: its own count, then its layouts when the cluster is given
            summary, net = (gpt2_plan, gpt2_net) if args.model == "gpt2" else (llama_plan, llama_net)
            print(summary(args))
            if args.devices is not None and args.batch is not None:
                print("\n" + layout_plan(args, cluster_of(args), net(args)))
            return 0
        cluster = cluster_of(args)
        if spec.has_attention:
            print(transformer_plan(args, cluster))
            return 0
        model = Model(
            args.layers,
            args.hidden,
            args.ffn or 4 * args.hidden,
            args.seq * args.batch,
            args.element_bytes,
            args.microbatches,
        )
        mesh = Mesh.parse(args.mesh) if args.mesh else None
        estimates, refused = plan(model, cluster, args.strategy, mesh)
    except ValueError as exc:
        fail(parser.prog, str(exc))
    if not estimates and not refused:
        fail(
            parser.prog,
            f"no strategy runs on the axes of --mesh {args.mesh}"
            + (f" (of {', '.join(args.strategy)})" if args.strategy else ""),
        )
    print(format_plan(model, cluster, estimates, refused, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
