"""A run's step time by part (spmd.stopwatch), per rank: the mean of its steps, the first (which touches fresh
memory) left out when there are more; and its line in the train report."""

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


def mean_parts(laps: list[dict[str, float]]) -> np.ndarray:
    """Seconds a step in each part, in PARTS' order."""
    kept = laps[1:] if len(laps) > 1 else laps
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
