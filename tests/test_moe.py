"""The mixture of experts (--experts): its rules, its oracle, and every layout against one device.

The oracle (spmd.model.moe_reference) is checked against finite differences, the balancing loss included; the
parallel layer (spmd.model.moe) shares no code with it but the rules, written twice: the tie-break, the capacity
rule. Each layout case runs the generic composition check (test_composition.composed_run_matches): losses and
every parameter (experts and router) against one device in float64, bytes per mesh axis (the gates' gradients'
all-reduce over tp included) and memory by kind against the closed form, on threads and under mpiexec.
"""

from dataclasses import replace

import numpy as np
import pytest
from test_composition import composed_run_matches, net_for, peak_matches, train

from spmd.model import Net
from spmd.model import llama_reference as reference
from spmd.model.llama import initial_unit, is_moe, unit_kinds
from spmd.model.moe import capacity, choose, kept
from spmd.model.moe_reference import balance_loss, kept_pairs, top_choices
from spmd.model.registry import summary
from spmd.parallel.context import core_named
from spmd.parallel.strategy import Composition
from spmd.transport.mesh import Mesh
from spmd.transport.threads import run_threads

MOE = dict(experts=4, top_k=2)
BALANCED = dict(experts=4, top_k=2, aux_loss=0.05, capacity_factor=1.0, renormalize=True)

# (mesh, layout, net fields): each world size the tests run (threads 1-4, mpiexec 2, 3, 4), every axis, dropless and
# dropping with the balancing loss, both routers, SP and not, three schedules, recomputation, bias balancing.
CASES = [
    ("dp=1", {}, {**BALANCED, "microbatches": 2}),
    ("dp=1", {}, {"experts": 3, "top_k": 1, "router": "sigmoid"}),
    ("tp=2", {"sp": True}, BALANCED),
    ("tp=2", {"sp": False, "recompute": "selective"}, MOE),
    ("pp=2", {"pipeline": "1f1b"}, {**BALANCED, "microbatches": 2}),
    ("fsdp=2", {"zero": 3}, {**MOE, "router": "sigmoid"}),
    ("cp=2", {"cp": core_named("ring")}, {**MOE, "seq": 5, "heads": 5, "hidden": 10, "bias_balance": 0.05}),
    ("tp=3", {"sp": True}, {**BALANCED, "top_k": 3}),
    ("dp=3", {"recompute": "full"}, {**BALANCED, "batch": 7}),
    ("pp=2,tp=2", {"sp": True, "pipeline": "zb-h1"}, {**BALANCED, "microbatches": 2}),
    ("dp=2,fsdp=2", {"zero": 2}, {**BALANCED, "batch": 8, "bias_balance": 0.05}),
    ("fsdp=2,tp=2", {"sp": True, "zero": 3}, {**BALANCED, "router": "sigmoid"}),
    ("dp=2,tp=2", {"sp": False}, {**MOE, "capacity_factor": 1.25}),
    ("cp=2,tp=2", {"cp": core_named("ring")}, {**MOE, "seq": 5, "heads": 5, "hidden": 10}),
    ("pp=2,fsdp=2", {"pipeline": "zbv"}, {**MOE, "microbatches": 4, "chunks": 2, "batch": 9}),
    ("ep=2", {}, MOE),
    ("ep=2", {}, {**BALANCED, "microbatches": 2, "bias_balance": 0.05}),
    ("ep=3", {}, {**MOE, "experts": 6, "top_k": 3, "router": "sigmoid"}),
    ("ep=2,tp=2", {"sp": True}, BALANCED),
    ("fsdp=2,ep=2", {"zero": 3}, {**MOE, "expert_activation": "gelu"}),
    ("pp=2,ep=2", {"pipeline": "zb-h1"}, {**MOE, "microbatches": 2}),
    ("ep=2,cp=2", {"cp": core_named("ring")}, {**MOE, "seq": 5, "heads": 5, "hidden": 10, "bias_balance": 0.05}),
    ("dp=2,ep=2", {"recompute": "full"}, {**MOE, "capacity_factor": 1.0, "batch": 7}),
    ("pp=2,ep=2", {"pipeline": "interleaved-1f1b"}, {**BALANCED, "microbatches": 2, "chunks": 2, "batch": 8}),
    ("ep=4", {"overlap": False}, {**BALANCED, "experts": 8, "batch": 9}),
    # --moe-every: dense and expert layers mixed (a pipeline chunk's j-th layer of either kind)
    ("dp=1", {}, {**MOE, "moe_every": 2}),
    (
        "pp=2,tp=2",
        {"sp": True, "pipeline": "interleaved-1f1b"},
        {**MOE, "moe_every": 3, "microbatches": 2, "chunks": 2, "batch": 8, "layers": 6},
    ),
    ("ep=2", {"recompute": "full"}, {**BALANCED, "moe_every": 2}),
    # the (8 ranks: mpiexec -n 8, and threads below)
    ("pp=2,ep=2,tp=2", {"sp": True}, {**MOE, "experts": 8, "microbatches": 2, "batch": 8}),
    ("fsdp=2,ep=2,tp=2", {"sp": True}, {**MOE, "experts": 8, "aux_loss": 0.01, "batch": 8}),
    (
        "ep=4,cp=2",
        {"cp": core_named("ring")},
        {**MOE, "experts": 8, "seq": 5, "heads": 5, "hidden": 10, "bias_balance": 0.001, "batch": 8},
    ),
    # the balancing loss and the capacity under cp: counted over the whole sequence (cp ranks' counts gathered),
    # both variants, uneven chunks (ring's zigzag 2 + 1 and 1 + 1 of 5, Ulysses' 4 and 3 of 7)
    ("cp=2", {"cp": core_named("ring")}, {**BALANCED, "seq": 5, "heads": 5, "hidden": 10}),
    ("cp=2", {"cp": core_named("ulysses")}, {**MOE, "aux_loss": 0.05, "seq": 7}),
    (
        "cp=2",
        {"cp": core_named("ulysses"), "recompute": "full"},
        {**MOE, "capacity_factor": 0.75, "seq": 7, "microbatches": 2},
    ),
    ("ep=2,cp=2", {"cp": core_named("ring")}, {**BALANCED, "seq": 5, "heads": 5, "hidden": 10, "bias_balance": 0.05}),
    ("ep=2,cp=2", {"cp": core_named("ulysses")}, {**BALANCED, "seq": 7, "capacity_factor": 0.75}),
    ("cp=2,tp=2", {"cp": core_named("ulysses"), "sp": True}, {**BALANCED, "seq": 7}),
    # FSDP over ep: the dense weights sharded over fsdp x ep (gathered over ep, then fsdp; reduce-scattered back),
    # the experts over fsdp; in place with micro-batches, without resharding, without overlap; ZeRO-1 and 2 keep the
    # dense weights replicated over ep
    ("fsdp=2,ep=2", {"zero": 3}, {**BALANCED, "microbatches": 2, "batch": 8}),
    ("fsdp=2,ep=2", {"zero": 3, "reshard": False, "overlap": False}, {**MOE, "moe_every": 2, "batch": 7}),
    ("fsdp=2,ep=2", {"zero": 1}, {**MOE, "batch": 6}),
    ("fsdp=2,ep=2", {"zero": 2}, {**BALANCED, "aux_loss": 0.0}),
    ("dp=2,fsdp=2,ep=2", {"zero": 3}, {**MOE, "experts": 4, "batch": 8, "bias_balance": 0.05}),
    ("pp=2,fsdp=2,ep=2", {"zero": 3, "pipeline": "1f1b"}, {**MOE, "microbatches": 2, "batch": 8}),
]


def sized(size: int) -> list:
    found = [c for c in CASES if Mesh.parse(c[0]).size == size]
    assert found, f"no mixture-of-experts case of {size} ranks"
    return found


def test_every_layout_of_a_mixture_of_experts_equals_one_device(world):
    for case in sized(world.size):
        world.run(composed_run_matches, case, "llama", "float", CASES.index(case))


@pytest.mark.parametrize("case", [c for c in CASES if Mesh.parse(c[0]).size == 8], ids=lambda c: c[0])
def test_the_eight_rank_expert_parallel_layouts_on_threads(case):
    run_threads(
        8, lambda comm, rank: composed_run_matches(comm, rank, case, "llama", "float", CASES.index(case)), timeout=120
    )


def test_expert_gradients_do_not_depend_on_ep():
    """DeepSpeed #5259 and kin: expert gradients ep times too large. One step of SGD on ep = 1, 2, 4 (every other
    axis 1): each expert's update is the same to 1e-12 of its norm, and the dense weights' too."""
    net = net_for("llama", {**MOE, "experts": 8}, steps=1, batch=8, optimizer="sgd")
    start = {u: initial_unit(net, u) for u in range(len(unit_kinds(net)))}
    updates = {}
    for ep in (1, 2, 4):

        def body(comm, rank, ep=ep):
            engine = train(comm, rank, (f"ep={ep}", {}, {}), net)[2]
            for unit, index, values in engine.owned():
                updates.setdefault(ep, {}).setdefault(unit, np.zeros_like(start[unit]))[index] = (
                    values - start[unit][index]
                )

        run_threads(ep, body, timeout=60)
    for unit, update in updates[1].items():
        for ep in (2, 4):
            assert np.linalg.norm(updates[ep][unit] - update) <= 1e-12 * np.linalg.norm(update), (ep, unit)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_mixture_of_experts_in_mixed_precision_updates_as_one_device(precision):
    """16-bit compute, fp32 router logits, master weights and reductions: the composed check's stated bound,
    and each block's update over 2 steps (experts and router) within 5% of one device's in norm (measured:
    about 1% in bf16; a missing gradient would be 100% off)."""
    case = ("tp=2", {"sp": True}, BALANCED)
    net = net_for("llama", BALANCED, optimizer="sgd", precision=precision, steps=2)
    ref = reference.reference_run(net)

    def body(comm, rank):
        composed_run_matches(comm, rank, case, "llama", "mixed", 0)
        engine = train(comm, rank, case, net)[2]
        for unit, index, values in engine.owned():
            if 1 <= unit <= net.layers:
                start = initial_unit(net, unit)[index]
                mine, want = values - start, ref.units[unit][index] - start
                assert np.linalg.norm(mine - want) <= 0.05 * np.linalg.norm(want), f"layer {unit}"

    run_threads(2, body, timeout=60)


@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[9], CASES[18], CASES[-6]], ids=lambda c: c[0])
def test_the_peak_memory_of_a_mixture_of_experts_equals_the_model(case):
    """tracemalloc's peak == the closed form's: the pairs' buffers (rows x top_k, wherever the tokens go; over ep
    every ep rank's pairs, dropless)."""
    run_threads(Mesh.parse(case[0]).size, lambda comm, rank: peak_matches(comm, rank, case, "llama", False), timeout=60)


@pytest.mark.parametrize(
    "fields",
    [
        MOE,
        {**BALANCED, "router": "sigmoid"},
        {**MOE, "top_k": 1, "aux_loss": 0.2},
        {**MOE, "expert_activation": "gelu"},
        {**BALANCED, "moe_every": 2},
    ],
    ids=["dropless", "balanced-sigmoid", "top1-aux", "gated-gelu", "every-2nd"],
)
def test_the_oracles_gradient_is_the_finite_difference_of_its_loss_and_balancing_loss(fields, monkeypatch):
    """Cross-entropy plus every block's balancing loss, differentiated numerically, against the hand-written
    backward: the routing, the gates, the renormalization and the balancing loss's gradient."""
    net = net_for("llama", {}, **fields, steps=1)
    rng = np.random.default_rng(1)
    units = [
        initial_unit(net, u) + 0.3 * rng.standard_normal(initial_unit(net, u).size) for u in range(len(unit_kinds(net)))
    ]
    ids, targets = (np.asarray(a) for a in net.batch_data(0))
    balancing = []
    forward = reference.moe_forward

    def counted(*args):
        y, cache = forward(*args)
        balancing.append(cache["aux"])
        return y, cache

    monkeypatch.setattr(reference, "moe_forward", counted)

    def objective(us):
        balancing.clear()
        loss, grads = reference.loss_and_grads(net, us, ids, targets)
        return loss + sum(balancing), grads

    grads = objective(units)[1]
    pieces = reference.views(np.arange(units[1].size), net, moe=True)
    router = pieces[6].ravel()  # (g1, Wq, Wk, Wv, Wo, g2, Wr, W1, W3, W2): the router's indices in the block
    for unit in (1, net.layers):
        for i in [*rng.choice(router, 6, replace=False), *rng.choice(units[unit].size, 12, replace=False)]:
            up, down = [u.copy() for u in units], [u.copy() for u in units]
            up[unit][i] += 1e-6
            down[unit][i] -= 1e-6
            numeric = (objective(up)[0] - objective(down)[0]) / 2e-6
            assert abs(numeric - grads[unit][i]) < 1e-7, (unit, i)


def test_a_tie_goes_to_the_lower_expert_in_the_layer_and_in_the_oracle():
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 3, size=(200, 6)).astype(float) / 4  # many ties
    for k in (1, 2, 3, 6):
        np.testing.assert_array_equal(choose(scores, k), top_choices(scores, k))
    assert choose(np.full((1, 4), 0.25), 2).tolist() == [[0, 1]]


@pytest.mark.parametrize("factor", [0.5, 1.0, 1.25, 2.0])
def test_capacity_drops_the_same_pairs_in_the_layer_and_in_the_oracle(factor):
    """The layer finds each (expert, sequence)'s first C pairs in its expert-sorted order; the oracle counts row by
    row. Both keep the pairs of the earliest rows."""
    rng = np.random.default_rng(2)
    seq, k, e = 7, 2, 4
    choice = np.stack([rng.permutation(e)[:k] for _ in range(5 * seq)])
    flat = choice.reshape(-1)
    order = np.argsort(flat, kind="stable")
    keep = np.empty(flat.size, dtype=bool)
    keep[order] = kept(flat[order], order // k // seq, capacity(seq, k, e, factor))
    want = kept_pairs(choice, seq, e, factor)
    np.testing.assert_array_equal(keep.reshape(choice.shape), want)
    assert factor >= 2 or not want.all()  # something dropped below a factor of 2


def test_the_balancing_loss_is_alpha_at_perfect_balance_and_more_when_one_expert_takes_all():
    net = Net(model="llama", experts=4, top_k=2, aux_loss=0.01, seq=4, batch=3)
    rows = net.seq * net.batch
    uniform = np.full((rows, 4), 0.25)
    balanced = np.tile([[0, 1], [2, 3]], (rows // 2, 1))
    assert balance_loss(uniform, balanced, net) == pytest.approx(0.01, rel=1e-15)
    skewed = np.tile([0.7, 0.1, 0.1, 0.1], (rows, 1))
    assert balance_loss(skewed, np.tile([[0, 1]], (rows, 1)), net) > 0.01


@pytest.mark.parametrize(
    "fields, mesh, words",
    [
        ({"experts": 1}, "dp=1", "--experts must be 0"),
        ({"experts": 4, "top_k": 5}, "dp=1", r"--top-k must be in \[1, --experts 4\]"),
        ({"experts": 4, "router": "relu"}, "dp=1", "--router must be one of softmax, sigmoid"),
        ({"experts": 4, "expert_activation": "relu"}, "dp=1", "--expert-activation must be one of silu, gelu"),
        ({"experts": 4, "moe_every": 0}, "dp=1", "--moe-every must be >= 1"),
        ({"moe_every": 2}, "dp=1", "--moe-every: a mixture of experts' flags"),
        ({"expert_activation": "gelu"}, "dp=1", "--expert-activation: a mixture of experts' flags"),
        ({"aux_loss": 0.01}, "dp=1", "--aux-loss: a mixture of experts' flags, add --experts E"),
        ({"experts": 4, "capacity_factor": -1.0}, "dp=1", "--capacity-factor must be >= 0"),
    ],
)
def test_a_mixture_of_experts_that_cannot_run_is_refused_naming_the_flag(fields, mesh, words):
    with pytest.raises(ValueError, match=words):
        Composition(cp=core_named("ring")).validate(
            net_for("llama", {}, **fields), Mesh.parse(mesh).size, Mesh.parse(mesh)
        )


def test_the_train_command_runs_grok_ones_layer_and_names_it():
    import json
    import subprocess
    import sys

    command = [
        sys.executable,
        "-m",
        "spmd",
        "train",
        "--model",
        "llama",
        "--experts",
        "8",
        "--top-k",
        "2",
        "--aux-loss",
        "0.01",
        "--mesh",
        "pp=2,tp=2",
        "--sp",
        "--devices",
        "4",
        "--check",
        "--json",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["ok"] and report["bytes_match_model"] and report["memory_match_model"]
    assert (report["model"]["experts"], report["model"]["top_k"], report["model"]["aux_loss"]) == (8, 2, 0.01)
    assert summary(report["model"])[1].endswith(", 8 experts (top-2, softmax, aux 0.01, dropless)")
    m = report["model"]
    assert [sum(s["tokens_per_expert"]) for s in report["routing"]] == [m["layers"] * m["tokens"] * 2] * m["steps"]
    assert all(s["dropped"] == 0 for s in report["routing"])  # dropless


BIASED = {"bias_balance": 0.05}
ROUTING_CASES = [  # dropping, so the dropped count is checked too: every world size, tp with SP, cp, pp, data axes
    ("dp=1", {}, {**BALANCED, **BIASED, "microbatches": 2}),
    ("tp=2", {"sp": True, "recompute": "full"}, {**BALANCED, **BIASED}),
    ("cp=2", {"cp": core_named("ulysses")}, {**MOE, **BIASED, "seq": 6, "heads": 6}),
    ("dp=3", {}, {**BALANCED, "batch": 7}),
    ("pp=2,tp=2", {"sp": True, "pipeline": "zb-h1"}, {**BALANCED, **BIASED, "microbatches": 2}),
    ("dp=2,fsdp=2", {"zero": 3}, {**MOE, **BIASED, "batch": 8}),
    ("ep=2", {}, {**BALANCED, **BIASED}),  # dropping over ep: the same pairs as one device
    ("ep=2,tp=2", {"sp": True}, {**BALANCED, **BIASED, "batch": 6}),
    ("ep=3", {}, {**MOE, "experts": 6, "capacity_factor": 0.75, "batch": 6}),
    ("dp=2", {}, {**BALANCED, **BIASED, "moe_every": 2}),
    ("fsdp=2,ep=2,tp=2", {"sp": True}, {**BALANCED, **BIASED, "experts": 8, "batch": 8}),
    ("cp=2", {"cp": core_named("ring")}, {**BALANCED, **BIASED, "seq": 5, "heads": 5, "hidden": 10}),  # drops over cp
    ("ep=2,cp=2", {"cp": core_named("ulysses")}, {**BALANCED, "seq": 7, "capacity_factor": 0.75}),
]


def routing_equals_the_references(comm, rank, case):
    from spmd.collectives import gather
    from spmd.transport.group import Group

    mesh, layout, fields = case
    net = net_for("llama", fields, steps=3)
    strategy, world = Composition(**layout), Group.world(comm, rank)
    engine = strategy.build(world, strategy.validate(net, world.size, Mesh.parse(mesh)), net)
    counts = []
    for step in range(net.steps):
        engine.step(*net.batch_data(step))
        counts.append(engine.routing())
    every = gather(world, np.array(counts))
    want = reference.reference_run(net)
    if every is not None:
        np.testing.assert_array_equal(sum(every), np.array(want.routing))
        moe_layers = sum(is_moe(net, layer) for layer in range(net.layers))
        assert int(want.routing[0][:-1].sum()) == moe_layers * net.batch * net.seq * net.top_k
    for unit, bias in engine.experts.bias.items():  # every rank's copy, bitwise the reference's
        assert bias.tobytes() == want.biases[unit - 1].tobytes(), f"layer {unit}"
    assert bool(engine.experts.bias) == bool(net.bias_balance)


def test_the_routing_statistics_are_the_references_on_every_mesh(world):
    """Pairs to each expert over the layers and the pairs dropped, summed over the ranks (tp peers counted once,
    recomputation once, evaluation never): one device's numbers, step by step; with --bias-balance each layer's
    bias, on every rank that holds the layer, bitwise the reference's."""
    cases = [c for c in ROUTING_CASES if Mesh.parse(c[0]).size == world.size]
    assert cases
    for case in cases:
        world.run(routing_equals_the_references, case)


def test_the_balancing_bias_moves_the_routing_toward_the_mean_load():
    """On one batch seen again and again (weights barely moving), the bias (moved by gamma after each step from
    the loads) narrows the spread of pairs per expert that the plain router keeps; after the first step each
    layer's bias is gamma where its expert took fewer than the mean, -gamma where more."""
    net = net_for("llama", MOE, steps=12, lr=1e-9)

    class SameBatch:
        def batch_data(self, step):
            return net.batch_data(0)

    plain = reference.reference_run(net, SameBatch())
    once = reference.reference_run(replace(net, bias_balance=0.002, steps=1), SameBatch())
    biased = reference.reference_run(replace(net, bias_balance=0.002), SameBatch())
    spread = [int(np.ptp(counts[:-1])) for counts in biased.routing]
    assert max(spread[6:]) < int(np.ptp(plain.routing[0][:-1])) == int(np.ptp(plain.routing[-1][:-1]))
    per_layer: list = []  # the first step's loads per layer, from the unbiased routing
    reference.loss_and_grads(
        net, [initial_unit(net, u) for u in range(len(unit_kinds(net)))], *net.batch_data(0), routing=per_layer
    )
    for bias, load in zip(once.biases, per_layer[0][:, :-1], strict=True):
        np.testing.assert_array_equal(bias, 0.002 * np.sign(load.mean() - load))


def test_the_capacity_is_exact_for_a_factor_as_written():
    assert capacity(25, 2, 2, 2.2) == 55 and capacity(7, 2, 4, 1.0) == 4 and capacity(8, 2, 4, 0.0) == 0


def test_the_step_table_shows_the_dispatch_and_combine_on_the_ep_axis():
    import subprocess
    import sys

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "spmd",
            "train",
            "--model",
            "llama",
            "--experts",
            "4",
            "--mesh",
            "fsdp=2,ep=2",
            "--devices",
            "4",
            "--schedule",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert (
        "ep: the mixture of experts' dispatch" in done.stdout + done.stderr
        or "dispatch and combine: A2A counts, rows, gates over ep" in done.stdout
    )
    assert "A2A dy over ep, dx and gate gradients back" in done.stdout
    assert "AR each gradient's dense part (all but the experts') over ep" in done.stdout


def test_over_ep_a_capacity_sizes_the_buffers_and_dropless_takes_every_ep_ranks_pairs():
    """Dropless, a rank's experts may receive every pair of its ep group (ep x its own rows x top_k); with a
    capacity at most C of each sequence for each of its experts (only kept pairs are sent)."""
    mesh = Mesh.parse("ep=4")
    net = net_for("llama", {**MOE, "experts": 8}, batch=8, seq=16)
    layout = Composition().layout(mesh)
    rows = layout.for_rank(net, 0).rows[0]
    own = rows.matmul * net.top_k
    assert rows.pairs == 4 * own
    capped = replace(net, capacity_factor=1.0)
    c = capacity(net.seq, net.top_k, net.experts, 1.0)
    assert layout.for_rank(capped, 0).rows[0].pairs == 8 * 2 * c < 4 * own  # 8 sequences, 2 experts a rank
    dropless, dropping = (Composition().cost(n, mesh).memory[0]["activations"] for n in (net, capped))
    assert dropping < dropless


def test_the_gated_gelu_kernels_are_the_tanh_approximation_and_its_derivative():
    from spmd.model import lm_kernels as lm
    from spmd.model.moe_reference import activation

    z = np.linspace(-6, 6, 241)
    out, slope, tmp = (np.empty_like(z) for _ in range(3))
    lm.gelu(z, out)
    lm.gelu_grad(z, slope, tmp)
    want, want_slope = activation(z, "gelu")
    np.testing.assert_allclose(out, want, rtol=1e-14, atol=1e-15)
    np.testing.assert_allclose(slope, want_slope, rtol=1e-12, atol=1e-13)  # 1 - t cancels far left
    numeric = (activation(z + 1e-6, "gelu")[0] - activation(z - 1e-6, "gelu")[0]) / 2e-6
    np.testing.assert_allclose(want_slope, numeric, atol=1e-8)
    assert out[120] == 0 and abs(out[-1] - 6) < 1e-8  # gelu(0) = 0, gelu(6) ~ 6


def test_a_pipeline_stage_of_dense_layers_only_runs_with_its_expert_neighbours():
    """--moe-every 4 on pp=2: stage 1 holds no expert layer, yet every rank joins the report's gathers (the
    routing a step is zeros there), and the run checks against one device."""
    import json
    import subprocess
    import sys

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "spmd",
            "train",
            "--model",
            "llama",
            "--experts",
            "4",
            "--layers",
            "4",
            "--moe-every",
            "4",
            "--mesh",
            "pp=2",
            "--devices",
            "2",
            "--steps",
            "2",
            "--check",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["ok"] and report["bytes_match_model"]
    m = report["model"]
    assert [sum(s["tokens_per_expert"]) for s in report["routing"]] == [m["tokens"] * 2] * 2  # one expert layer


@pytest.mark.parametrize("factor", [0.0, 1.0, 1.25])
def test_the_planners_uniform_routing_sends_every_ep_ranks_share(factor):
    """At uniform routing (nothing dropped) a rank sends (ep-1)/ep of its pairs and receives as many from the
    others, whatever the capacity its buffers are sized by."""
    from spmd.parallel.cost import uniform_exchanged

    net = net_for("llama", {**MOE, "experts": 8, "capacity_factor": factor}, batch=8, seq=16)
    layout = Composition().layout(Mesh.parse("ep=4"))
    plan = layout.for_rank(net, 0)
    pairs = plan.rows[0].matmul * net.top_k * net.layers
    assert uniform_exchanged(net, layout, plan) == [pairs * 3 // 4] * 4
