"""Pictures of a run: the timeline of a trace, bytes and memory per rank, memory by kind of training runs.

    python -m spmd.observe.plot trace.json --out timeline.png
    python -m spmd.observe.plot --reports dp.json fsdp.json --out memory.png
    python -m spmd.observe.plot --memory mlp-dp.json mlp-fsdp.json --out ladder.png
    python -m spmd.observe.plot --by-seq s64.json s128.json ring64.json ring128.json --out long.png
    python -m spmd.observe.plot --loss run.json resumed.json --out loss.png
    python -m spmd.observe.plot --breakdown run.json --out breakdown.png

A trace comes from `--trace`; a report is the JSON line of `--json`.
"""

import sys

from spmd.model.registry import summary
from spmd.observe.breakdown_plot import breakdown_table, draw_breakdown
from spmd.observe.reports import load_all
from spmd.transport.mesh import Mesh
from spmd.usage import Parser, UsageError, fail, writable

PROG = "python -m spmd.observe.plot"
# Compute is split by pass, named by its first letter: "F layer 2" forward, "B layer 2" the whole backward, and
# under a zero-bubble schedule "I layer 2" its input-gradient half, "W layer 2" its weight-gradient half.
PASSES = {"F": "forward compute", "B": "backward compute", "I": "input gradient", "W": "weight gradient"}
COLORS = {
    "forward compute": "tab:blue",
    "backward compute": "tab:purple",
    "input gradient": "tab:pink",
    "weight gradient": "tab:olive",
    "optimizer update": "tab:gray",
    "transfer": "tab:green",
    "send": "tab:orange",
    "wait": "tab:red",
}


# a transfer's colour: the mesh axis joining its two ranks (the trace's otherData names the mesh)
AXIS_COLORS = {
    "pp": "tab:brown",
    "dp": "gold",
    "fsdp": "tab:green",
    "ep": "navy",
    "cp": "teal",
    "tp": "tab:cyan",
    "world": "black",
}


def transfer_axis(event: dict, mesh) -> str:
    """The mesh axis a transfer crossed: the one coordinate its two ranks differ in ("world" if several)."""
    peer = int(event["name"].rsplit(" ", 1)[1])
    mine, theirs = mesh.coords(event["pid"]), mesh.coords(peer)
    differ = [axis for axis in mesh.names if mine[axis] != theirs[axis]]
    return f"transfer over {differ[0]}" if len(differ) == 1 else "transfer over world"


def label_of(event: dict, mesh=None) -> str:
    if event["cat"] == "transfer" and mesh is not None:
        return transfer_axis(event, mesh)
    if event["cat"] == "compute":
        return "optimizer update" if event["name"] == "update" else PASSES.get(event["name"][:1], "forward compute")
    return event["cat"]


def color_of(event: dict, mesh=None) -> str:
    label = label_of(event, mesh)
    return AXIS_COLORS[label.rsplit(" ", 1)[1]] if label.startswith("transfer over") else COLORS.get(label, "gray")


def drawn_data(lines) -> dict[str, str]:
    """A PNG's metadata holding what it draws, a line a bar or curve (spmd.observe.docs compares it)."""
    return {"Description": "\n".join(lines)}


def legend_outside(ax, handles=None) -> None:
    """The legend right of the axes, where it covers nothing."""
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, borderaxespad=0)


def draw_timeline(trace: dict, out: str) -> None:
    """One row per rank: compute, sends and waits on its main line, transfers (concurrent) drawn under it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    named = trace.get("otherData", {}).get("mesh")
    mesh = Mesh.parse(named) if named else None
    ranks = sorted({e["pid"] for e in spans})
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.8 * len(ranks)))
    for row, rank in enumerate(ranks):
        for e in (e for e in spans if e["pid"] == rank):
            below = e["cat"] == "transfer"  # the y axis is inverted: a larger y is lower on the page
            y = row + (0.62 if below else 0.08)
            ax.broken_barh(
                [(e["ts"] / 1e3, max(e["dur"] / 1e3, 0.05))], (y, 0.3 if below else 0.5), color=color_of(e, mesh)
            )
    ax.set_yticks([row + 0.5 for row in range(len(ranks))])
    ax.set_yticklabels([f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the run started")
    drawn = {label_of(e, mesh) for e in spans}
    kinds = {**COLORS, **{f"transfer over {axis}": c for axis, c in AXIS_COLORS.items()}}
    legend_outside(ax, [Patch(color=c, label=k) for k, c in kinds.items() if k in drawn])
    ax.set_title("What each rank does: forward and backward compute, sends and waits; under them, transfers in flight")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def in_window(trace: dict, window: str) -> dict:
    """The trace's spans that overlap [A, B] ms (the run's clock), or UsageError naming the flag."""
    try:
        start, _, end = window.partition(":")
        lo, hi = float(start or "-inf"), float(end or "inf")
        if not lo < hi or not _:
            raise ValueError
    except ValueError:
        raise UsageError(
            f"--window takes A:B, two times in ms with A < B (either may be left out), got {window!r}"
        ) from None
    kept = [
        e
        for e in trace["traceEvents"]
        if e.get("ph") != "X" or (e["ts"] / 1e3 <= hi and (e["ts"] + e["dur"]) / 1e3 >= lo)
    ]
    if not any(e.get("ph") == "X" for e in kept):
        raise UsageError(f"--window {window}: no span of the trace falls in it")
    return {**trace, "traceEvents": kept}


def steps_window(trace: dict, steps: str) -> str:
    """--steps A:B (1-based, inclusive) as the --window in ms: from the end of step A - 1's update on rank 0 (the
    run's start for step 1) to the end of step B's; UsageError naming the flag. A step ends with its run of
    update spans (one a unit) before the next step's compute."""
    ends: list[float] = []
    updating = False
    for e in sorted(
        (e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("pid") == 0), key=lambda e: e["ts"]
    ):
        if e.get("name") == "update":  # the step's first update opens its end, a later one moves it
            end = (e["ts"] + e["dur"]) / 1e3
            if updating:
                ends[-1] = end
            else:
                ends.append(end)
            updating = True
        elif e.get("name", "")[:2] in ("F ", "B ", "I ", "W "):
            updating = False
    try:
        first, _, last = steps.partition(":")
        a, b = int(first or 1), int(last or len(ends))
        if not (_ and 1 <= a <= b <= len(ends)):
            raise ValueError
    except ValueError:
        raise UsageError(
            f"--steps takes A:B, steps 1 <= A <= B <= {len(ends)} (the trace's; either may be left out), got {steps!r}"
        ) from None
    return f"{ends[a - 2] if a > 1 else ''}:{ends[b - 1]}"


def draw_reports(reports: list, out: str) -> None:
    """Bars per rank: bytes sent and peak memory (measured where known, else the model), one group per report."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(reports)
    for i, r in enumerate(reports):
        x = np.arange(r["ranks"]) + i * width
        label = f"{r['strategy']} ({r['backend']}, {r['ranks']} ranks)"
        axes[0].bar(x, np.array(r["bytes_sent"]) / 2**20, width, label=label)
        memory = r["peak_bytes"] or r["model_peak_bytes"]
        axes[1].bar(x, np.array(memory) / 2**20, width, label=label + ("" if r["peak_bytes"] else ", model"))
    shape = f"A {reports[0]['m']}x{reports[0]['k']} @ B {reports[0]['k']}x{reports[0]['n']} {reports[0]['dtype']}"
    for ax, title in zip(axes, ["bytes sent per rank", "peak memory per rank"], strict=True):
        ax.set_xlabel("rank")
        ax.set_ylabel("MiB")
        ax.set_title(f"{title}, {shape}")
        ax.set_xticks(np.arange(max(r["ranks"] for r in reports)) + 0.4 - width / 2)
        ax.set_xticklabels(range(max(r["ranks"] for r in reports)))
    legend_outside(axes[1])
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


KIND_COLORS = {
    "params": "tab:blue",
    "master": "tab:cyan",
    "grads": "tab:orange",
    "optimizer": "tab:green",
    "activations": "tab:red",
    "buffers": "tab:gray",
}


def draw_memory(reports: list, out: str) -> None:
    """Per training report, one stacked bar per rank: the bytes it holds by kind (measured == model, tested); with
    more than 40 bars in all, only each report's fullest rank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fullest_only = sum(r["ranks"] for r in reports) > 40
    width = 1.7 * len(reports) + 2 if fullest_only else 0.4 * sum(r["ranks"] + 1 for r in reports)
    fig, ax = plt.subplots(figsize=(max(7, width), 5))
    x, ticks, labels = 0, [], []
    drawn = []  # what the bars show, as text: kept in the PNG, so a check can compare a picture's numbers
    for r in reports:
        first = x
        ranks = list(enumerate(r["memory"]))
        if fullest_only:
            ranks = [max(ranks, key=lambda item: sum(item[1].values()))]
        for rank, held in ranks:
            drawn.append(f"{r['layout']} rank {rank}: " + " ".join(f"{k} {held[k] / 2**20:.2f}" for k in KIND_COLORS))
            bottom = 0.0
            for kind, color in KIND_COLORS.items():
                ax.bar(x, held[kind] / 2**20, 0.8, bottom=bottom, color=color, label=kind if x == 0 else None)
                bottom += held[kind] / 2**20
            ax.text(x, bottom, str(rank), ha="center", va="bottom", fontsize=7)
            x += 1
        ticks.append((first + x - 1) / 2)
        composed = r["strategy"] == "train"
        state = r["model"].get("optimizer")  # the optimizer and precision, where the run chose them
        state_line = (
            f"\n{state} {r['model']['precision']}"
            + (f"/{r['model']['reduce_dtype']}" if r["model"].get("reduce_dtype") else "")
            if state
            else ""
        )
        labels.append((_wrap(r["layout"]) if composed else f"{r['strategy']}\n{r['mesh']}") + state_line)
        x += 1
    m = reports[0]["model"]
    ax.set_xticks(ticks)
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("MiB per rank")
    model = summary(m)[0]
    which = "the fullest rank of each run" if fullest_only else "numbers: rank"
    ax.set_title(
        f"Memory per rank by kind ({which}), {model} {m['layers']} layers, h {m['hidden']}, "
        f"f {m['ffn']}, {m['tokens']} tokens" + ("" if m.get("optimizer") else f", {m['dtype']}")
    )
    legend_outside(ax)
    fig.tight_layout()
    fig.savefig(out, dpi=110, metadata=drawn_data(drawn))
    plt.close(fig)


def draw_by_sequence(reports: list, out: str) -> None:
    """Activation memory of the fullest rank against the sequence length, one line per layout (same layout and
    recomputation, different --seq)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines: dict[str, list] = {}
    for r in reports:
        label = r["layout"].replace("mesh ", "")
        lines.setdefault(label, []).append((r["model"]["seq"], max(m["activations"] for m in r["memory"]) / 2**20))
    fig, ax = plt.subplots(figsize=(9, 5))
    for label, points in lines.items():
        points.sort()
        ax.plot(
            [p[0] for p in points],
            [p[1] for p in points],
            marker="o",
            label=label,
            linestyle="--" if "recomputation" in label else "-",
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("activations kept, MiB (fullest rank)")
    m = reports[0]["model"]
    ax.set_title(
        f"Activation memory per rank against sequence length\ntransformer {m['layers']} layers, "
        f"h {m['hidden']}, {m['heads']} heads, batch {m['batch']}, {m['dtype']}",
        fontsize=10,
    )
    legend_outside(ax)
    fig.tight_layout()
    fig.savefig(
        out,
        dpi=110,
        metadata=drawn_data(
            f"{label}: " + ", ".join(f"seq {seq} {mib:.2f}" for seq, mib in points) for label, points in lines.items()
        ),
    )
    plt.close(fig)


def draw_loss(reports: list, out: str) -> None:
    """Training loss per step and the validation loss against tokens seen, one run after another (a run and its
    resumed continuation), with the corpus's unigram entropy (what learning token frequencies alone reaches)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for r in reports:
        tokens = r["model"]["batch"] * r["model"]["seq"]
        steps = range(r["first_step"] + 1, r["first_step"] + len(r["losses"]) + 1)
        label = f"{r['ranks']} ranks, {r['mesh']}" + (f", from step {r['first_step']}" if r["first_step"] else "")
        ax.plot([s * tokens for s in steps], r["losses"], linewidth=1, label=f"train, {label}")
        if r.get("validation"):
            ax.plot(
                [v["step"] * tokens for v in r["validation"]],
                [v["loss"] for v in r["validation"]],
                marker="o",
                label=f"validation, {label}",
            )
    entropy = (reports[0].get("data") or {}).get("unigram_entropy")
    if entropy is not None:
        ax.axhline(entropy, color="gray", linestyle="--", label=f"unigram entropy {entropy:.3f}")
    ax.set_xlabel("tokens seen")
    ax.set_ylabel("loss (nats a token)")
    scale = bits_a_nat(reports)
    if scale is not None:  # the same text evaluated: bits a byte are nats a token times one number

        def to_bits(nats):
            return nats * scale

        def to_nats(bits):
            return bits / scale

        right = ax.secondary_yaxis("right", functions=(to_bits, to_nats))
        right.set_ylabel("validation: bits a byte")
    m = reports[0]["model"]
    ax.set_title(
        f"{summary(m)[0]} {m['layers']} layers, h {m['hidden']}, {m['heads']} heads, {m['batch']} "
        f"sequences of {m['seq']} a step",
        fontsize=10,
    )
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def bits_a_nat(reports: list) -> float | None:
    """Validation's bits a byte over its nats a token, when every run evaluated (the same corpus and evaluation
    tokens give the same ratio); None otherwise."""
    ratios = {
        round(v["bits_per_byte"] / v["loss"], 12)
        for r in reports
        for v in r.get("validation") or []
        if v.get("bits_per_byte") is not None and v["loss"] > 0
    }
    return ratios.pop() if len(ratios) == 1 else None


def _wrap(text: str) -> str:
    """A composition's description, one part a line (it labels a group of bars)."""
    return text.replace("mesh ", "").replace("fsdp shards as ", "").replace(", ", "\n")


def build_parser() -> Parser:
    parser = Parser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("trace", nargs="?", help="a trace written by --trace")
    parser.add_argument("--reports", nargs="+", metavar="REPORT.json", help="JSON reports written with --json")
    parser.add_argument(
        "--memory",
        nargs="+",
        metavar="REPORT.json",
        help="JSON reports of training runs (python -m spmd mlp-... --json)",
    )
    parser.add_argument(
        "--by-seq",
        nargs="+",
        metavar="REPORT.json",
        help="JSON reports of training runs at several --seq: activation memory against it",
    )
    parser.add_argument(
        "--loss",
        nargs="+",
        metavar="REPORT.json",
        help="JSON reports of training runs (one, or a run and its resumed continuations): the loss "
        "and validation loss against tokens seen",
    )
    parser.add_argument(
        "--breakdown",
        nargs="+",
        metavar="REPORT.json",
        help="JSON reports of training runs: each rank's step split into GEMMs, attention, "
        "elementwise, communication waits, optimizer and the rest",
    )
    parser.add_argument(
        "--window",
        metavar="A:B",
        help="a trace: only what overlaps ms A to B since the run started (either end may be left out)",
    )
    parser.add_argument(
        "--steps", metavar="A:B", help="a trace: only steps A to B (from 1; either end may be left out), as a --window"
    )
    parser.add_argument("--out", required=True, help="the PNG to write")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if (args.window is not None or args.steps is not None) and args.trace is None:
        parser.error("--window and --steps take a trace file")
    if args.window is not None and args.steps is not None:
        parser.error("give --window or --steps, not both")
    if sum(x is not None for x in (args.trace, args.reports, args.memory, args.by_seq, args.loss, args.breakdown)) != 1:
        parser.error("give one of: a trace file, --reports, --memory, --by-seq, --loss, --breakdown")
    try:
        writable("--out", args.out)
        if args.trace is not None:
            trace = load_all([args.trace], "trace", "trace")[0]
            window = steps_window(trace, args.steps) if args.steps is not None else args.window
            draw_timeline(in_window(trace, window) if window else trace, args.out)
        elif args.reports is not None:
            draw_reports(load_all(args.reports, "--reports", "matmul"), args.out)
        elif args.memory is not None:
            draw_memory(load_all(args.memory, "--memory", "training"), args.out)
        elif args.breakdown is not None:
            bars = draw_breakdown(
                load_all(args.breakdown, "--breakdown", "training"), args.out, drawn_data, legend_outside
            )
            print(f"wrote {args.out}\n{breakdown_table(bars)}")
            return 0
        elif args.loss is not None:
            draw_loss(load_all(args.loss, "--loss", "training"), args.out)
        else:
            draw_by_sequence(load_all(args.by_seq, "--by-seq", "training"), args.out)
    except UsageError as exc:
        fail(PROG, str(exc))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
