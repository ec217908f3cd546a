"""A pipeline's bubble at the times a run measured: the schedule's formula and its order simulated, at the mean
T_F, T_B (input gradient; the whole backward for unsplit schedules) and T_W of one chunk action."""

from __future__ import annotations

import os
from collections import Counter

import numpy as np

from spmd.parallel.pipeline_sim import timeline
from spmd.parallel.schedules import schedule_named


def action_seconds(totals: Counter, counts: Counter, steps: int) -> list[float]:
    """[T_F, T_B, T_W]: a rank's mean seconds per chunk action, from its per-op totals over `steps` steps and its
    order's actions a step by op. A whole backward (B) counts as T_B + T_W, so a schedule mixing B with I and W
    (DualPipeV) gives T_W from its W's and T_B from the rest; without W's T_B is the whole backward's."""
    steps = max(steps, 1)
    per = lambda op: totals[op] / (counts[op] * steps) if counts[op] else 0.0  # noqa: E731
    tw = per("W")
    backwards = (counts["I"] + counts["B"]) * steps
    tb = (totals["I"] + totals["B"] - tw * counts["B"] * steps) / backwards if backwards else 0.0
    return [per("F"), tb, tw]


def bubble_at(kind: str, stages: int, microbatches: int, chunks: int, times: np.ndarray, ranks: int) -> dict:
    """The idle share the schedule's formula and its order predict at `times` (ranks x [T_F, T_B, T_W]: the mean
    over ranks is taken), and a note when the ranks outnumber the cores (a wait is then partly another's work)."""
    tf, tb, tw = (float(t) for t in np.mean(times, axis=0))
    p, m, v = stages, microbatches, chunks
    sched = schedule_named(kind)
    idle = sched.idle(p, m, v, tf, tb, tw)
    cores = os.cpu_count() or 1
    found = {
        "times": [tf, tb, tw],
        "formula": sched.idle_text,
        "formula_share": None
        if not sched.formula_holds(tf, tb, tw)  # (its formula is for equal times)
        else idle / (idle + v * m * (tf + tb + tw))
        if idle + tf + tb + tw > 0
        else 0.0,
        "simulated_share": simulated_share(kind, p, m, v, (tf, tb, tw)),
        "shared_cores": ranks > cores,
    }
    if sched.timed is not None and min(tf, tb, tw) > 0:  # its order made for these times instead, simulated
        made = f"{kind.partition(':')[0]}:{1e3 * tf:.3g},{1e3 * tb:.3g},{1e3 * tw:.3g}"
        try:
            found.update(made_for=made, made_for_share=simulated_share(made, p, m, v, (tf, tb, tw)))
        except RuntimeError:  # no order made for these times finishes: say nothing of one
            found.pop("made_for", None)
    return found


def simulated_share(kind: str, p: int, m: int, v: int, times: tuple[float, float, float]) -> float:
    span, idles = timeline(kind, p, m, v, *times)
    return float(np.mean(idles)) / span if span > 0 else 0.0


def bubble_line(measured: list[float], model: dict) -> str:
    tf, tb, tw = (1e3 * t for t in model["times"])
    note = "; ranks share cores, so a rank's wait is partly another's compute" if model["shared_cores"] else ""
    share = model["formula_share"]
    formula = f"gives {share:.2f}" if share is not None else "does not apply"
    return (
        "  bubble per stage, measured: "
        + " ".join(f"{v:.2f}" for v in measured)
        + f"; at this run's T_F, T_B, T_W = {tf:.2f}, {tb:.2f}, {tw:.2f} ms the schedule's idle "
        f"{model['formula']} {formula}, its order simulated {model['simulated_share']:.2f}"
        + (
            f" (made for these times, --pipeline {model['made_for']}: {model['made_for_share']:.2f})"
            if "made_for" in model
            else ""
        )
        + note
    )
