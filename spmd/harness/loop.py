"""The training loop: one for every entry point (`python -m spmd train`, the mlp-* commands, spmd.train,
spmd.train_mlp and the benchmarks, which run the commands).

A step reads its batch, runs the engine's step, checks the loss is finite (a NaN ends the run naming the step,
on every rank at once: the loss is the same on all), evaluates when due and tells its watchers. What a command
adds (memory and time measured, progress lines, checkpoints, an injected fault) are watchers: small objects
called before and after each step and around each evaluation, in the order given.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from spmd.parallel.engine import ComposedRank


class NonFiniteError(ArithmeticError):
    """A loss or parameter became NaN or infinite; the message says at which step, rank and layer first."""


def check_finite(engine: ComposedRank, loss: float, step: int, rank: int, final: bool = False) -> None:
    """Raise NonFiniteError if the step's loss (or, when `final`, any parameter this rank holds) is not finite.

    Every rank sees the same total loss, so a bad loss fails every rank at the same step (no rank waits).
    The parameters are scanned only when the loss is bad or the run is over: the scan allocates, and the
    steps' peak memory must stay the model's.
    """
    if math.isfinite(loss) and not final:
        return
    bad = [layer for layer, _, values in engine.owned() if not np.isfinite(values).all()]
    if math.isfinite(loss) and not bad:
        return
    where = (
        f"; rank {rank}'s parameters of layer {bad[0]} are the first non-finite ones after the update" if bad else ""
    )
    raise NonFiniteError(f"step {step}: the loss is {loss}{where} (is --lr or --momentum too large, or not a number?)")


def perplexity(loss: float) -> float:
    """exp(min(20, loss)) (Megatron's: a diverged loss does not overflow)."""
    return math.exp(min(20.0, loss))


def due(step: int, every: int, steps: int) -> bool:
    """Whether something done every `every` steps and after the last (an evaluation, a progress line, a
    checkpoint) is due after step `step` (1-based) of `steps`; never when `every` is 0."""
    return every > 0 and (step % every == 0 or step == steps)


@dataclass(frozen=True)
class Evaluations:
    """The validation batches and when to read them: every `every` steps and after the last. `bits_a_nat` turns
    the mean loss (nats a token) into bits a byte: targets / (their UTF-8 bytes x ln 2)."""

    batches: list
    every: int
    bits_a_nat: float = math.nan

    def due(self, step: int, steps: int) -> bool:
        return bool(self.batches) and due(step, self.every, steps)

    def run(self, engine: ComposedRank, step: int) -> dict:
        loss = float(np.mean([engine.evaluate(ids, targets) for ids, targets in self.batches]))
        return {"step": step, "loss": loss, "bits_per_byte": loss * self.bits_a_nat, "perplexity": perplexity(loss)}


def evaluations(corpus, tokens: int, every: int) -> Evaluations | None:
    """A corpus's validation batches of at least `tokens` targets, read every `every` steps (None: no evaluation)."""
    if corpus is None or not every:
        return None
    batches = corpus.eval_batches(tokens)
    targets = sum(len(target) for _, target in batches)
    return Evaluations(batches, every, targets / (max(corpus.eval_bytes(batches), 1) * math.log(2)))


class Watcher:
    """What a command adds to the loop; every method does nothing unless overridden."""

    def before_step(self, step: int) -> None:
        """`step` (0-based) is about to run, its batch read."""

    def after_step(self, step: int, loss: float, seconds: float) -> None:
        """Step `step` (1-based now: the steps done) took `seconds` and gave `loss`, found finite."""

    def before_eval(self) -> None: ...

    def after_eval(self, evaluation: dict) -> None: ...

    def end_of_step(self, step: int) -> None:
        """After the step's evaluation, if any (a checkpoint holds what the step left)."""


@dataclass
class History:
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)  # nan where the engine computes none (no clipping)
    seconds: list[float] = field(default_factory=list)
    validation: list[dict] = field(default_factory=list)


def train_loop(
    engine: ComposedRank,
    batch: Callable[[int], tuple],
    steps: int,
    first: int = 0,
    evals: Evaluations | None = None,
    watchers: Sequence[Watcher] = (),
) -> History:
    """Steps first ... steps - 1 of `engine` on batch(step)'s (inputs, targets)."""
    done, rank = History(), engine.world.rank
    for step in range(first, steps):
        x, target = batch(step)
        for w in watchers:
            w.before_step(step)
        started = time.perf_counter()
        with np.errstate(over="ignore", invalid="ignore"):  # check_finite names the step instead
            loss = engine.step(x, target)
        seconds = time.perf_counter() - started
        check_finite(engine, loss, step + 1, rank)
        done.losses.append(loss)
        done.seconds.append(seconds)
        done.grad_norms.append(engine.state.grad_norm)
        for w in watchers:
            w.after_step(step + 1, loss, seconds)
        if evals is not None and evals.due(step + 1, steps):
            for w in watchers:
                w.before_eval()
            done.validation.append(evals.run(engine, step + 1))
            for w in watchers:
                w.after_eval(done.validation[-1])
        for w in watchers:
            w.end_of_step(step + 1)
    return done
