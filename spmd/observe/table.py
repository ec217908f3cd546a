"""python -m spmd.observe.table REPORT.json ...: one markdown row per training run's --json report.

Each row: the layout (and the sequence length, the optimizer and precision, when the runs differ in them), the
bytes the fullest rank sends a step over each mesh axis that some row's mesh has (measured; the report says
whether every rank's equal the closed form), its memory by kind, held in all and tracemalloc's peak (MPI runs:
one process a rank), and whether the check passed. Every figure is the report's.
"""

from __future__ import annotations

import sys

from spmd.model.kernels import MEMORY_KINDS
from spmd.observe.reports import load_all
from spmd.usage import Parser, UsageError, fail

MIB = 2**20
AXES = ("pp", "dp", "fsdp", "ep", "cp", "tp")


def training_state(report: dict) -> str:
    """ "adamw bf16" (the optimizer and the precision; "/bf16" when the gradients are reduced in another dtype)."""
    model = report["model"]
    reduce = model.get("reduce_dtype") or ""
    return f"{model.get('optimizer', 'sgd')} {model.get('precision', 'fp32')}" + (f"/{reduce}" if reduce else "")


def row(report: dict, shown: tuple[str, ...] = AXES, columns: tuple[str, ...] = ()) -> str:
    fullest = max(range(report["ranks"]), key=lambda r: sum(report["memory"][r].values()))
    axes = report.get("axis_bytes") or [{}] * report["ranks"]
    sent = {axis: max(a.get(axis, [0, 0])[0] for a in axes) for axis in AXES}
    held = report["memory"][fullest]
    peak = report["peak_bytes"][fullest] if report.get("peak_bytes") else None
    exact = report["bytes_match_model"] and report["memory_match_model"]
    model = report["model"]
    cells = [
        report["layout"].removeprefix("mesh ")
        + (", tied embeddings" if model.get("tie_embeddings") else "")
        + (f", {model['experts']} experts of f {model['ffn']}, top-{model['top_k']}" if model.get("experts") else "")
        + (f", capacity {model['capacity_factor']:g}" if model.get("capacity_factor") else "")
    ]
    cells += [str(report["model"].get("seq", ""))] if "seq" in columns else []
    cells += [training_state(report)] if "state" in columns else []
    cells += [f"{sent[a] / MIB:.2f}" if any(a in x for x in axes) else "" for a in shown]
    cells += [f"{held[k] / MIB:.2f}" for k in MEMORY_KINDS]
    cells += [
        f"{sum(held.values()) / MIB:.2f}",
        f"{peak / MIB:.2f}" if peak is not None else "",
        "yes" if exact else "NO",
        {True: "OK", False: "FAILED", None: ""}[report.get("ok")],
    ]
    return "| " + " | ".join(cells) + " |"


def table(reports: list[dict]) -> str:
    shown = tuple(a for a in AXES if any(a in axes for r in reports for axes in r.get("axis_bytes") or []))
    # a column for the sequence length, the optimizer and precision when the runs differ in them
    columns = tuple(
        name
        for name, of in (("seq", lambda r: r["model"].get("seq")), ("state", training_state))
        if len({of(r) for r in reports}) > 1
    )
    head = [
        "layout",
        *(["seq"] if "seq" in columns else []),
        *(["optimizer, precision"] if "state" in columns else []),
        *(f"{a} MiB" for a in shown),
        *MEMORY_KINDS,
        "held MiB",
        "peak MiB",
        "== closed form",
        "check",
    ]
    return "\n".join(
        ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head), *(row(r, shown, columns) for r in reports)]
    )


def main(argv=None) -> int:
    p = Parser(prog="python -m spmd.observe.table", description=__doc__.splitlines()[0])
    p.add_argument("reports", nargs="+", help="--json reports of python -m spmd train")
    args = p.parse_args(argv)
    try:
        reports = load_all(args.reports, "REPORT", "training")
    except UsageError as exc:
        fail(p.prog, str(exc))
    print(table(reports))
    return 0


if __name__ == "__main__":
    sys.exit(main())
