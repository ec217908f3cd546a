"""Pipeline schedules simulated: what a rank holds, the slots its executor needs, the step table, the bubble.

Two simulations of the same orders: `simulate`, every action one time unit (the printed step table), and
`timeline`, actions taking T_F, T_B (input gradient), T_W (weight gradient) and T_B + T_W (whole backward),
for the bubble of a schedule at measured times. An action starts when its rank is free and its input is ready.
"""

from __future__ import annotations

import functools

from spmd.observe.schedule import Cell, Schedule
from spmd.parallel.schedules import Action, ideal_bubble, order, rank_of, ready_key, schedule_named, stage_of, waits_for

FREES = ("B", "I")  # the actions after which a (micro-batch, chunk)'s activations are no longer needed


def _most_live(
    kind: str, stages: int, microbatches: int, stage: int, chunks: int, opens: str, closes: tuple[str, ...]
) -> int:
    live = peak = 0
    for action in order(kind, stages, microbatches, stage, chunks):
        live += 1 if action.op == opens else -1 if action.op in closes else 0
        peak = max(peak, live)
    return peak


def in_flight(kind: str, stages: int, microbatches: int, stage: int, chunks: int = 1) -> int:
    """The most (micro-batch, chunk) activations rank `stage` holds at once (from F to B, or to I: the weight
    gradient's operands go to a stash): its order's."""
    return _most_live(kind, stages, microbatches, stage, chunks, "F", FREES)


def stashed(kind: str, stages: int, microbatches: int, stage: int, chunks: int = 1) -> int:
    """The most (micro-batch, chunk) weight-gradient stashes rank `stage` holds at once (from I to W)."""
    return _most_live(kind, stages, microbatches, stage, chunks, "I", ("W",))


def executor_slots(kind: str, stages: int, microbatches: int, chunks: int = 1) -> list[int]:
    """The activation slots each rank's executor needs so that no wait can close a cycle (_slots)."""
    return list(_slots(kind, stages, microbatches, chunks))


@functools.cache  # a simulation of four numbers: the planner asks it again for every layout of the same pipeline
def _slots(kind: str, stages: int, microbatches: int, chunks: int) -> tuple[int, ...]:
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
            return tuple(slots)
        for r in blocked:
            slots[r] += 1


def _slot_waits(kind: str, p: int, m: int, v: int, slots: list[int]) -> set[int]:
    """The ranks blocked on a slot when the executor's waits (with these slot counts) stall; empty if none."""
    placement = schedule_named(kind).placement
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
            s = stage_of(r, a.chunk, p, placement)
            needs = waits_for(a.op, a.microbatch, s, last)
            if needs is not None and done.get(needs, t) >= t:
                continue
            if a.op == "F":
                gate = pending[r].get(free[r][0]) if free[r] else ("no free slot",)
                if gate is not None and done.get(gate, t) >= t:
                    waiting_for_slot.add(r)
                    continue
                slot = slot_of[r][(a.chunk, a.microbatch)] = free[r].pop(0)
                pending[r].pop(slot, None)
            elif a.op in FREES:
                slot = slot_of[r].pop((a.chunk, a.microbatch))
                if s > 0:  # the input gradient sent from the slot: taken by the stage before's B or I
                    pending[r][slot] = ("G", a.microbatch, s - 1)
                free[r].append(slot)
            todo[r].pop(0)
            key = ready_key(a.op, a.microbatch, s)
            if key is not None:
                ran.append(key)
            else:
                ran.append(("W", a.microbatch, s))
        for key in ran:
            done[key] = t
        if not ran:
            if not waiting_for_slot:
                raise RuntimeError(
                    f"pipeline schedule {kind} with {p} stages, {m} micro-batches and {v} chunks is not progressing"
                )
            return waiting_for_slot
        t += 1
    return set()


def simulate(kind: str, stages: int, microbatches: int, chunks: int = 1) -> list[list[Action | None]]:
    """grid[t][r]: the Action rank r runs at step t (None when idle), each action one step."""
    p, v = stages, chunks
    placement = schedule_named(kind).placement
    todo = [order(kind, p, microbatches, r, v) for r in range(p)]
    done: dict[tuple[str, int, int], int] = {}  # (F or G, micro-batch, stage) -> step it ran at
    grid: list[list[Action | None]] = []
    last = p * v - 1
    while any(todo):
        row: list[Action | None] = []
        for r in range(p):
            if not todo[r]:
                row.append(None)
                continue
            a = todo[r][0]
            needs = waits_for(a.op, a.microbatch, stage_of(r, a.chunk, p, placement), last)
            ready = needs is None or done.get(needs, len(grid)) < len(grid)
            row.append(a if ready else None)
            if ready:
                todo[r].pop(0)
        for r, cell in enumerate(row):
            if cell is not None:
                key = ready_key(cell.op, cell.microbatch, stage_of(r, cell.chunk, p, placement))
                if key is not None:
                    done[key] = len(grid)
        if not any(row):
            raise RuntimeError(
                f"pipeline schedule {kind} with {p} stages, {microbatches} micro-batches and "
                f"{v} chunks is not progressing"
            )
        grid.append(row)
    return grid


def bubble(grid: list[list[Action | None]]) -> float:
    """The idle share of every rank's steps."""
    return sum(cell is None for row in grid for cell in row) / (len(grid) * len(grid[0]))


def timeline(
    kind: str, stages: int, microbatches: int, chunks: int, tf: float, tb: float, tw: float
) -> tuple[float, list[float]]:
    """(the step's length, each rank's idle time) with actions of these durations (one chunk's T_F, T_B, T_W)."""
    p, v = stages, chunks
    placement = schedule_named(kind).placement
    took = {"F": tf, "I": tb, "W": tw, "B": tb + tw}
    orders = [order(kind, p, microbatches, r, v) for r in range(p)]
    at, free = [0] * p, [0.0] * p
    finished: dict[tuple[str, int, int], float] = {}
    last, moved = p * v - 1, True
    while moved:
        moved = False
        for r in range(p):
            while at[r] < len(orders[r]):
                a = orders[r][at[r]]
                s = stage_of(r, a.chunk, p, placement)
                needs = waits_for(a.op, a.microbatch, s, last)
                if needs is not None and needs[0] == "G" and a.op == "W":
                    needs = None  # its own I, earlier on this rank
                if needs is not None and needs not in finished:
                    break
                free[r] = max(free[r], finished[needs] if needs is not None else 0.0) + took[a.op]
                key = ready_key(a.op, a.microbatch, s)
                if key is not None:
                    finished[key] = free[r]
                at[r] += 1
                moved = True
    if any(at[r] < len(orders[r]) for r in range(p)):
        raise RuntimeError(f"pipeline schedule {kind} is not progressing")
    span = max(free)
    return span, [span - sum(took[a.op] for a in o) for o in orders]


def schedule(kind: str, stages: int, microbatches: int, chunks: int = 1) -> Schedule:
    grid = simulate(kind, stages, microbatches, chunks)
    p, m, v = stages, microbatches, chunks
    sched = schedule_named(kind)
    where = "stage r, then 2p - 1 - r" if sched.placement == "V" else "stage c x p + rank"
    chunk_text = f", {v} chunks a rank (Fk.c: chunk c, {where})" if v > 1 else ""
    ops = "Fk/Ik/Wk = forward/input gradient/weight gradient" if sched.split else "Fk/Bk = forward/backward"
    intro = (
        f"PP {kind}: {p} stages, {m} micro-batches{chunk_text}; {ops} of micro-batch k "
        f"(F sends to the next stage, {'I' if sched.split else 'B'} to the previous). "
        f"Idle share {bubble(grid):.3f}; the schedule's, idle {sched.idle_text} a rank, at equal times: "
        f"{ideal_bubble(kind, p, m, v):.3f}."
    )
    steps = []
    for t, row in enumerate(grid):
        cells = []
        for r, a in enumerate(row):
            if a is None:
                cells.append(Cell(""))
                continue
            s = stage_of(r, a.chunk, p, sched.placement)
            to = s + 1 if a.op == "F" else s - 1 if a.op in ("B", "I") else None
            sends = (rank_of(to, p, sched.placement),) if to is not None and 0 <= to < p * v else ()
            cells.append(Cell(a.label(v), sends))
        steps.append((str(t), cells))
    return Schedule(intro, steps)
