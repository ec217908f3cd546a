"""Zero-bubble pipelines on the engine: the split backward changes when weight gradients are computed, never
what they are; V placement keeps the first and the last stage (and a tied embedding) on rank 0."""

import contextlib
import io
import json
import subprocess
import sys

import numpy as np
import pytest

import spmd
from spmd.model.config import Net
from spmd.model.weight_grads import WeightGrads, replay
from spmd.observe.pipeline_table import main as pipeline_table
from spmd.parallel.cost import cost
from spmd.parallel.dims import Dims
from spmd.parallel.layout import Layout
from spmd.parallel.schedules import order, rank_of, stage_of
from spmd.transport.mesh import Mesh


def small(model: str) -> dict:
    sizes = dict(model=model, layers=4, hidden=8, ffn=16, batch=9, steps=2, microbatches=4)
    if model == "mlp":
        return {**sizes, "seq": 1}
    return {**sizes, "heads": 2, "seq": 4, **({"vocab": 13} if model == "llama" else {})}


@pytest.mark.parametrize("model", ["mlp", "transformer", "llama"])
@pytest.mark.parametrize(
    "split, whole, chunks",
    [("zb-h1", "1f1b", 1), ("zbv", "interleaved-1f1b", 2), ("zbv:1,2.5,0.5", "interleaved-1f1b", 2)],
)
def test_a_split_backward_trains_bitwise_like_the_whole_one(model, split, whole, chunks):
    """The same gradients in the same order of micro-batches: losses and every parameter bitwise equal."""
    runs = [
        spmd.train(mesh="pp=2,dp=2" if model == "mlp" else "pp=2,tp=2", pipeline=kind, chunks=chunks, **small(model))
        for kind in (split, whole)
    ]
    assert runs[0].losses == runs[1].losses
    for a, b in zip(runs[0].units, runs[1].units, strict=True):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("model", ["mlp", "transformer", "llama"])
def test_dualpipev_mixing_whole_and_split_backwards_trains_like_interleaved(model):
    """DualPipeV runs some backwards whole (B) and some split (I, then W later): the same losses and parameters
    as interleaved 1F1B, up to the order micro-batches' gradients are summed in."""
    runs = [
        spmd.train(mesh="pp=2,dp=2" if model == "mlp" else "pp=2,tp=2", pipeline=kind, chunks=2, **small(model))
        for kind in ("dualpipev", "interleaved-1f1b")
    ]
    assert {a.op for r in range(2) for a in order("dualpipev", 2, 4, r, 2)} == {"F", "B", "I", "W"}
    np.testing.assert_allclose(runs[0].losses, runs[1].losses, rtol=1e-12)
    for a, b in zip(runs[0].units, runs[1].units, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-14)


def test_v_placement_puts_the_first_and_last_stage_on_rank_0():
    assert [stage_of(r, c, 4, "V") for r in range(4) for c in (0, 1)] == [0, 7, 1, 6, 2, 5, 3, 4]
    assert [rank_of(s, 4, "V") for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [rank_of(s, 4) for s in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]


@pytest.mark.parametrize(
    "pipeline, chunks, exchanged", [("zbv", 2, False), ("interleaved-1f1b", 2, True), ("1f1b", 1, True)]
)
def test_a_tied_embedding_is_exchanged_over_pp_only_when_its_copies_are_on_two_ranks(pipeline, chunks, exchanged):
    """Under V placement rank 0 holds both copies: tying adds no pp bytes; elsewhere the gradient goes both ways."""
    mesh = Mesh({"pp": 2})
    layout = Layout(Dims(mesh), schedule=pipeline)
    fields = dict(
        model="llama", layers=4, hidden=8, ffn=16, heads=2, seq=4, batch=8, vocab=13, microbatches=4, chunks=chunks
    )
    tied, untied = (cost(Net(**fields, tie_embeddings=tie), layout).traffic for tie in (True, False))
    table = 13 * 8 * 8  # vocab x hidden, float64
    assert [t.sent["pp"] - u.sent["pp"] for t, u in zip(tied, untied, strict=True)] == (
        [table, table] if exchanged else [0, 0]
    )


def test_deferred_weight_gradients_replay_to_the_same_bits_wherever_the_gradient_is_by_then():
    rng = np.random.default_rng(0)
    a, d1, d2 = rng.standard_normal((5, 3)), rng.standard_normal((5, 4)), rng.standard_normal((5, 2))
    gain = rng.standard_normal(3)
    now = np.zeros(3 * 4 + 3 * 2 + 3)
    views = lambda g: (g[:12].reshape(3, 4), g[12:18].reshape(3, 2), g[18:])  # noqa: E731
    w1, w2, g = views(now)
    immediate = WeightGrads()
    immediate.products(a, (d1, w1), (d2, w2))
    immediate.value(g)[...] = gain
    deferring, stash = WeightGrads(), (np.zeros(15 + 20 + 10), np.zeros(3))
    placeholder = np.zeros_like(now)  # where the gradient is during I: not written
    deferring.defer(stash, placeholder)
    w1, w2, g = views(placeholder)
    deferring.products(a, (d1, w1), (d2, w2))
    deferring.value(g)[...] = gain
    records, used = deferring.finish()
    a[...], d1[...] = 0, 0  # the operands' buffers are reused before W runs
    later = np.zeros_like(now)
    replay(records, later)
    assert used == (45, 3) and np.array_equal(later, now) and not placeholder.any()
    with pytest.raises(RuntimeError, match="stash holds 45 elements, 60 needed"):
        deferring.defer(stash, placeholder, used)
        deferring.products(a, (d1, w1))


def test_zb_h1_holds_1f1b_activations_and_r_plus_1_stashes_on_rank_r():
    """The activations are free again after the I; each deferred W keeps one stash, rank r at most r + 1."""
    fields = dict(model="llama", layers=4, hidden=8, ffn=16, heads=2, seq=4, batch=8, vocab=13, microbatches=8)
    held = {
        kind: [m["activations"] for m in cost(Net(**fields), Layout(Dims(Mesh({"pp": 4})), schedule=kind)).memory]
        for kind in ("1f1b", "zb-h1")
    }
    more = [z - o for z, o in zip(held["zb-h1"], held["1f1b"], strict=True)]
    assert more[0] > 0 and more[:3] == [(r + 1) * more[0] for r in range(3)]
    assert more[3] % 4 == 0 and more[3] // 4 > more[0]  # the last stage's stash keeps the LM head's operands too


def test_the_pipeline_table_shows_each_runs_activations_and_bubbles(tmp_path):
    reports = []
    for pipeline in ("1f1b", "zb-h1"):
        out = tmp_path / f"{pipeline}.json"
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "spmd",
                "train",
                "--model",
                "llama",
                "--mesh",
                "pp=2",
                "--devices",
                "2",
                "--pipeline",
                pipeline,
                "--microbatches",
                "4",
                "--steps",
                "1",
                "--quiet",
                "--json",
                str(out),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert run.returncode == 0, run.stderr
        reports.append(json.loads(out.read_text().splitlines()[-1]))
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        pipeline_table([str(tmp_path / "1f1b.json"), str(tmp_path / "zb-h1.json")])
    rows = printed.getvalue().splitlines()[2:]
    for line, report in zip(rows, reports, strict=True):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[1] == ", ".join(f"{m['activations'] / 2**20:.2f}" for m in report["memory"])
        assert cells[2] == "yes" and cells[3] == f"{report['bubble_model']:.3f}"
    assert rows[0].startswith("| 1f1b |") and rows[1].startswith("| zb-h1 |")


@pytest.mark.parametrize("pipeline", ["zb-h1", "dualpipev"])
def test_a_mixture_of_experts_in_mixed_precision_defers_its_weight_gradients(pipeline):
    """The router's gradient (fp32 operands beside bf16 ones) is made in the I and copied in by the W: the split
    run's losses are the whole backward's (1F1B / interleaved) within mixed precision's rounding (V and loop
    placement sum a step's rows in other groupings: 1e-5 apart in bf16, bitwise equal in float64)."""
    fields = dict(small("llama"), experts=4, top_k=2, precision="bf16", chunks=2 if pipeline == "dualpipev" else 1)
    whole = "1f1b" if pipeline == "zb-h1" else "interleaved-1f1b"
    runs = [spmd.train(mesh="pp=2", pipeline=kind, **fields) for kind in (pipeline, whole)]
    assert all(np.isfinite(runs[0].losses))
    np.testing.assert_allclose(runs[0].losses, runs[1].losses, rtol=1e-4)
