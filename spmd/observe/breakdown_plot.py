"""python -m spmd.observe.plot --breakdown run.json [more.json ...]: each rank's step split by part (GEMMs,
attention, elementwise, communication waits, optimizer, the rest; spmd.stopwatch), one bar a rank."""

from __future__ import annotations

from spmd.harness.breakdown import LABELS
from spmd.stopwatch import PARTS
from spmd.usage import UsageError

PART_COLORS = {
    "gemm": "tab:blue",
    "attention": "tab:purple",
    "elementwise": "tab:orange",
    "comm": "tab:red",
    "optimizer": "tab:gray",
    "rest": "lightgray",
}


def draw_breakdown(reports: list, out: str, drawn_data, legend_outside) -> list:
    """One horizontal bar per rank of each report, its milliseconds a step stacked by part; returns the bars
    (label, seconds by part), top to bottom."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = []  # (label, seconds by part)
    for r in reports:
        if not r.get("breakdown"):
            raise UsageError(
                f"--breakdown: the report of {r['layout']} has no breakdown (written before spmd measured one)"
            )
        rows += [(f"{r['mesh']} ({r['backend']}) rank {rank}", parts) for rank, parts in enumerate(r["breakdown"])]
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.45 * len(rows)))
    drawn = []
    for y, (label, parts) in enumerate(reversed(rows)):
        left = 0.0
        for name in PARTS:
            ms = 1e3 * parts[name]
            ax.barh(y, ms, 0.7, left=left, color=PART_COLORS[name], label=LABELS[name] if y == 0 else None)
            left += ms
        drawn.append(f"{label}: " + " ".join(f"{name} {1e3 * parts[name]:.1f}" for name in PARTS))
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([label for label, _ in reversed(rows)], fontsize=8)
    ax.set_xlabel("ms a step (the first step left out)")
    m = reports[0]["model"]
    ax.set_title(
        f"Where a step goes, per rank: h {m['hidden']}, f {m['ffn']}, {m['layers']} layers, {m['tokens']} tokens a step"
    )
    legend_outside(ax)
    fig.tight_layout()
    fig.savefig(out, dpi=110, metadata=drawn_data(drawn))
    plt.close(fig)
    return rows


def breakdown_table(rows: list) -> str:
    """The bars as a markdown table, ms a step by part."""
    lines = [
        "| rank | " + " | ".join(LABELS[name] for name in PARTS) + " | step ms |",
        "| --- |" + " --- |" * (len(PARTS) + 1),
    ]
    for label, parts in rows:
        cells = [f"{1e3 * parts[name]:.1f}" for name in PARTS]
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {1e3 * sum(parts[n] for n in PARTS):.1f} |")
    return "\n".join(lines)
