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
from dataclasses import asdict

from spmd.model.config import Net
from spmd.model.kernels import MEMORY_KINDS
from spmd.model.optimizers import OPTIMIZERS, STATE
from spmd.model.precision import PRECISIONS, Precision
from spmd.model.registry import MODELS, parameters
from spmd.model.shapes import PRESETS
from spmd.parallel.context import CP_VARIANTS, DEFAULT_CP, core_named
from spmd.parallel.layout import RECOMPUTE
from spmd.plan.cluster import Cluster
from spmd.plan.layouts import Choices, plan_layouts, plan_presets, state_per_device
from spmd.plan.lm_report import lm_report
from spmd.trainers.presets import PRESETS as MLP_PRESETS
from spmd.transport.mesh import Mesh
from spmd.usage import Parser, UsageError, at_least, fail

GB = 1e9
ELEMENT_BYTES = (1, 2, 4, 8)  # fp8, bf16/fp16, fp32, fp64
LM_FLAGS = ("vocab", "tie_embeddings", "kv_heads", "experts", "top_k")  # the planner's flags only an LM takes
SHAPE_FLAGS = ("layers", "hidden", "ffn", "heads", "kv_heads", "vocab", "seq", "tie_embeddings", "experts", "top_k")
COUNTS = ("layers", "hidden", "ffn", "heads", "kv_heads", "vocab", "seq", "batch", "microbatches", "devices")


def check_args(args) -> None:
    """Every number in range, naming its flag, before anything is estimated; the model a --preset names."""
    preset_model = PRESETS[args.preset][1]["model"] if args.preset else None
    if args.model is not None and preset_model not in (None, args.model):
        raise UsageError(f"--preset {args.preset} is a --model {preset_model}: leave --model out or give that one")
    args.model = args.model or preset_model or "mlp"
    lm = MODELS[args.model].reads_tokens  # a language model counts its own parameters, plans without --devices
    if args.devices is None and not lm:
        raise UsageError("the following arguments are required: --devices")
    if args.devices is None and args.memory_gb is not None:
        args.devices = 1  # a language model: does the training state fit on one device
    if args.memory_gb is None:
        args.memory_gb = 80.0
    given = [flag for flag in LM_FLAGS if getattr(args, flag) is not None]
    if not lm and given:
        raise UsageError(f"--{given[0].replace('_', '-')} is for a language model (--model llama or gpt2)")
    if lm and args.parameters is not None:
        raise UsageError(f"--parameters is for a raw parameter count: --model {args.model} counts its own")
    if MODELS[args.model].has_attention and args.strategy:
        raise UsageError(
            f"--strategy chooses among the MLP's strategies (mlp-*); --model {args.model} is planned "
            "as composed layouts: give --mesh (pp=..,fsdp=..,tp=..) to plan one"
        )
    check_numbers(args, lm)


def check_numbers(args, lm: bool) -> None:
    if args.parameters is not None:
        if not (args.parameters >= 1 and args.parameters == int(args.parameters)):
            raise UsageError(f"--parameters must be a whole number >= 1, got {args.parameters:g}")
        if args.layers is None:
            args.layers = 1
    else:  # a language model without a preset: the flags its shape needs
        needed = ("layers", "hidden", "vocab", "seq") if lm else ("layers", "hidden", "seq", "batch")
        for flag in needed if args.preset is None else ():
            if getattr(args, flag) is None:
                raise UsageError(f"--{flag} is required for --model {args.model} (or a --preset)")
    for flag in (*COUNTS, "per_node", "top", "max_cp"):
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


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m spmd.plan", description=__doc__.splitlines()[0])
    model_flags(p.add_argument_group("the model: spmd's MLP, its transformer, or a language model"))
    c = p.add_argument_group("the cluster")
    c.add_argument("--devices", type=int, help="required, except for a language model")
    c.add_argument("--memory-gb", type=float, help="memory per device (80 when not given)")
    c.add_argument("--per-node", type=int, default=8, help="devices per node")
    c.add_argument("--intra-gbs", type=float, default=300.0, help="GB/s a device sends inside a node")
    c.add_argument("--inter-gbs", type=float, default=25.0, help="GB/s a device sends across nodes")
    c.add_argument("--tflops", type=float, default=400.0, help="sustained TFLOP/s per device")
    t = p.add_argument_group("training state and layouts (--model transformer, llama, gpt2, --parameters)")
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


def model_flags(m) -> None:
    m.add_argument(
        "--model",
        choices=tuple(MODELS),
        help="mlp (the default): the mlp-* strategies; transformer: every composed layout (pp, dp/fsdp, cp, tp); "
        "llama, gpt2: a language model's parameters, flops per token and training state, and its layouts given "
        "--devices and --batch (default: the --preset's model)",
    )
    m.add_argument(
        "--preset", choices=sorted(PRESETS), help="a published shape (its model's; the flags below override it)"
    )
    m.add_argument(
        "--parameters",
        type=float,
        help="a raw parameter count: the training state per device under "
        "DP and each ZeRO stage (ZeRO's Figure 1), in --layers layers",
    )
    m.add_argument("--layers", type=int, help="L (a preset's when given)")
    m.add_argument("--hidden", type=int, help="h (a preset's when given)")
    m.add_argument("--ffn", type=int, help="f (default 4 x hidden; llama: 2/3 of 4h up to a multiple of 256)")
    m.add_argument("--heads", type=int, help="attention heads (default hidden / 128)")
    m.add_argument("--kv-heads", type=int, help="llama: key/value heads, grouped-query (default: --heads)")
    m.add_argument("--vocab", type=int, help="a language model's vocabulary size")
    m.add_argument(
        "--tie-embeddings",
        action=argparse.BooleanOptionalAction,
        help="a language model's head is its embedding (default: the preset's, or the model's)",
    )
    m.add_argument("--experts", type=int, help="llama: a mixture of experts in each FFN's place (0: dense)")
    m.add_argument("--top-k", type=int, help="llama: experts a token passes through (default: the preset's; 2)")
    m.add_argument("--seq", type=int, help="sequence length (a language model: its context)")
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


def format_plan(shape: dict, element_bytes: int, cluster: Cluster, estimates, refused, top: int) -> str:
    params = parameters(Net(**shape, seq=1, heads=1))
    lines = [
        f"model: {shape['layers']} layers, h {shape['hidden']}, f {shape['ffn']}, {shape['batch']} tokens a step, "
        f"{params / 1e9:.1f} G parameters = {params * element_bytes / GB:.0f} GB "
        f"at {element_bytes} bytes (gradients and momentum as much again, each)",
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
    """A dense model with attention (the transformer): every composed layout of the flags' shape."""
    heads = args.heads or max(1, args.hidden // 128)
    net = Net(
        model=args.model,
        layers=args.layers,
        hidden=args.hidden,
        ffn=args.ffn or MODELS[args.model].default_ffn(args.hidden),
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
        cp=core_named(args.cp),
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


def cluster_of(args) -> Cluster:
    """The cluster of the flags, built here only."""
    return Cluster(
        args.devices, args.memory_gb * GB, args.per_node, args.intra_gbs * GB, args.inter_gbs * GB, args.tflops * 1e12
    )


def lm_net(args) -> Net:
    """The planned language model as the engine's config: the preset's fields with the flags given over them
    (without a preset: heads h / 128 and the model's ffn rule), --batch sequences of its context a step."""
    fields: dict = dict(PRESETS[args.preset][1]) if args.preset else {"model": args.model}
    fields.update({flag: getattr(args, flag) for flag in SHAPE_FLAGS if getattr(args, flag) is not None})
    fields.setdefault("heads", max(1, fields["hidden"] // 128))
    fields.setdefault("ffn", MODELS[args.model].default_ffn(fields["hidden"]))
    policy = dict(optimizer=args.optimizer, precision=args.precision, reduce_dtype=args.reduce_dtype)
    return Net(**fields, batch=args.batch or 1, **policy)


def lm_title(args, net: Net) -> str:
    """The preset's name (and whether the flags changed it), or the model's."""
    if args.preset is None:
        return net.spec.summary(asdict(net))[0]
    title, fields = PRESETS[args.preset]
    changed = any(getattr(net, name) != value for name, value in fields.items())
    return f"{title} (--preset {args.preset})" + (", with the flags' changes" if changed else "")


def lm_plan(args) -> str:
    """A language model's count, flops and state, then its layouts when the cluster and batch are given."""
    net = lm_net(args)
    report = lm_report(net, lm_title(args, net), args.devices, args.memory_gb)
    if args.devices is not None and args.batch is not None:
        report += "\n\n" + layout_plan(args, cluster_of(args), net)
    return report


def mlp_plan(args, parser) -> str:
    """The mlp-* presets on the cluster, estimated as every layout is (spmd.plan.layouts)."""
    cluster = cluster_of(args)
    ffn = args.ffn or MODELS[args.model].default_ffn(args.hidden)
    shape = dict(layers=args.layers, hidden=args.hidden, ffn=ffn, batch=args.seq * args.batch)
    mesh = Mesh.parse(args.mesh) if args.mesh else None
    estimates, refused = plan_presets(shape, args.microbatches, args.element_bytes, cluster, args.strategy, mesh)
    if not estimates and not refused:
        fail(
            parser.prog,
            f"no strategy runs on the axes of --mesh {args.mesh}"
            + (f" (of {', '.join(args.strategy)})" if args.strategy else ""),
        )
    return format_plan(shape, args.element_bytes, cluster, estimates, refused, args.top)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_args(args)
        spec = MODELS[args.model]
        if args.parameters is not None:
            policy = Precision(args.precision, args.reduce_dtype)
            out = format_state_table(int(args.parameters), args.layers, args.devices, policy, args.optimizer)
        elif spec.reads_tokens:
            out = lm_plan(args)
        elif spec.has_attention:
            out = transformer_plan(args, cluster_of(args))
        else:
            out = mlp_plan(args, parser)
    except ValueError as exc:
        fail(parser.prog, str(exc))
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
