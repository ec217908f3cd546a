"""Model flops utilization of a training run: the model's flops per token times the tokens a second, over what
this machine's cores can do, measured.

The flops per token follow PaLM's (and nanoGPT's) convention, 6 N + 12 L H Q T: N the parameters that multiply
(the input embedding, a lookup, left out), the attention scores and their use 12 L H Q T (not halved for the
causal mask). The machine's rate is numpy's GEMM on one core at a block's shapes (forward and backward), times
the cores: measured once before the run, with BLAS on one thread, by rank 0 while every other rank waits asleep
(ranks polling on a shared core halved the rate, and so doubled the MFU, when ranks outnumber the cores).
"""

from __future__ import annotations

import time

import numpy as np

from spmd.collectives import alone_at_root
from spmd.model.blocks import EMBED_KIND
from spmd.model.registry import full_sizes, spec_of
from spmd.transport.cores import available_cores, blas_threads
from spmd.transport.group import Group


def flops_per_token(net) -> int:
    """6 N + 12 L H Q T (PaLM's convention) of a run's model; N without an input embedding."""
    spec, sizes = spec_of(net), full_sizes(net)
    multiplying = sum(size for size, kind in zip(sizes, spec.kinds(net), strict=True) if kind != EMBED_KIND)
    attention = 12 * net.layers * net.hidden * net.seq if spec.has_attention else 0
    return 6 * multiplying + attention


def gemm_rate(tokens: int, hidden: int, ffn: int, dtype: str, reps: int = 5) -> float:
    """FLOP/s of numpy's matmuls at one layer's forward and backward shapes on the cores it is given: after a
    pass that wakes BLAS, the median of `reps`."""
    rng = np.random.default_rng(0)
    t, h, f = tokens, hidden, ffn
    x, w1, w2 = (rng.standard_normal(s).astype(dtype) for s in ((t, h), (h, f), (f, h)))
    a, dy = rng.standard_normal((t, f)).astype(dtype), rng.standard_normal((t, h)).astype(dtype)
    work = [(x, w1), (a, w2), (a.T, dy), (dy, w2.T), (x.T, a), (a, w1.T)]  # forward 2, backward 4
    flops = sum(2 * p.shape[0] * p.shape[1] * q.shape[1] for p, q in work)
    times = []
    for _ in range(reps + 1):
        start = time.perf_counter()
        for p, q in work:
            p @ q
        times.append(time.perf_counter() - start)
    return flops / float(np.median(times[1:]))


def machine_rate(world: Group, net) -> float | None:
    """At rank 0, this machine's cores times numpy's one-core GEMM rate at the model's block shapes, measured
    while the other ranks wait asleep (a collective: every rank calls it); None elsewhere."""
    compute = str(net.policy.compute)
    dtype = compute if compute in ("float32", "float64") else "float32"

    def one_core() -> float:
        with blas_threads(1):
            return gemm_rate(min(net.tokens, 4096), net.hidden, net.ffn, dtype)

    one = alone_at_root(world, one_core)
    return None if one is None else one * available_cores()
