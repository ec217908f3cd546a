"""Long sequences against the published formulas: Korthikanti et al. 2022's activation memory per layer and
DeepSpeed-Ulysses' all-to-all volume, evaluated on this project's cost model in the papers' setting; and
ring attention's causal work per rank under the zigzag split.

The composition tests assert that what the ranks hold and send equals the cost model to the byte; these
tests assert where that cost model agrees with the papers and, where the models differ, the exact difference.
"""

from fractions import Fraction

import pytest

from spmd.model import Net
from spmd.model.attention import QUERY_BLOCK
from spmd.parallel.accounting import Tally
from spmd.parallel.context import core_named, token_chunks, work_table
from spmd.parallel.cost import context_traffic, saved_elements
from spmd.parallel.dims import Dims
from spmd.parallel.layout import Layout

ACTIVATION_BYTES = 2  # the paper's mixed precision: 16-bit activations (its dropout masks: 1 byte)


def korthikanti(s, b, h, a, t, sp, selective, full):
    """Bytes per layer, Korthikanti et al. 2022, Table 2 (field-notes B3)."""
    if full:
        return 2 * s * b * h
    attention = 0 if selective else Fraction(5 * a * s * s * b, t)
    if sp:
        return Fraction(34 * s * b * h, t) + attention
    return 10 * s * b * h + Fraction(24 * s * b * h, t) + attention


def spmd_layer_bytes(s, b, h, a, t, sp, recompute):
    """This project's cost model, per layer, at 2 bytes an element: the layer's input plus what it keeps."""
    net = Net(model="transformer", hidden=h, ffn=4 * h, heads=a, seq=s, batch=b, layers=2)
    layout = Layout(Dims.parse(f"tp={t}"), sp=sp, recompute=recompute)
    plan = layout.for_rank(net, 0)
    rows = plan.rows[0]
    kept = rows.local * h + (0 if recompute == "full" else saved_elements(net, layout, plan, rows))
    return ACTIVATION_BYTES * kept


def what_spmd_does_not_keep(s, b, h, a, t, sp, selective, full):
    """The exact difference, and why:
    - the two norms' outputs (the QKV and first-linear inputs, 2 sbh each): spmd's norms are a gain, recomputed
      from the kept input in backward (TP: replicated; SP: split);
    - the GeLU output (8 sbh, split by tp): spmd recomputes relu from the kept pre-activation;
    - the dropout masks (1 byte each: sbh after attention, sbh after the MLP; 1 as^2 b in attention) and the
      attention dropout's output (2 as^2 b): spmd has no dropout;
    - full recomputation: both keep the layer input only, but the paper's row keeps all of it (2 sbh), while
      under SP the input between the regions is this rank's tp block of the rows (2 sbh / t). spmd also holds
      one layer's working set while it recomputes, which the paper does not count."""
    if full:
        return 2 * s * b * h - Fraction(2 * s * b * h, t) if sp else 0
    outside = Fraction((2 * 2 + 2) * s * b * h, t if sp else 1)  # norm outputs + the two 1-byte masks
    gelu = Fraction(8 * s * b * h, t)
    attention = 0 if selective else Fraction(3 * a * s * s * b, t)
    above = 0 if selective else Fraction(2 * a * b * (s * s - causal_blocks(s)), t)  # P's whole masked blocks
    return outside + gelu + attention + above


def causal_blocks(s: int) -> int:
    """Elements of one head's P as spmd keeps it: each block of QUERY_BLOCK queries against the keys up to its
    last row, s (s + block) / 2 where the block divides s (the paper keeps all s^2)."""
    block = min(s, QUERY_BLOCK)
    assert s % block == 0
    return s * (s + block) // 2


SETTINGS = [
    (16, 2, 32, 4, t, sp, recompute)
    for t in (1, 2, 4)
    for sp in (False, True)
    for recompute in ("none", "selective", "full")
    if t > 1 or not sp
]


@pytest.mark.parametrize("s, b, h, a, t, sp, recompute", SETTINGS)
def test_activation_memory_per_layer_is_korthikantis_minus_what_spmd_recomputes_or_lacks(s, b, h, a, t, sp, recompute):
    selective, full = recompute == "selective", recompute == "full"
    ours = spmd_layer_bytes(s, b, h, a, t, sp, recompute)
    difference = what_spmd_does_not_keep(s, b, h, a, t, sp, selective, full)
    assert ours + difference == korthikanti(s, b, h, a, t, sp, selective, full)


def test_at_gpt3_scale_spmd_keeps_20_of_34_sbh_and_the_causal_blocks_of_2_of_5_as2b():
    """s 2048, h 12288, a 96 (the paper's GPT-3 175B): 5as/h = 80, so attention's s^2 term dominates; spmd
    keeps P's causal blocks only, 17/32 of s^2 at blocks of 128 queries."""
    s, b, h, a = 2048, 1, 12288, 96
    ours = spmd_layer_bytes(s, b, h, a, 1, False, "none")
    assert ours == 20 * s * b * h + 2 * a * causal_blocks(s) * b
    assert causal_blocks(s) * 32 == 17 * s * s
    assert korthikanti(s, b, h, a, 1, False, False, False) == s * b * h * (34 + 80)


def ulysses_bytes(cp, b, s, heads, d, itemsize):
    """Bytes a rank sends over cp in one layer's forward and backward (one micro-batch), from the cost model."""
    net = Net(
        model="transformer",
        hidden=heads * d,
        ffn=4 * heads * d,
        heads=heads,
        seq=s,
        batch=b,
        layers=2,
        dtype="float32" if itemsize == 4 else "float64",
    )
    layout = Layout(Dims.parse(f"cp={cp}"), cp=core_named("ulysses"))
    tally = Tally()
    plan = layout.for_rank(net, 0)
    context_traffic(tally, net, layout, plan, plan.rows[0], forwards=1, layers=1)
    return tally.sent["cp"], tally.received["cp"]


@pytest.mark.parametrize("cp, b, s, heads, d", [(2, 2, 16, 4, 8), (4, 1, 32, 8, 4), (8, 3, 64, 16, 2)])
def test_ulysses_sends_the_blogs_volume_times_p_minus_1_over_p(cp, b, s, heads, d):
    """DeepSpeed-Ulysses: per layer 4 all-to-alls forward (Q, K, V, O) of N h in all, "4Nh/P per link"; a rank
    keeps its own share, so it sends exactly 4 (p-1)/p b (S/p) h bytes (field-notes B6); backward as much."""
    itemsize, h = 4, heads * d
    sent, received = ulysses_bytes(cp, b, s, heads, d, itemsize)
    exact = 4 * Fraction(cp - 1, cp) * b * Fraction(s, cp) * h * itemsize
    blog = Fraction(4 * b * s * h * itemsize, cp)  # 4 N h / P, N = b S tokens
    assert sent == received == 2 * exact  # forward and backward
    assert exact == blog * Fraction(cp - 1, cp)


def test_ulysses_with_uneven_heads_sends_what_each_rank_owns():
    """5 heads over cp = 2 (3 and 2): every block is (rank q's tokens) x (rank r's heads), nothing to itself."""
    sent, received = ulysses_bytes(2, 1, 8, 5, 2, 8)
    # rank 0 holds tokens 0-3 and heads 0-2: it sends its tokens of heads 3-4 (4 x 4 values) in each of the
    # 4 to-heads all-to-alls, and the whole sequence's other tokens of its heads (4 x 6) in each of the 4 back
    assert sent == 4 * (4 * 4 * 8) + 4 * (4 * 6 * 8)
    assert received == 4 * (4 * 6 * 8) + 4 * (4 * 4 * 8)


@pytest.mark.parametrize("seq, cp", [(16, 2), (32, 4), (64, 8), (24, 3)])
def test_zigzag_gives_every_rank_the_same_causal_work(seq, cp):
    """2 cp - 1 whole (query, key) chunk pairs and 2 diagonal ones each; a contiguous split would give the last
    rank 2 cp - 1 times the first's scores."""
    assert len(set(work_table(seq, cp))) == 1
    assert work_table(seq, cp)[0][:2] == (2 * cp - 1, 2)
    contiguous = [(r + 1) * (seq // cp) ** 2 - (seq // cp) * (seq // cp - 1) // 2 for r in range(cp)]
    assert contiguous[-1] / contiguous[0] > cp  # what the zigzag avoids
    assert sum(c.size for held in token_chunks(seq, cp, core_named("ring")) for c in held) == seq


def test_ring_bytes_are_cp_minus_1_kv_blocks_each_way_and_cp_accumulators():
    """Per layer, even split: K and V (b s/cp h each) sent cp - 1 times in forward and again in backward,
    dK and dV cp times; received the same."""
    cp, b, s, h, itemsize = 4, 2, 32, 16, 8
    net = Net(model="transformer", hidden=h, ffn=4 * h, heads=4, seq=s, batch=b, layers=2)
    layout = Layout(Dims.parse(f"cp={cp}"), cp=core_named("ring"))
    tally = Tally()
    plan = layout.for_rank(net, 1)
    context_traffic(tally, net, layout, plan, plan.rows[0], forwards=1, layers=1)
    block = b * (s // cp) * h * itemsize
    assert tally.sent["cp"] == tally.received["cp"] == 2 * block * ((cp - 1) * 2 + cp)


def activations_per_rank(seq, mesh, cp="ring", recompute="none"):
    from spmd.parallel.strategy import Composition
    from spmd.transport.mesh import Mesh

    net = Net(model="transformer", layers=2, hidden=32, ffn=128, heads=4, seq=seq, batch=1)
    return max(
        m["activations"] for m in Composition(cp=core_named(cp), recompute=recompute).cost(net, Mesh.parse(mesh)).memory
    )


def test_ring_attention_keeps_no_sequence_squared_term_and_ulysses_splits_it_by_cp():
    """Doubling the sequence: ring's kept activations double exactly; one device's and Ulysses' grow by the s^2
    of P (Ulysses holds P for whole sequences but only its heads: a cp-th of one device's)."""
    for seq in (64, 128):
        assert activations_per_rank(2 * seq, "cp=4") == 2 * activations_per_rank(seq, "cp=4")
        one, ulysses = activations_per_rank(seq, "dp=1"), activations_per_rank(seq, "cp=4", "ulysses")
        linear_one = activations_per_rank(seq, "dp=1", recompute="selective")
        linear_ulysses = activations_per_rank(seq, "cp=4", "ulysses", "selective")
        assert (one - linear_one) == 4 * (ulysses - linear_ulysses) == 2 * 4 * seq * seq * 8  # layers heads s^2 8 B
        assert activations_per_rank(2 * seq, "dp=1") > 2 * one


def test_activation_memory_against_sequence_length_is_drawn_from_runs(tmp_path):
    import json
    import subprocess
    import sys

    reports = []
    for seq in (8, 16):
        path = tmp_path / f"ring{seq}.json"
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "spmd",
                "train",
                "--model",
                "transformer",
                "--mesh",
                "cp=2",
                "--cp",
                "ring",
                "--seq",
                str(seq),
                "--layers",
                "2",
                "--devices",
                "2",
                "--quiet",
                "--json",
                str(path),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        reports.append(json.loads(path.read_text().splitlines()[-1]))
    assert reports[1]["memory"][0]["activations"] == 2 * reports[0]["memory"][0]["activations"]
    out = tmp_path / "long.png"
    plot = subprocess.run(
        [
            sys.executable,
            "-m",
            "spmd.observe.plot",
            "--by-seq",
            *(str(tmp_path / f"ring{s}.json") for s in (8, 16)),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert plot.returncode == 0, plot.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
