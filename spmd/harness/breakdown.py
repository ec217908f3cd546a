"""A run's step time by part (spmd.stopwatch), per rank: the mean of its timed steps (`timed`); and its line in
the train report."""

from __future__ import annotations

import numpy as np

from spmd.stopwatch import PARTS

LABELS = {
    "gemm": "GEMMs",
    "attention": "attention",
    "elementwise": "elementwise",
    "comm": "comm waits",
    "optimizer": "optimizer",
    "rest": "rest",
}


# tracemalloc's peak is taken over a run's first steps only (spmd.harness.train_job's Measures): it hooks every
# allocation of Python's objects too (each slice and view), which slowed the LM's step by a third
TRACED_STEPS = 2


def timed(steps: list) -> list:
    """The steps whose times count: those after the traced ones (the first of which also touches fresh memory),
    or after the first where a run has no more, or the only one."""
    return steps[TRACED_STEPS:] if len(steps) > TRACED_STEPS else steps[1:] or steps


def mean_parts(laps: list[dict[str, float]]) -> np.ndarray:
    """Seconds a step in each part, in PARTS' order."""
    kept = timed(laps)
    return np.array([np.mean([lap[name] for lap in kept]) for name in PARTS]) if kept else np.zeros(len(PARTS))


def as_dicts(rows) -> list[dict[str, float]]:
    return [dict(zip(PARTS, map(float, row), strict=True)) for row in rows]


def breakdown_lines(parts: list[dict[str, float]]) -> list[str]:
    """ "where a step goes" per rank: milliseconds in each part and its share of the step."""
    lines = ["  where a step goes, ms (share): " + " / ".join(LABELS[name] for name in PARTS)]
    for rank, seconds in enumerate(parts):
        total = sum(seconds.values()) or 1.0
        lines.append(
            f"    rank {rank}: "
            + " / ".join(f"{1e3 * seconds[name]:.1f} ({seconds[name] / total:.0%})" for name in PARTS)
            + f" = {1e3 * total:.1f}"
        )
    return lines
