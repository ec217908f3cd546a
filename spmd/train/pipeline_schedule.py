"""Pipeline schedules as pure logic: each stage's order of forwards and backwards, and a step table.

GPipe runs every micro-batch's forward, then every backward. 1F1B runs
min(p - r - 1, m) forwards (warm-up), then alternates one forward and one
backward, then the remaining backwards, so stage r holds at most min(p - r, m)
micro-batches' activations instead of m; the bubble is the same. The table
simulates unit-time actions: an action runs at the first step its input is ready.
"""

from __future__ import annotations

from spmd.strategies.base import Cell, Schedule

KINDS = ("gpipe", "1f1b")


def order(kind: str, stages: int, microbatches: int, stage: int) -> list[tuple[str, int]]:
    """Stage `stage`'s actions, in order: ("F", k) or ("B", k) for micro-batch k."""
    m = microbatches
    if kind == "gpipe":
        return [("F", k) for k in range(m)] + [("B", k) for k in range(m)]
    if kind != "1f1b":
        raise ValueError(f"unknown pipeline schedule {kind!r}; one of {', '.join(KINDS)}")
    warmup = min(stages - stage - 1, m)
    actions = [("F", k) for k in range(warmup)]
    for k in range(m - warmup):
        actions += [("F", warmup + k), ("B", k)]
    return actions + [("B", k) for k in range(m - warmup, m)]


def in_flight(kind: str, stages: int, microbatches: int, stage: int) -> int:
    """The most micro-batches whose activations stage `stage` holds at once."""
    return microbatches if kind == "gpipe" else min(stages - stage, microbatches)


def simulate(kind: str, stages: int, microbatches: int) -> list[list[str]]:
    """grid[t][r]: what stage r does at step t ("F3", "B0", or "" when idle), each action one step.

    F k on stage r waits for F k on r - 1; B k waits for B k on r + 1 (the last stage: its own F k).
    """
    todo = [order(kind, stages, microbatches, r) for r in range(stages)]
    done: dict[tuple[str, int, int], int] = {}  # (kind, micro-batch, stage) -> step it ran at
    grid = []
    while any(todo):
        row = []
        for r in range(stages):
            if not todo[r]:
                row.append("")
                continue
            action, k = todo[r][0]
            needs = ("F", k, r - 1) if action == "F" else ("B", k, r + 1) if r < stages - 1 else ("F", k, r)
            ready = (action == "F" and r == 0) or done.get(needs, len(grid)) < len(grid)
            row.append(f"{action}{k}" if ready else "")
            if ready:
                todo[r].pop(0)
        for r, cell in enumerate(row):
            if cell:
                done[(cell[0], int(cell[1:]), r)] = len(grid)
        if not any(row):
            raise RuntimeError(f"pipeline schedule {kind} with {stages} stages and {microbatches} "
                               "micro-batches is not progressing")
        grid.append(row)
    return grid


def bubble(grid: list[list[str]]) -> float:
    """The idle share of every stage's steps (the same for every stage with unit-time actions)."""
    return sum(cell == "" for row in grid for cell in row) / (len(grid) * len(grid[0]))


def schedule(kind: str, stages: int, microbatches: int) -> Schedule:
    grid = simulate(kind, stages, microbatches)
    p, m = stages, microbatches
    intro = (f"PP {kind}: {p} stages, {m} micro-batches; Fk/Bk = forward/backward of micro-batch k "
             f"(sends to the next/previous stage). Idle share {bubble(grid):.3f} = (p-1)/(m+p-1) = "
             f"{(p - 1) / (m + p - 1):.3f}.")
    steps = []
    for t, row in enumerate(grid):
        cells = []
        for r, cell in enumerate(row):
            last, first = r == p - 1, r == 0
            sends = () if not cell or (cell[0] == "F" and last) or (cell[0] == "B" and first) else \
                ((r + 1,) if cell[0] == "F" else (r - 1,))
            cells.append(Cell(cell, sends))
        steps.append((str(t), cells))
    return Schedule(intro, steps)
