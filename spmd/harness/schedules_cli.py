"""python -m spmd schedules: every registered pipeline schedule side by side at one size, simulated.

Per schedule: its placement, the activations each rank holds at most (in stages' worth: v chunks of 1/v each
make one) and, for a split schedule, the weight-gradient stashes it holds at most (a micro-batch's chunk each,
from its I to its W), its idle formula, and the bubble (idle share of the step) from the formula and from its
order simulated, at the times given (one chunk action's T_F, T_B, T_W; a whole backward takes T_B + T_W). At
unequal times a schedule whose order is made for given times (zbv) has a second row: its order made for these.
"""

from __future__ import annotations

from spmd.parallel.pipeline_sim import in_flight, stashed, timeline
from spmd.parallel.schedules import SCHEDULES, schedule_named
from spmd.usage import Parser, say


def rows(p: int, m: int, times: tuple[float, float, float]) -> list[list[str]]:
    table = [
        [
            "schedule",
            "chunks",
            "placement",
            "activations a rank (stages)",
            "stashes a rank (stages)",
            "idle a rank",
            "bubble, formula",
            "bubble, simulated",
        ]
    ]
    made = [
        f"{name}:{','.join(f'{t:g}' for t in times)}"
        for name, s in SCHEDULES.items()
        if s.timed is not None and len(set(times)) > 1 and min(times) > 0
    ]  # made for unequal times too
    for name in [*SCHEDULES, *made]:
        sched = schedule_named(name)
        v = 2 if sched.chunked else 1
        try:
            sched.check(p, m, v)
        except ValueError as refused:
            table.append([name, str(v), sched.placement, "-", "-", sched.idle_text, "-", f"refused: {refused}"])
            continue
        held = ",".join(f"{in_flight(name, p, m, r, v) / v:g}" for r in range(p))
        stashes = ",".join(f"{stashed(name, p, m, r, v) / v:g}" for r in range(p)) if sched.split else "-"
        idle = sched.idle(p, m, v, *times)
        # one chunk's times: the same model cut into v chunks a rank takes 1/v of a stage's time an action
        scaled = tuple(t / v for t in times)
        span, idles = timeline(name, p, m, v, *scaled)
        formula = sched.idle(p, m, v, *scaled) / (sched.idle(p, m, v, *scaled) + m * sum(times))
        table.append(
            [
                name,
                str(v),
                sched.placement,
                held,
                stashes,
                sched.idle_text.split(",")[0] + (f" = {idle:g}" if v == 1 else ""),
                f"{formula:.3f}" if sched.formula_holds(*times) else "-",
                f"{max(idles) / span:.3f}",
            ]
        )
    return table


def main(argv: list[str]) -> int:
    parser = Parser(prog="python -m spmd schedules", description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=4, help="pipeline stages (ranks), p (default 4)")
    parser.add_argument("--microbatches", type=int, default=8, help="micro-batches a step, m (default 8)")
    parser.add_argument(
        "--times",
        default="1,1,1",
        help="a stage's T_F,T_B,T_W: forward, input gradient, weight gradient (default 1,1,1)",
    )
    args = parser.parse_args(argv)
    try:
        times = tuple(float(t) for t in args.times.split(","))
        if len(times) != 3 or min(times) < 0:
            raise ValueError
    except ValueError:
        parser.error(f"--times takes three numbers >= 0, T_F,T_B,T_W; got {args.times!r}")
    if args.pp < 1 or args.microbatches < 1:
        parser.error("--pp and --microbatches must be >= 1")
    table = rows(args.pp, args.microbatches, times)  # type: ignore[arg-type]
    say(
        f"pp={args.pp}, {args.microbatches} micro-batches, a stage's T_F, T_B, T_W = {args.times}; bubble = idle "
        "share of the step"
    )
    for line in table:
        say("| " + " | ".join(line) + " |")
        if line is table[0]:
            say("|" + "---|" * len(line))
    return 0
