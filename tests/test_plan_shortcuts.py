"""The planner's shortcuts (micro-batches of equal rows tallied once, units of one kind once, one pipeline's slots
simulated once) give the answers of the slow path that evaluates every micro-batch of every rank."""

import subprocess
import sys
from collections import Counter
from dataclasses import replace

import pytest

from spmd.model import Net
from spmd.parallel.cost import cost, microbatch_rows
from spmd.parallel.layout import Layout
from spmd.plan.cluster import Cluster
from spmd.plan.layouts import Choices, candidates, estimate_layout

# uneven everywhere: 13 sequences over the data axes, 3 micro-batches, a capacity over ep
NET = Net(
    model="llama",
    layers=4,
    hidden=16,
    ffn=24,
    heads=4,
    kv_heads=2,
    vocab=32,
    seq=9,
    batch=13,
    experts=4,
    top_k=2,
    capacity_factor=1.25,
    optimizer="adamw",
    precision="bf16",
)


def layouts(net: Net, devices: int):
    """Every layout the planner tries that runs, of the net with its capacity (no cp) and dropless (cp too)."""
    for mesh, composition, model in (
        case for n in (net, replace(net, capacity_factor=0.0)) for case in candidates(n, devices, 4, Choices(max_cp=2))
    ):
        layout = composition.layout(mesh)
        try:
            layout.check(model)
        except ValueError:
            continue
        yield model, layout, mesh, composition


def test_alike_micro_batches_are_every_micro_batch_counted_once(monkeypatch):
    """A rank's plan with one micro-batch of each alike run derived, and with every micro-batch derived: equal."""
    cases = [
        (model, layout, layout.for_rank(model, rank))
        for model, layout, *_ in layouts(NET, 8)
        for rank in range(layout.dims.mesh.size)
    ]
    monkeypatch.setattr(Layout, "alike_microbatches", lambda self, net, held: [(k, 1) for k in range(net.microbatches)])
    for model, layout, quick in cases:
        slow = layout.for_rank(model, quick.rank)
        assert (quick.rows, quick.group_pairs) == (slow.rows, slow.group_pairs), (layout.describe(), quick.rank)
        assert quick.largest_rows == slow.largest_rows, (layout.describe(), quick.rank)
        assert microbatch_rows(quick) == Counter(slow.rows), (layout.describe(), quick.rank)
    assert len(cases) > 100


def test_the_cost_of_every_rank_equals_the_cost_micro_batch_by_micro_batch(monkeypatch):
    """cost() with the shortcut, and with every micro-batch its own class (the slow path): equal, to the byte."""
    fast = [(layout, model, cost(model, layout)) for model, layout, *_ in layouts(NET, 8)]
    monkeypatch.setattr(Layout, "alike_microbatches", lambda self, net, held: [(k, 1) for k in range(net.microbatches)])
    for layout, model, quick in fast:
        slow = cost(model, layout)
        assert [dict(t.sent) for t in quick.traffic] == [dict(t.sent) for t in slow.traffic], layout.describe()
        assert [dict(t.received) for t in quick.traffic] == [dict(t.received) for t in slow.traffic]
        assert quick.memory == slow.memory and quick.flops == slow.flops, layout.describe()
    assert len(fast) > 20


def staged_layouts():
    """Layouts with pipeline stages alike and not: 1F1B, interleaved chunks (2 a rank) with a tied head, and ZB-V,
    whose V placement makes rank p - 1's chunks send less than the middle ranks' of the same kinds; with and
    without ep and cp."""
    tied = replace(NET, layers=8, chunks=2, tie_embeddings=True, capacity_factor=0.0)
    for net, pipeline in ((NET, "1f1b"), (tied, "interleaved-1f1b"), (tied, "zbv")):
        for mesh, composition, model in candidates(net, 8, 4, Choices(max_cp=2, pipeline=pipeline)):
            layout = composition.layout(mesh)
            try:
                layout.check(model)
            except ValueError:
                continue
            yield model, layout


def test_ranks_of_alike_stages_costed_once_equal_every_rank_costed():
    """cost(alike_stages=True), the planner's (a stage's micro-batch and gradient traffic and flops costed once for
    the ranks of one stage_signature), and cost() of every rank: equal, to the byte, on every axis and the world."""
    tried = 0
    for model, layout in staged_layouts():
        quick, slow = cost(model, layout, alike_stages=True), cost(model, layout)
        assert [dict(t.sent) for t in quick.traffic] == [dict(t.sent) for t in slow.traffic], layout.describe()
        assert [dict(t.received) for t in quick.traffic] == [dict(t.received) for t in slow.traffic]
        assert quick.memory == slow.memory and quick.flops == slow.flops, layout.describe()
        tried += layout.dims.size("pp") > 2
    assert tried > 10


def test_the_planners_estimates_equal_the_slow_paths(monkeypatch):
    cluster = Cluster(8, 1e9, 4, 1e9, 1e8, 1e12)
    cases = list(layouts(NET, 8))
    quick = [estimate_layout(model, mesh, composition, cluster) for model, _, mesh, composition in cases]
    monkeypatch.setattr(Layout, "alike_microbatches", lambda self, net, held: [(k, 1) for k in range(net.microbatches)])
    slow = [estimate_layout(model, mesh, composition, cluster) for model, _, mesh, composition in cases]
    assert quick == slow


@pytest.mark.parametrize(
    "args, words",
    [
        (["--model", "llama", "--preset", "debug", "--devices", "8", "--batch", "16", "--mesh", "pp=3"], "spans 3"),
        (["--model", "llama", "--preset", "grok-1", "--devices", "0", "--batch", "1"], "--devices must be >= 1"),
        (["--model", "mlp", "--preset", "debug", "--devices", "8"], "--preset debug is a --model llama"),
    ],
)
def test_the_planner_refuses_bad_input_in_one_line(args, words):
    done = subprocess.run([sys.executable, "-m", "spmd.plan", *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == "", done.stdout
    assert len(done.stderr.splitlines()) == 1 and words in done.stderr, done.stderr
