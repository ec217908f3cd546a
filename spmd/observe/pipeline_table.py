"""python -m spmd.observe.pipeline_table REPORT.json ...: pipeline schedules compared from their runs' --json reports.

One markdown row per run: its schedule, the activations each pipeline rank holds (measured; the report says
whether they equal the closed form), the bubble at equal times by the schedule's formula, and the run's own
times: the mean T_F, T_B, T_W of one chunk action, the formula and the schedule's order simulated at those
times, and the idle share each stage measured. The time columns differ from run to run; the memory does not.
"""

from __future__ import annotations

import json
import sys

from spmd.usage import Parser

MIB = 2**20
TIMED = (
    "T_F, T_B, T_W ms",
    "bubble, formula at these times",
    "bubble, simulated at these times",
    "bubble, measured a stage",
)


def row(report: dict) -> str:
    pipeline = report["layout"].rsplit("pp ", 1)[-1]
    timed = report["bubble_at_measured_times"]
    share = timed["formula_share"]  # None: the schedule's formula holds at equal times only
    cells = [
        pipeline,
        ", ".join(f"{m['activations'] / MIB:.2f}" for m in report["memory"]),
        "yes" if report["memory_match_model"] else "NO",
        f"{report['bubble_model']:.3f}",
        ", ".join(f"{t * 1e3:.2f}" for t in timed["times"]),
        "-" if share is None else f"{share:.3f}",
        f"{timed['simulated_share']:.3f}",
        ", ".join(f"{b:.2f}" for b in report["bubble"]),
    ]
    return "| " + " | ".join(cells) + " |"


def table(reports: list[dict]) -> str:
    head = ["schedule", "activations a rank, MiB", "== closed form", "bubble, formula at equal times", *TIMED]
    return "\n".join(["| " + " | ".join(head) + " |", "|" + " --- |" * len(head), *(row(r) for r in reports)])


def main(argv=None) -> int:
    p = Parser(prog="python -m spmd.observe.pipeline_table", description=__doc__.splitlines()[0])
    p.add_argument("reports", nargs="+", help="--json reports of pipelined python -m spmd train runs")
    args = p.parse_args(argv)
    reports = []
    for path in args.reports:
        with open(path) as f:
            report = json.loads(f.read().splitlines()[-1])
        if not report.get("bubble_at_measured_times"):
            p.error(f"{path}: not a pipelined run's report (no bubble at its measured times)")
        reports.append(report)
    print(table(reports))
    return 0


if __name__ == "__main__":
    sys.exit(main())
