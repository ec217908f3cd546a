"""Pipeline schedules as data: each rank's list of Actions, a placement of stages on ranks, a bubble formula.

The layers are cut into p x v stages. Placement "loop" (Megatron, torchtitan): rank r holds stages r, r + p,
..., so a micro-batch goes round the ranks v times. Placement "V" (ZB-V, DualPipeV): v = 2 and rank r holds
stages r and 2p - 1 - r, so rank 0 holds the first and the last stage (a tied embedding is local) and the
turn at the bottom of the V stays on rank p - 1. An Action is one micro-batch through one of the rank's chunks:
F forward; B the whole backward; or the backward in two halves, I (the input gradient dX = dY W^T, which the
previous stage waits for) and W (the weight gradient dW = X^T dY, which nothing waits for: it can fill a bubble).

- gpipe: every forward, then every backward; holds m micro-batches' activations.
- 1f1b: min(p - r - 1, m) forwards (warm-up), then one forward one backward, then the rest of the backwards:
  holds at most min(p - r, m).
- interleaved-1f1b (Megatron's virtual stages, v >= 2 chunks, loop placement): forwards chunk by chunk in
  groups of p micro-batches; warm-up 2 (p - r - 1) + (v - 1) p.
- zb-h1 (Qi et al., zero bubble, handcrafted 1): 1F1B's warm-up, then F, I and W, rank r keeping its last r
  weight gradients for the tail, where they fill the wait for input gradients: 1F1B's activations (p - r), and
  r + 1 weight-gradient stashes; p micro-batches from F to W on every rank (1F1B's peak, rank 0's); m >= p.
- zbv (V placement, 2 chunks): each rank runs, at each time, the first ready action in the order F (the later
  chunk first), I (oldest first), W, with at most 2p chunks from F to W (p stages' worth: 1F1B's peak); the
  order is that list scheduler's at equal unit times (zbv:T_F,T_B,T_W: at those), fixed before the run; m >= 2p.
- dualpipev (DeepSeek's DualPipeV, V placement): a handcrafted order mixing whole backwards with split ones,
  2p + 1 chunks of activations, r + 1 stashes on rank r; m >= 2p (dualpipev below).

A chunk's activations are held from its F to its B or I; a split schedule's I copies what the W will need into
a stash (spmd.model.weight_grads) held until the W, so the activations' slot is free again after the I.

Each schedule declares its bubble: idle time per rank in a step, in terms of one chunk's T_F, T_B (input
gradient) and T_W (weight gradient); a full backward takes T_B + T_W. The tests simulate every registered
schedule (spmd.parallel.pipeline_sim) and check the formula exactly at T_F = T_B = T_W.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cache


@dataclass(frozen=True, order=True)
class Action:
    op: str  # "F" (forward), "B" (whole backward), "I" (input gradient), "W" (weight gradient)
    microbatch: int
    chunk: int = 0  # which of the rank's v model chunks

    def label(self, chunks: int) -> str:
        return f"{self.op}{self.microbatch}" + (f".{self.chunk}" if chunks > 1 else "")


def stage_of(rank: int, chunk: int, stages: int, placement: str = "loop") -> int:
    """The global pipeline stage of `rank`'s chunk `chunk`: loop c x p + rank; V rank, then 2p - 1 - rank."""
    if placement == "V":
        return rank if chunk == 0 else 2 * stages - 1 - rank
    return chunk * stages + rank


def rank_of(stage: int, stages: int, placement: str = "loop") -> int:
    """The pipeline rank holding global stage `stage`."""
    if placement == "V":
        return stage if stage < stages else 2 * stages - 1 - stage
    return stage % stages


def chunk_of(stage: int, stages: int) -> int:
    """Which of its rank's chunks `stage` is (either placement: the c-th group of p stages)."""
    return stage // stages


def waits_for(op: str, k: int, stage: int, last: int) -> tuple[str, int, int] | None:
    """What an action on `stage` waits for: F k the forward of k on the stage before (none on the first); B or I
    the input gradient of k from the stage after (the last stage: its own F k); W its own I, earlier on the rank.
    Keys: ("F", k, stage) a forward done, ("G", k, stage) an input gradient done."""
    if op == "F":
        return None if stage == 0 else ("F", k, stage - 1)
    if op == "W":
        return ("G", k, stage)
    return ("F", k, stage) if stage == last else ("G", k, stage + 1)


def ready_key(op: str, k: int, stage: int) -> tuple[str, int, int] | None:
    """The key an action makes ready for others (a weight gradient: none)."""
    return None if op == "W" else ("F" if op == "F" else "G", k, stage)


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


def zb_h1(p: int, m: int, r: int, v: int) -> list[Action]:
    """1F1B with the backward split: rank r holds back r weight gradients through the steady phase, and in the
    cool-down does one held W after each I (filling the wait for the next), the rest at the end."""
    warmup = min(p - r - 1, m)
    actions = [Action("F", k) for k in range(warmup)]
    held: list[int] = []
    for k in range(m - warmup):
        actions += [Action("F", warmup + k), Action("I", k)]
        held.append(k)
        if len(held) > r:
            actions.append(Action("W", held.pop(0)))
    for k in range(m - warmup, m):
        actions.append(Action("I", k))
        held.append(k)
        actions.append(Action("W", held.pop(0)))
    return actions + [Action("W", k) for k in held]


Times = tuple[float, float, float]  # one chunk action's T_F, T_B (input gradient), T_W
EQUAL: Times = (1.0, 1.0, 1.0)


def _list_schedule(
    p: int, m: int, times: Times, first: str, spare: bool
) -> tuple[float, tuple[tuple[Action, ...], ...]] | None:
    """(the step's length, every rank's order), or None if it gets stuck: a list scheduler over V placement with
    these action times. Whenever a rank is free it starts the first ready of its kinds in the order `first`
    ("FIW" or "IFW"): a forward (chunk 1 before chunk 0, while fewer than 2p chunks are between their F and W on
    the rank; with `spare`, chunk 0 leaves the last place to chunk 1, whose forwards its I's may wait on), the
    oldest ready input gradient, the oldest weight gradient; with none ready it waits for the next action to end.
    Ranks free at the same moment choose in rank order, each seeing only what ended by then."""
    return _ListScheduler(p, m, times, first, spare).run()


class _ListScheduler:
    """_list_schedule's state: what each rank has started, holds and awaits, and when each action ended."""

    def __init__(self, p: int, m: int, times: Times, first: str, spare: bool):
        self.p, self.m, self.first, self.spare = p, m, first, spare
        self.cap, self.last, self.total = 2 * p, 2 * p - 1, 3 * 2 * m
        self.took = dict(zip("FIW", times, strict=True))
        self.finished: dict[tuple[str, int, int], float] = {}  # (F or G, micro-batch, stage) -> when it ended
        self.next_forward = [[0, 0] for _ in range(p)]
        self.awaiting_i: list[list[tuple[int, int]]] = [[] for _ in range(p)]
        self.awaiting_w: list[list[tuple[int, int]]] = [[] for _ in range(p)]
        self.held, self.free = [0] * p, [0.0] * p
        self.orders: list[list[Action]] = [[] for _ in range(p)]

    def ready(self, need: tuple[str, int, int] | None, t: float) -> bool:
        return need is None or self.finished.get(need, float("inf")) <= t

    def choose(self, r: int, t: float) -> Action | None:
        p, m = self.p, self.m
        for op in self.first:
            if op == "F" and self.held[r] < self.cap:
                for c in (1, 0):
                    k = self.next_forward[r][c]
                    if self.spare and c == 0 and self.held[r] == self.cap - 1:
                        continue
                    if k < m and self.ready(waits_for("F", k, stage_of(r, c, p, "V"), self.last), t):
                        return Action("F", k, c)
            if op == "I":
                for c, k in self.awaiting_i[r]:
                    if self.ready(waits_for("I", k, stage_of(r, c, p, "V"), self.last), t):
                        return Action("I", k, c)
            if op == "W" and self.awaiting_w[r]:
                c, k = self.awaiting_w[r][0]
                return Action("W", k, c)
        return None

    def start(self, r: int, a: Action, t: float) -> None:
        c, k = a.chunk, a.microbatch
        if a.op == "F":
            self.next_forward[r][c] += 1
            self.held[r] += 1
            self.awaiting_i[r].append((c, k))
        elif a.op == "I":
            self.awaiting_i[r].remove((c, k))
            self.awaiting_w[r].append((c, k))
        else:
            self.awaiting_w[r].pop(0)
            self.held[r] -= 1
        self.free[r] = t + self.took[a.op]
        key = ready_key(a.op, k, stage_of(r, c, self.p, "V"))
        if key is not None:
            self.finished[key] = self.free[r]
        self.orders[r].append(a)

    def run(self) -> tuple[float, tuple[tuple[Action, ...], ...]] | None:
        orders, free = self.orders, self.free
        while any(len(o) < self.total for o in orders):
            t = min(free[r] for r in range(self.p) if len(orders[r]) < self.total)
            waiting, started = [], False
            for r in range(self.p):
                if len(orders[r]) == self.total or free[r] > t:
                    continue
                a = self.choose(r, t)
                if a is None:
                    waiting.append(r)
                    continue
                self.start(r, a, t)
                started = True
            if not started:  # every rank free now waits: until the next action ends
                later = min((x for x in (*self.finished.values(), *free) if x > t), default=None)
                if later is None:  # every rank waits on another: this rule deadlocks at these times
                    return None
                for r in waiting:
                    free[r] = later
        return max(free), tuple(tuple(o) for o in orders)


@cache
def _zbv_orders(p: int, m: int, times: Times = EQUAL) -> tuple[tuple[Action, ...], ...]:
    """Every rank's ZB-V order, made for these times: the list scheduler's, forwards first or input gradients
    first, with or without a place kept for chunk 1, whichever step is shortest of those that finish (the first
    on a tie: at equal times forwards first, no place kept, idling (p-1) T_F)."""
    made = [
        found
        for spare in (False, True)
        for first in ("FIW", "IFW")
        if (found := _list_schedule(p, m, times, first, spare)) is not None
    ]
    if not made:
        raise RuntimeError(f"ZB-V's list scheduler deadlocks at pp={p}, {m} micro-batches, times {times}")
    return min(made, key=lambda found: found[0])[1]


def zbv(p: int, m: int, r: int, v: int, times: Times = EQUAL) -> list[Action]:
    return list(_zbv_orders(p, m, times)[r])


def dualpipev(p: int, m: int, r: int, v: int) -> list[Action]:
    """DeepSeek's DualPipeV order on V placement (chunk 0 is stage r, chunk 1 stage 2p - 1 - r), run one action at
    a time: forwards of chunk 0 (2 (p - r - 1)), then pairs F0 F1 (r + 1); I1 W F1 (p - r - 1: the weight
    gradient at once); the steady phase F0 B1 F1 B0 (m - 2p + r + 1 times; DualPipe overlaps each F with the B
    beside it); B1 F1 B0 (p - r - 1); B1 B0 (r + 1), the later half as I; I0 after a held W (p - r - 1); the
    held weight gradients, oldest first. The split halves let the tail's W fill the wait for input gradients."""
    actions: list[Action] = []
    forwards, backwards = [0, 0], [0, 0]
    held: list[tuple[int, int]] = []  # (chunk, micro-batch) of each I whose W is still to come

    def forward(c: int) -> None:
        actions.append(Action("F", forwards[c], c))
        forwards[c] += 1

    def backward(c: int, split: bool = False) -> None:
        actions.append(Action("I" if split else "B", backwards[c], c))
        if split:
            held.append((c, backwards[c]))
        backwards[c] += 1

    def weights() -> None:
        c, k = held.pop(0)
        actions.append(Action("W", k, c))

    for _ in range(2 * (p - r - 1)):
        forward(0)
    for _ in range(r + 1):
        forward(0)
        forward(1)
    for _ in range(p - r - 1):
        backward(1, split=True)
        weights()
        forward(1)
    for _ in range(m - 2 * p + r + 1):
        forward(0)
        backward(1)
        forward(1)
        backward(0)
    for _ in range(p - r - 1):
        backward(1)
        forward(1)
        backward(0)
    half = (r + 1) // 2  # from here on, both chunks' backwards are split (chunk 1's one later on even ranks)
    for i in range(r + 1):
        backward(1, split=i > half or (i == half and r % 2 == 1))
        backward(0, split=i >= half)
    for _ in range(p - r - 1):
        weights()
        backward(0, split=True)
    while held:
        weights()
    return actions


Formula = Callable[[int, int, int, float, float, float], float]  # (p, m, v, T_F, T_B, T_W) -> idle a rank
Bound = Callable[[int, int, int, int], int]  # (p, m, v, rank) -> the most (micro-batch, chunk)s held at once


@dataclass(frozen=True)
class PipelineSchedule:
    name: str
    order: Callable[[int, int, int, int], list[Action]]  # (p, m, rank, v) -> that rank's actions
    idle: Formula  # a rank's idle time in a step
    idle_text: str  # the formula, as printed
    chunked: bool = False  # takes v >= 2 model chunks per rank (the others take exactly 1)
    placement: str = "loop"
    split: bool = False  # runs the backward as I and W
    min_microbatches: Callable[[int], int] = lambda p: 1  # noqa: E731
    # a rank's activation bound: chunk activations from F to B or I (the most the rank's order holds at once)...
    held: Bound = lambda p, m, v, r: min(p - r, m)  # noqa: E731
    # ... and weight-gradient stashes from I to W (split schedules)
    stashes: Bound = lambda p, m, v, r: 0  # noqa: E731
    # the order made for given action times, (p, m, rank, v, times) -> actions: NAME:T_F,T_B,T_W (NAME: equal)
    timed: Callable[[int, int, int, int, Times], list[Action]] | None = None

    def formula_holds(self, tf: float, tb: float, tw: float) -> bool:
        """Whether the idle formula is this schedule's at these times (some hold only at equal times)."""
        return "at T_F = T_B = T_W" not in self.idle_text or tf == tb == tw

    def check(self, stages: int, microbatches: int, chunks: int) -> None:
        """ValueError naming the flag, if this schedule cannot run these sizes."""
        if chunks < 1:
            raise ValueError(f"--chunks must be >= 1, got {chunks}")
        if not self.chunked and chunks != 1:
            raise ValueError(
                f"--chunks {chunks}: pipeline schedule {self.name} runs one model chunk per rank; "
                f"{', '.join(n for n, s in SCHEDULES.items() if s.chunked)} take several"
            )
        if self.chunked and chunks > 1 and stages == 1:  # a rank would wait on sends to itself it has yet to take
            raise ValueError(
                f"--chunks {chunks} on one pipeline stage: there is no bubble to shrink; use --chunks 1 or more ranks"
            )
        if self.placement == "V" and chunks != 2:
            raise ValueError(f"--chunks {chunks}: pipeline schedule {self.name} places 2 chunks a rank in a V")
        if self.name == "interleaved-1f1b" and microbatches % stages:
            raise ValueError(
                f"interleaved-1f1b sends micro-batches round the ranks in groups of pp={stages}: "
                f"--microbatches {microbatches} must be a multiple of {stages}"
            )
        least = self.min_microbatches(stages)
        if microbatches < least:
            raise ValueError(
                f"pipeline schedule {self.name} fills its bubble with at least {least} micro-batches "
                f"on pp={stages}: --microbatches {microbatches} is too few"
            )


def _whole(p: int, m: int, v: int, tf: float, tb: float, tw: float) -> float:
    return (p - 1) * (tf + tb + tw)


SCHEDULES: dict[str, PipelineSchedule] = {
    s.name: s
    for s in (
        PipelineSchedule("gpipe", gpipe, _whole, "(p-1)(T_F+T_B+T_W)", held=lambda p, m, v, r: m),
        PipelineSchedule("1f1b", one_f_one_b, _whole, "(p-1)(T_F+T_B+T_W)"),
        PipelineSchedule(
            "interleaved-1f1b",
            interleaved_1f1b,
            _whole,
            "(p-1)(T_F+T_B+T_W), times of one chunk",
            chunked=True,
            held=lambda p, m, v, r: min(2 * (p - r - 1) + (v - 1) * p + 1, v * m),
        ),
        PipelineSchedule(
            "zb-h1",
            zb_h1,
            lambda p, m, v, tf, tb, tw: (p - 1) * (tf + tb - tw),
            "(p-1)(T_F+T_B-T_W)",
            split=True,
            min_microbatches=lambda p: p,
            stashes=lambda p, m, v, r: r + 1,
        ),
        PipelineSchedule(
            "zbv",
            zbv,
            lambda p, m, v, tf, tb, tw: (p - 1) * tf,
            "(p-1) T_F at T_F = T_B = T_W, times of one chunk",
            chunked=True,
            placement="V",
            split=True,
            min_microbatches=lambda p: 2 * p,
            held=lambda p, m, v, r: 2 * p,
            stashes=lambda p, m, v, r: 2 * p,
            timed=zbv,
        ),  # its list scheduler's cap: 2p from F to W
        PipelineSchedule(
            "dualpipev",
            dualpipev,
            lambda p, m, v, tf, tb, tw: (p - 1) * (tf + tb - tw),
            "(p-1)(T_F+T_B-T_W) at T_F = T_B = T_W, times of one chunk",
            chunked=True,
            placement="V",
            split=True,
            min_microbatches=lambda p: 2 * p,
            held=lambda p, m, v, r: 2 * p + 1,
            stashes=lambda p, m, v, r: r + 1,
        ),
    )
}


def schedule_named(kind: str) -> PipelineSchedule:
    """A registered schedule by name; `zbv:T_F,T_B,T_W` is ZB-V's order made for those times of one chunk
    action (the ratios matter: the bubble line prints a run's)."""
    name, colon, at = kind.partition(":")
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; one of {', '.join(SCHEDULES)}")
    if not colon:
        return SCHEDULES[name]
    if not SCHEDULES[name].timed:
        raise ValueError(
            f"pipeline schedule {name}'s order is the same at any times: {kind!r} takes no "
            f"':T_F,T_B,T_W' (only {', '.join(n for n, s in SCHEDULES.items() if s.timed)} does)"
        )
    try:
        times = tuple(float(t) for t in at.split(","))
        if len(times) != 3 or not all(0 < t < float("inf") for t in times):
            raise ValueError
    except ValueError:
        raise ValueError(
            f"pipeline schedule {kind!r}: after {name}: three times > 0, T_F,T_B,T_W (e.g. {name}:1,1.5,0.7)"
        ) from None
    return _made_for(name, times)  # type: ignore[arg-type]


@cache
def _made_for(name: str, times: Times) -> PipelineSchedule:
    timed = SCHEDULES[name].timed
    assert timed is not None
    exact = ",".join(str(int(t)) if t.is_integer() else repr(t) for t in times)  # shortest, read back the same
    return replace(SCHEDULES[name], name=f"{name}:{exact}", order=lambda p, m, r, v: timed(p, m, r, v, times))


def order(kind: str, stages: int, microbatches: int, stage: int, chunks: int = 1) -> list[Action]:
    """Rank `stage`'s actions, in order."""
    schedule = schedule_named(kind)
    schedule.check(stages, microbatches, chunks)
    return schedule.order(stages, microbatches, stage, chunks)


def ideal_bubble(kind: str, stages: int, microbatches: int, chunks: int = 1) -> float:
    """The schedule's idle share of a step at T_F = T_B = T_W: idle / (idle + 3 v m)."""
    p, m, v = stages, microbatches, chunks
    idle = schedule_named(kind).idle(p, m, v, 1.0, 1.0, 1.0)
    return idle / (idle + 3 * v * m)
