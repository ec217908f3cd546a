"""Pipeline schedules as data: each rank's list of Actions, simulated, and a step table.

The layers are cut into p x v stages; with v model chunks per rank ("loop" layout, as Megatron and
torchtitan) stage s = chunk x p + rank, so a micro-batch goes round the ranks v times. An Action is
a forward or backward of one micro-batch through one of the rank's chunks.

- gpipe: every forward, then every backward; holds m micro-batches' activations.
- 1f1b: min(p - r - 1, m) forwards (warm-up), then one forward one backward, then the rest of the
  backwards: holds at most min(p - r, m); the bubble is GPipe's, (p-1)/(m+p-1) of the step.
- interleaved-1f1b (Megatron's virtual stages, v >= 2 chunks): forwards go chunk by chunk in groups
  of p micro-batches; warm-up 2 (p - r - 1) + (v - 1) p; the bubble shrinks to (p-1)/(v m) of the
  ideal step, for m a multiple of p.

Every schedule is registered in SCHEDULES, and the tests check every one the same way (each micro-batch
through each chunk forward then backward once, dependencies, in-flight bound, bubble formula).
The table simulates unit-time actions: an action runs at the first step its input is ready.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from spmd.observe.schedule import Cell, Schedule


@dataclass(frozen=True, order=True)
class Action:
    op: str  # "F" (forward) or "B" (backward)
    microbatch: int
    chunk: int = 0  # which of the rank's v model chunks

    def label(self, chunks: int) -> str:
        return f"{self.op}{self.microbatch}" + (f".{self.chunk}" if chunks > 1 else "")


def stage_of(rank: int, chunk: int, stages: int) -> int:
    """The global pipeline stage of `rank`'s chunk `chunk` (loop layout): chunk x p + rank."""
    return chunk * stages + rank


def gpipe(p: int, m: int, r: int, v: int) -> list[Action]:
    return [Action("F", k) for k in range(m)] + [Action("B", k) for k in range(m)]


def one_f_one_b(p: int, m: int, r: int, v: int) -> list[Action]:
    warmup = min(p - r - 1, m)
    actions = [Action("F", k) for k in range(warmup)]
    for k in range(m - warmup):
        actions += [Action("F", warmup + k), Action("B", k)]
    return actions + [Action("B", k) for k in range(m - warmup, m)]


def interleaved_1f1b(p: int, m: int, r: int, v: int) -> list[Action]:
    """Megatron's interleaved order: the k-th forward is micro-batch (k // pv) p + k % p of chunk (k // p) % v;
    backwards walk the chunks the other way."""
    total = m * v

    def action(op: str, k: int) -> Action:
        chunk = (k // p) % v
        return Action(op, (k // (p * v)) * p + k % p, chunk if op == "F" else v - 1 - chunk)

    warmup = min(2 * (p - r - 1) + (v - 1) * p, total)
    actions = [action("F", k) for k in range(warmup)]
    for k in range(total - warmup):
        actions += [action("F", warmup + k), action("B", k)]
    return actions + [action("B", k) for k in range(total - warmup, total)]


@dataclass(frozen=True)
class PipelineSchedule:
    name: str
    order: Callable[[int, int, int, int], list[Action]]  # (p, m, rank, v) -> that rank's actions
    chunked: bool = False  # takes v >= 2 model chunks per rank (the others take exactly 1)

    def check(self, stages: int, microbatches: int, chunks: int) -> None:
        """ValueError naming the flag, if this schedule cannot run these sizes."""
        if chunks < 1:
            raise ValueError(f"--chunks must be >= 1, got {chunks}")
        if not self.chunked and chunks != 1:
            raise ValueError(f"--chunks {chunks}: pipeline schedule {self.name} runs one model chunk per rank; "
                             "interleaved-1f1b takes several")
        if self.chunked and chunks > 1 and stages == 1:  # a rank would wait on sends to itself it has yet to take
            raise ValueError(f"--chunks {chunks} on one pipeline stage: there is no bubble to shrink; "
                             "use --chunks 1 or more ranks")
        if self.chunked and microbatches % stages:
            raise ValueError(f"interleaved-1f1b sends micro-batches round the ranks in groups of pp={stages}: "
                             f"--microbatches {microbatches} must be a multiple of {stages}")


SCHEDULES: dict[str, PipelineSchedule] = {s.name: s for s in (
    PipelineSchedule("gpipe", gpipe),
    PipelineSchedule("1f1b", one_f_one_b),
    PipelineSchedule("interleaved-1f1b", interleaved_1f1b, chunked=True),
)}


def schedule_named(kind: str) -> PipelineSchedule:
    if kind not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {kind!r}; one of {', '.join(SCHEDULES)}")
    return SCHEDULES[kind]


def order(kind: str, stages: int, microbatches: int, stage: int, chunks: int = 1) -> list[Action]:
    """Rank `stage`'s actions, in order."""
    schedule = schedule_named(kind)
    schedule.check(stages, microbatches, chunks)
    return schedule.order(stages, microbatches, stage, chunks)


def in_flight(kind: str, stages: int, microbatches: int, stage: int, chunks: int = 1) -> int:
    """The most (micro-batch, chunk) activations rank `stage` holds at once: read off its order."""
    live = peak = 0
    for action in order(kind, stages, microbatches, stage, chunks):
        live += 1 if action.op == "F" else -1
        peak = max(peak, live)
    return peak


def input_of(a: Action, stage: int, last: int) -> tuple[str, int, int] | None:
    """The action `a` (run on `stage`) waits for: F k on the stage before; B k on the stage after (the last
    stage: its own F k); None for the first stage's forwards."""
    if a.op == "F":
        return None if stage == 0 else ("F", a.microbatch, stage - 1)
    return ("F", a.microbatch, stage) if stage == last else ("B", a.microbatch, stage + 1)


def executor_slots(kind: str, stages: int, microbatches: int, chunks: int = 1) -> list[int]:
    """The activation slots each rank's executor needs so that no wait can close a cycle.

    A slot is busy from its forward until the gradient its backward sends back out of it has been taken by
    the previous stage, which can be later than its activations die (in_flight): with interleaving and
    m = 2p, two ranks at in_flight slots each wait for the other to take such a gradient. The executor
    reuses free slots first-in first-out, so its waits are fixed by the orders: simulate them, adding a slot
    to every rank that blocked on one, until the simulation completes.
    """
    p, v = stages, chunks
    slots = [in_flight(kind, p, microbatches, r, v) for r in range(p)]
    while True:
        blocked = _slot_waits(kind, p, microbatches, v, slots)
        if not blocked:
            return slots
        for r in blocked:
            slots[r] += 1


def _slot_waits(kind: str, p: int, m: int, v: int, slots: list[int]) -> set[int]:
    """The ranks blocked on a slot when the executor's waits (with these slot counts) stall; empty if none."""
    todo = [order(kind, p, m, r, v) for r in range(p)]
    free = [list(range(n)) for n in slots]
    pending: list[dict[int, tuple]] = [{} for _ in range(p)]  # slot -> the action that must take its gradient
    slot_of: list[dict[tuple[int, int], int]] = [{} for _ in range(p)]
    done: dict[tuple[str, int, int], int] = {}
    last, t = p * v - 1, 0
    while any(todo):
        ran, waiting_for_slot = [], set()
        for r in range(p):
            if not todo[r]:
                continue
            a = todo[r][0]
            s = stage_of(r, a.chunk, p)
            needs = input_of(a, s, last)
            if needs is not None and done.get(needs, t) >= t:
                continue
            if a.op == "F":
                gate = pending[r].get(free[r][0]) if free[r] else ("no free slot",)
                if gate is not None and done.get(gate, t) >= t:
                    waiting_for_slot.add(r)
                    continue
                slot = slot_of[r][(a.chunk, a.microbatch)] = free[r].pop(0)
                pending[r].pop(slot, None)
            else:
                slot = slot_of[r].pop((a.chunk, a.microbatch))
                if s > 0:
                    pending[r][slot] = ("B", a.microbatch, s - 1)
                free[r].append(slot)
            todo[r].pop(0)
            ran.append((a.op, a.microbatch, s))
        for key in ran:
            done[key] = t
        if not ran:
            if not waiting_for_slot:
                raise RuntimeError(f"pipeline schedule {kind} with {p} stages, {m} micro-batches and {v} chunks "
                                   "is not progressing")
            return waiting_for_slot
        t += 1
    return set()


def simulate(kind: str, stages: int, microbatches: int, chunks: int = 1) -> list[list[Action | None]]:
    """grid[t][r]: the Action rank r runs at step t (None when idle), each action one step.

    F k on stage s waits for F k on stage s - 1; B k waits for B k on s + 1 (the last stage: its own F k),
    wherever those stages live.
    """
    p, v = stages, chunks
    todo = [order(kind, p, microbatches, r, v) for r in range(p)]
    done: dict[tuple[str, int, int], int] = {}  # (op, micro-batch, stage) -> step it ran at
    grid: list[list[Action | None]] = []
    last = p * v - 1
    while any(todo):
        row: list[Action | None] = []
        for r in range(p):
            if not todo[r]:
                row.append(None)
                continue
            a = todo[r][0]
            needs = input_of(a, stage_of(r, a.chunk, p), last)
            ready = needs is None or done.get(needs, len(grid)) < len(grid)
            row.append(a if ready else None)
            if ready:
                todo[r].pop(0)
        for r, cell in enumerate(row):
            if cell is not None:
                done[(cell.op, cell.microbatch, stage_of(r, cell.chunk, p))] = len(grid)
        if not any(row):
            raise RuntimeError(f"pipeline schedule {kind} with {p} stages, {microbatches} micro-batches and "
                               f"{v} chunks is not progressing")
        grid.append(row)
    return grid


def bubble(grid: list[list[Action | None]]) -> float:
    """The idle share of every rank's steps."""
    return sum(cell is None for row in grid for cell in row) / (len(grid) * len(grid[0]))


def ideal_bubble(kind: str, stages: int, microbatches: int, chunks: int = 1) -> float:
    """The published idle share: (p-1)/(m+p-1), or, interleaved, (p-1)/(v m + p - 1) of the step
    (Megatron's (p-1)/(v m) of the ideal time, with unit-time chunk actions)."""
    p, m, v = stages, microbatches, chunks
    return (p - 1) / (v * m + p - 1)


def schedule(kind: str, stages: int, microbatches: int, chunks: int = 1) -> Schedule:
    grid = simulate(kind, stages, microbatches, chunks)
    p, m, v = stages, microbatches, chunks
    chunk_text = f", {v} chunks a rank (Fk.c: chunk c, stage c x p + rank)" if v > 1 else ""
    intro = (f"PP {kind}: {p} stages, {m} micro-batches{chunk_text}; Fk/Bk = forward/backward of micro-batch k "
             f"(sends to the next/previous stage). Idle share {bubble(grid):.3f}; "
             f"(p-1)/(v m + p - 1) = {ideal_bubble(kind, p, m, v):.3f}.")
    steps = []
    for t, row in enumerate(grid):
        cells = []
        for r, a in enumerate(row):
            if a is None:
                cells.append(Cell(""))
                continue
            s = stage_of(r, a.chunk, p)
            sends = () if (a.op == "F" and s == p * v - 1) or (a.op == "B" and s == 0) else \
                (((r + 1) % p,) if a.op == "F" else ((r - 1) % p,))
            cells.append(Cell(a.label(v), sends))
        steps.append((str(t), cells))
    return Schedule(intro, steps)
