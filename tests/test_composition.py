"""Every composition of the mesh axes, every registered model, one set of checks, on threads and under mpiexec.

The compositions are generated, not listed: every subset of the axes pp, dp, fsdp, cp, tp with 2 ranks each
(up to 8 ranks; ep, which splits a mixture of experts, is composed in test_moe), tp with and without SP, each
registered pipeline schedule, ZeRO preset, cp variant (ring, Ulysses), recomputation (none, selective, full)
and overlap (FSDP prefetch, gradients reduced in the background; or not) taken in turn, plus uneven 3-rank
axes. Each rank checks: its losses and every parameter it holds against the single-device reference (bitwise
for the MLP on integer data; float64 within 1e-11 otherwise), bytes sent and received per mesh axis == the
closed form to the byte, the arrays it holds by kind == the closed form, and tracemalloc's peak == their sum.
A new axis value, schedule or preset is checked with no new test code.
"""

import functools
import itertools
import types

import numpy as np
import pytest
from peak_check import assert_peak_matches, peak_of_steps

from spmd.harness.train_job import tolerance
from spmd.model import Net
from spmd.model.blocks import Role
from spmd.model.optimizers import OPTIMIZERS
from spmd.model.precision import PRECISIONS
from spmd.model.reference import reference_train
from spmd.model.registry import MODELS as SPECS
from spmd.model.registry import role_of, spec_of
from spmd.parallel.context import CP_CORES, core_named
from spmd.parallel.cost import pair_traffic
from spmd.parallel.dims import AXES, Dims
from spmd.parallel.layout import RECOMPUTE, Layout
from spmd.parallel.schedules import SCHEDULES
from spmd.parallel.sharding import ZERO
from spmd.parallel.strategy import Composition
from spmd.transport.group import TAGS_PER_CONTEXT, Group
from spmd.transport.mesh import Mesh
from spmd.transport.threads import run_threads

# Python objects beside the arrays (requests, views, numpy's cache of small freed buffers): up to ~170 KiB
# seen under MPI for the busiest composition; the arrays checked are several MiB in all.
MEMORY_SLACK = 256 * 1024


def compositions() -> list[tuple[str, dict, dict]]:
    """(mesh, Composition fields, Net fields) for every axis subset (2 ranks an axis) and a few uneven ones."""
    # each ZeRO preset in turn; ZeRO-3 also without resharding after forward
    presets = [{"zero": z} for z in sorted(ZERO)] + [{"zero": 3, "reshard": False}]
    cases, schedules, zeros = [], itertools.cycle(SCHEDULES), itertools.cycle(presets)
    contexts, recomputes = itertools.cycle(CP_CORES.values()), itertools.cycle(RECOMPUTE)
    overlaps = itertools.cycle([True, True, False])  # background collectives on (the default) or off
    dense_axes = [a for a in AXES if a != "ep"]  # ep splits experts: test_moe composes it
    for n in range(1, len(dense_axes) + 1):
        for axes in itertools.combinations(dense_axes, n):
            if 2**n > 8:
                continue
            mesh = ",".join(f"{a}=2" for a in axes)
            for sp in [False, True] if "tp" in axes else [False]:
                layout = {"sp": sp}
                net = {}
                if "pp" in axes:
                    layout["pipeline"] = next(schedules)
                    pipeline = SCHEDULES[layout["pipeline"]]
                    m = max(2, pipeline.min_microbatches(2))  # 2 micro-batches, or as many as the schedule needs
                    data = 2 ** len({"dp", "fsdp"} & set(axes))  # enough sequences for m micro-batches each, uneven
                    net = {"microbatches": m, "chunks": 2 if pipeline.chunked else 1, "batch": m * data + 1}
                if "fsdp" in axes:
                    layout.update(next(zeros))
                if "cp" in axes:  # uneven: 5 tokens over 2 ranks (zigzag 3 and 2), heads 3 + 2 over tp, 2 + 1 over cp
                    layout["cp"] = next(contexts)
                    net.update(seq=5, heads=5, hidden=10)
                layout["recompute"] = next(recomputes)
                layout["overlap"] = next(overlaps)
                cases.append((mesh, layout, net))
    cases += [
        ("dp=1", {}, {"microbatches": 2}),
        ("pp=3", {"pipeline": "1f1b"}, {"microbatches": 3}),
        ("tp=3", {"sp": True}, {}),
        ("fsdp=3", {"zero": 2}, {}),
        ("dp=3", {}, {"batch": 7, "microbatches": 2}),
        ("cp=3", {"cp": core_named("ring")}, {"seq": 7}),
        ("cp=3", {"cp": core_named("ulysses"), "recompute": "selective"}, {"seq": 7, "heads": 4, "hidden": 8}),
    ]
    return cases


CASES = compositions()


def case_id(case) -> str:
    mesh, layout, net = case
    return "-".join(
        [
            mesh,
            *(f"{k}={v}" for k, v in layout.items() if v is not True and v and v != "none"),
            *("no-overlap" for k, v in layout.items() if k == "overlap" and not v),
            *("no-reshard" for k, v in layout.items() if k == "reshard" and not v),
            *(f"{k}={v}" for k, v in net.items()),
        ]
    )


def net_for(model: str, fields: dict, **more) -> Net:
    """Uneven on purpose: 5 sequences of 3, h 8, f 10, 3 heads (tp=2 gives 2 and 1)."""
    base = dict(model=model, layers=4, hidden=6, ffn=10, heads=3, seq=3, batch=5, steps=2)
    if model == "mlp":  # the attention sizes a case asks for are the transformer's (the MLP keeps exact integers)
        fields = {k: v for k, v in fields.items() if k not in ("heads", "hidden")}
    if model == "llama":  # an even head size (RoPE's pairs), grouped-query (3 kv heads for 6), an uneven vocabulary
        base.update(hidden=12, heads=6, vocab=11)
        heads = {**base, **fields, **more}["heads"]
        more = {**more, "kv_heads": 3 if heads % 3 == 0 else heads}
    if model == "gpt2":  # the LM's uneven vocabulary
        base.update(vocab=11)
    return Net(**{**base, **fields, **more})


def train(comm, rank, case, net):
    mesh, layout, _ = case
    strategy, world = Composition(**layout), Group.world(comm, rank)
    mesh = strategy.validate(net, world.size, Mesh.parse(mesh))
    engine = strategy.build(world, mesh, net)
    losses = [engine.step(*net.batch_data(step)) for step in range(net.steps)]
    return strategy, mesh, engine, losses


# Optimizer and precision, taken in turn by the cases of the "mixed" mode: (optimizer, precision, reduce dtype)
TRAINING_STATE = [
    ("adamw", "bf16", ""),
    ("sgd", "fp16", ""),
    ("adamw", "bf16", "bf16"),
    ("adamw", "fp32", ""),
    ("sgd", "bf16", ""),
    ("adamw", "fp16", ""),
]


def training_state(turn: int) -> dict:
    optimizer, precision, reduce = TRAINING_STATE[turn % len(TRAINING_STATE)]
    return dict(optimizer=optimizer, precision=precision, reduce_dtype=reduce)


def composed_run_matches(comm, rank, case, model, mode, turn=None):
    """`turn` picks the options taken in turn (default: the case's place in CASES)."""
    turn = CASES.index(case) if turn is None else turn
    integers = mode == "integers"
    more = (
        {"integers": True, "steps": 1, "lr": 2.0**-6} if integers else training_state(turn) if mode == "mixed" else {}
    )
    if model in ("llama", "gpt2"):  # in turn: the tied embedding (across stages under pp), global-norm clipping
        more.update(tie_embeddings=turn % 2 == 0, clip_grad=0.05 if turn % 3 == 0 else 0.0)
    net = net_for(model, case[2], **more)
    strategy, mesh, engine, losses = train(comm, rank, case, net)
    ref_losses, ref_layers = reference_train(net)
    if integers:
        assert losses == ref_losses
        for layer, index, values in engine.owned():
            np.testing.assert_array_equal(values, ref_layers[layer][index], err_msg=f"layer {layer}")
    elif mode == "float":
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-11)
        for layer, index, values in engine.owned():
            np.testing.assert_allclose(values, ref_layers[layer][index], rtol=1e-11, atol=1e-13)
    else:  # the stated bound (train_job.tolerance: per step, Megatron's for 16-bit compute)
        bound = tolerance(net)
        np.testing.assert_allclose(losses, ref_losses, rtol=bound)
        for layer, index, values in engine.owned():
            ref = ref_layers[layer]
            assert np.max(np.abs(values - ref[index])) <= bound * np.max(np.abs(ref)), f"layer {layer}"
    cost, traffic = strategy.cost(net, mesh), comm.traffic(rank)
    pairs = pair_traffic(net, engine.exchanged())  # a mixture of experts over ep: where the tokens went
    assert traffic.bytes_sent() == cost.bytes_sent[rank] * net.steps + sum(pairs.sent.values())
    assert traffic.bytes_received() == cost.bytes_received[rank] * net.steps + sum(pairs.received.values())
    for axis in mesh.names:
        context = mesh.context(axis)
        sent = sum(b for (_, tag), b in traffic.sent_bytes.items() if tag // TAGS_PER_CONTEXT == context)
        received = sum(b for (_, tag), b in traffic.received_bytes.items() if tag // TAGS_PER_CONTEXT == context)
        want = cost.traffic[rank]
        assert (sent, received) == (
            want.sent[axis] * net.steps + pairs.sent[axis],
            want.received[axis] * net.steps + pairs.received[axis],
        ), axis
    assert engine.arena.by_kind() == cost.memory[rank]


MODELS = [
    ("mlp", "integers"),
    ("mlp", "float"),
    ("transformer", "float"),
    ("transformer", "mixed"),
    ("llama", "float"),
    ("llama", "mixed"),
    ("gpt2", "float"),
]


def sized(world, cases):
    """The cases whose mesh spans exactly this world."""
    found = [c for c in cases if Mesh.parse(c[0]).size == world.size]
    assert found, f"no composition of {world.size} ranks: every world size must check something"
    return found


# Under mpiexec the compositions take the models in turn. Threads run every case with every model (the world tests
# at 1-4 ranks, test_eight_rank_compositions_on_threads at 8); mpiexec adds a process per rank and its transport,
# pairwise: at each size every case with a third of the models, every model with a third of the cases, "mixed"
# in bf16 and fp16 (test_under_mpi_every_case_and_model_run_at_every_size).
def in_turn_under_mpi(world, cases, turn: int, every: int = 3) -> list:
    """All `cases` on threads; under mpiexec those whose place in CASES plus `turn` is a multiple of `every`."""
    if not world.one_rank_per_process:
        return cases
    return [c for c in cases if (CASES.index(c) + turn) % every == 0]


# GPT-2, the proof that a model is local, is checked on threads in every other case (the threads suite's time):
# every composition kind meets it, and under mpiexec it takes its turn as the other models do.
HALF_ON_THREADS = ("gpt2",)


def on_threads(cases: list, model: str) -> list:
    return [c for c in cases if CASES.index(c) % 2 == 0] if model in HALF_ON_THREADS else cases


@pytest.mark.parametrize("model, mode", MODELS)
def test_every_composition_equals_one_device_to_the_byte(world, model, mode):
    cases = in_turn_under_mpi(world, sized(world, CASES), MODELS.index((model, mode)))
    for case in cases if world.one_rank_per_process else on_threads(cases, model):
        world.run(composed_run_matches, case, model, mode)


def test_under_mpi_every_case_and_model_run_at_every_size():
    for size in (2, 3, 4, 8):  # make test-mpi's and test-network's
        world = types.SimpleNamespace(size=size, one_rank_per_process=True)
        runs = {
            (CASES.index(case), j)
            for j, model in enumerate(MODELS)
            for case in in_turn_under_mpi(world, sized(world, CASES), j)
        }
        assert {i for i, _ in runs} == {CASES.index(case) for case in sized(world, CASES)}
        assert {j for _, j in runs} == set(range(len(MODELS)))
        mixed = {training_state(i)["precision"] for i, j in runs if MODELS[j][1] == "mixed"}
        assert {"bf16", "fp16"} <= mixed, size
        for j, model in enumerate(PEAK_MODELS):
            assert in_turn_under_mpi(world, sized(world, CASES), j, peak_turns(world)), (size, model)
        peaks = {
            CASES.index(c)
            for j in range(len(PEAK_MODELS))
            for c in in_turn_under_mpi(world, sized(world, CASES), j, peak_turns(world))
        }
        assert peaks == {CASES.index(case) for case in sized(world, CASES)}


BEYOND_THREAD_WORLDS = [c for c in CASES if Mesh.parse(c[0]).size > 4]  # the world fixture's threads stop at 4


EIGHT_RANK_RUNS = [
    pytest.param(case, model, mode, id=f"{model}-{mode}-{case_id(case)}")
    for model, mode in MODELS
    for case in on_threads(BEYOND_THREAD_WORLDS, model)
]


@pytest.mark.parametrize("case, model, mode", EIGHT_RANK_RUNS)
def test_eight_rank_compositions_on_threads(case, model, mode):
    run_threads(
        Mesh.parse(case[0]).size, lambda comm, rank: composed_run_matches(comm, rank, case, model, mode), timeout=60
    )


def holds_the_closed_form(comm, rank, case, model, fields):
    net = net_for(model, case[2], **fields)
    mesh, layout, _ = case
    strategy, world = Composition(**layout), Group.world(comm, rank)
    mesh = strategy.validate(net, world.size, Mesh.parse(mesh))
    assert strategy.build(world, mesh, net).arena.by_kind() == strategy.cost(net, mesh).memory[rank]


SETTINGS = [dict(precision=p, reduce_dtype=r) for p in PRECISIONS for r in (["", p] if p in ("fp16", "bf16") else [""])]
STATE_MODELS = ("transformer", "llama")


def memory_runs(optimizer: int, setting: int) -> list[tuple[tuple, str]]:
    """(case, model) built for OPTIMIZERS[optimizer] with SETTINGS[setting]: every other composition, the models in
    turn. Pairwise, not the full product (2 x 6 x 43 x 2 = 1032 builds, a quarter of them): every two of optimizer,
    precision setting, composition and model meet (test_the_memory_runs_cover_every_pair)."""
    return [
        (case, STATE_MODELS[(i // 2 + setting) % 2])
        for i, case in enumerate(CASES)
        if (i + optimizer + setting) % 2 == 0
    ]


def test_the_memory_runs_cover_every_pair():
    runs = [
        (o, s, CASES.index(case), model)
        for o in range(len(OPTIMIZERS))
        for s in range(len(SETTINGS))
        for case, model in memory_runs(o, s)
    ]
    sizes = (len(OPTIMIZERS), len(SETTINGS), len(CASES), len(STATE_MODELS))
    for a, b in itertools.combinations(range(4), 2):
        met = {(run[a], run[b] if b < 3 else STATE_MODELS.index(run[b])) for run in runs}
        assert len(met) == sizes[a] * sizes[b], (a, b)


@pytest.mark.parametrize("setting", range(len(SETTINGS)), ids=lambda s: "-".join(v for v in SETTINGS[s].values() if v))
@pytest.mark.parametrize("optimizer", range(len(OPTIMIZERS)), ids=lambda o: list(OPTIMIZERS)[o])
def test_every_optimizer_and_precision_holds_the_closed_form_memory_in_every_composition(optimizer, setting):
    """Memory by kind (params, fp32 master, grads in the reduction dtype, optimizer state, ...) == the closed
    form, every composition with every setting and both optimizers over this set (memory_runs; built, not
    stepped: the steps are checked above); the transformer's state path is the MLP's, with more kinds of
    activations."""
    fields = dict(optimizer=list(OPTIMIZERS)[optimizer], **SETTINGS[setting])
    for case, model in memory_runs(optimizer, setting):
        run_threads(
            Mesh.parse(case[0]).size,
            functools.partial(holds_the_closed_form, case=case, model=model, fields=fields),
            timeout=60,
        )


def peak_matches(comm, rank, case, model, one_rank_per_process):
    net = net_for(model, case[2], hidden=32, ffn=64, heads=4, seq=8, steps=1)
    mesh, layout, _ = case
    strategy, world = Composition(**layout), Group.world(comm, rank)
    mesh = strategy.validate(net, world.size, Mesh.parse(mesh))
    batches = [net.batch_data(step) for step in range(net.steps)]
    model = strategy.cost(net, mesh).peak_bytes  # before the measure: it fills the layout's caches (see peak_check)
    peak = peak_of_steps(world, lambda: strategy.build(world, mesh, net), batches, one_rank_per_process)
    assert_peak_matches(world, peak, model, one_rank_per_process, MEMORY_SLACK)


PEAK_MODELS = ["mlp", "transformer", "llama"]


def peak_turns(world) -> int:
    """Threads check the sum of the ranks' peaks, mpiexec each rank's: up to 4 ranks, where threads check every case
    with every model, mpiexec takes the models in turn; at 8, every case with every model (threads stop at 4)."""
    return 1 if world.size > 4 else 3


@pytest.mark.parametrize("model", PEAK_MODELS)
def test_peak_memory_equals_the_model(world, model):
    for case in in_turn_under_mpi(world, sized(world, CASES), PEAK_MODELS.index(model), peak_turns(world)):
        world.run(peak_matches, case, model, world.one_rank_per_process)


@pytest.mark.parametrize(
    "mesh, words",
    [
        ("tp=2,pp=2", "axes go in the order pp, dp, fsdp, ep, cp, tp"),
        ("tp=2,cp=2", "write --mesh cp=2,tp=2"),
        ("cp=2,ep=2", "write --mesh ep=2,cp=2"),
        ("sp=2", "unknown axis 'sp'"),
    ],
)
def test_a_mesh_out_of_order_or_unknown_is_refused_naming_the_axis(mesh, words):
    with pytest.raises(ValueError, match=words):
        Dims.parse(mesh)


@pytest.mark.parametrize(
    "fields, layout, mesh, words",
    [
        ({"heads": 2}, {}, "tp=4", "--heads 2 is fewer than tp=4"),
        ({"batch": 3}, {}, "dp=4", "leaves a rank 0 sequences, fewer than --microbatches 1"),
        ({"layers": 3}, {"pipeline": "interleaved-1f1b"}, "pp=2", "4 stages but only --layers 3"),
        ({}, {"sp": True}, "dp=2", "--sp splits the tp axis"),
        ({"seq": 3}, {"cp": core_named("ring")}, "cp=2", r"2 x cp = 4 chunks: --seq 3 is too short"),
        ({"heads": 3}, {"cp": core_named("ulysses")}, "cp=2,tp=2", r"a tp rank's heads \(1\) over cp=2"),
        ({}, {"recompute": "some"}, "dp=2", "--recompute must be one of none, selective, full"),
    ],
)
def test_a_composition_that_cannot_run_is_refused_naming_why(fields, layout, mesh, words):
    chunks = {"chunks": 2, "microbatches": 2} if layout.get("pipeline") == "interleaved-1f1b" else {}
    with pytest.raises(ValueError, match=words):
        Composition(**layout).validate(
            net_for("transformer", {**fields, **chunks}), Mesh.parse(mesh).size, Mesh.parse(mesh)
        )


def test_a_cp_variant_of_no_core_is_refused_naming_the_variants():
    with pytest.raises(ValueError, match="--cp must be one of ring, ulysses, got 'tree'"):
        core_named("tree")
    with pytest.raises(ValueError, match="Layout.cp takes a cp core .* got 'ring'"):
        Layout(Dims(Mesh({"cp": 2})), cp="ring")  # a name, not yet its core


@pytest.mark.parametrize("model", list(SPECS))
def test_the_step_table_gives_every_unit_a_row_each_way_by_its_role(model):
    """The step table's text is keyed by role (model/blocks.Role), each spec saying its kinds' roles: every unit of
    every registered model is a forward and a backward row; a kind the spec does not name is a LookupError."""
    net = net_for(model, {})
    kinds = spec_of(net).kinds(net)
    table = Composition().schedule(net, Mesh.parse("dp=1"))
    assert [label for label, _ in table.steps] == [
        *(f"fwd {i}" for i in range(len(kinds))),
        *(f"bwd {i}" for i in reversed(range(len(kinds)))),
        "update",
    ]
    with pytest.raises(LookupError, match=f"--model {model} has no unit kind 'router'"):
        role_of(net, "router")


def test_the_step_table_dispatches_over_ep_in_the_expert_layers_only():
    """A layer of the role EXPERTS is the one whose rows carry ep's all-to-alls (every 2nd layer here)."""
    net = net_for("llama", {"experts": 2, "top_k": 1, "moe_every": 2})
    rows = dict(Composition().schedule(net, Mesh.parse("ep=2")).steps)
    experts = [i for i, kind in enumerate(spec_of(net).kinds(net)) if role_of(net, kind) is Role.EXPERTS]
    assert experts == [1, 3]
    assert [i for i in range(len(rows) // 2) if "dispatch" in rows[f"fwd {i}"][0].text] == experts


def test_the_train_command_runs_the_follow_ups_layout_and_prints_its_schedule():
    import json
    import subprocess
    import sys

    command = [
        sys.executable,
        "-m",
        "spmd",
        "train",
        "--model",
        "transformer",
        "--mesh",
        "pp=2,fsdp=2,tp=2",
        "--sp",
        "--pipeline",
        "interleaved-1f1b",
        "--microbatches",
        "4",
        "--devices",
        "8",
    ]
    done = subprocess.run([*command, "--check", "--quiet", "--json"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["ok"] and report["bytes_match_model"] and report["memory_match_model"] and report["ranks"] == 8
    table = subprocess.run([*command, "--schedule"], capture_output=True, text=True, timeout=60).stdout
    assert "F0.1" in table and "fsdp: AG the layer before its forward" in table and "AG in, RS out" in table
    bad = subprocess.run(
        [sys.executable, "-m", "spmd", "train", "--mesh", "tp=2,pp=2", "--devices", "4"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "axes go in the order pp, dp, fsdp, ep, cp, tp" in bad.stderr


@pytest.mark.parametrize("cp", ["ring", "ulysses"])
def test_the_long_sequence_command_runs_on_threads(cp):
    """The issue's command (the README's recipe runs it under mpirun -n 8): fsdp x cp x tp, each cp variant."""
    import json
    import subprocess
    import sys

    command = [
        sys.executable,
        "-m",
        "spmd",
        "train",
        "--model",
        "transformer",
        "--mesh",
        "fsdp=2,cp=2,tp=2",
        "--cp",
        cp,
        "--devices",
        "8",
        "--check",
        "--quiet",
        "--json",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["ok"] and report["bytes_match_model"] and report["memory_match_model"]
    assert report["layout"] == f"mesh fsdp=2,cp=2,tp=2, fsdp shards as FSDP (ZeRO-3), cp {cp}, tp (Megatron)"


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_hsdp_sums_across_replicas_under_the_backward_only_with_overlap(tmp_path, overlap):
    """ZeRO-2 on dp=2 x fsdp=2: each layer's gradient is reduce-scattered over fsdp and its shard all-reduced
    over dp. With overlap both run in the background, so rank 0's sends to its dp partner (rank 2) begin while
    later layers' backward runs; with --no-overlap the scatter runs at once (its buffer is reused) and the dp
    sums after the backward."""
    import json
    import subprocess
    import sys

    trace = tmp_path / "t.json"
    command = [
        sys.executable,
        "-m",
        "spmd",
        "train",
        "--mesh",
        "dp=2,fsdp=2",
        "--zero",
        "2",
        "--devices",
        "4",
        "--layers",
        "3",
        "--hidden",
        "32",
        "--ffn",
        "64",
        "--batch",
        "32",
        "--seq",
        "1",
        "--steps",
        "1",
        "--check",
        "--quiet",
        "--trace",
        str(trace),
        *([] if overlap else ["--no-overlap"]),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    data = json.loads(trace.read_text())
    spans = [
        e for e in (data["traceEvents"] if isinstance(data, dict) else data) if e.get("ph") == "X" and e.get("pid") == 0
    ]
    backward = [e for e in spans if e["name"].startswith("B layer")]
    assert len(backward) == 3
    last_backward = max(e["ts"] for e in backward)  # layer 0's backward starts last
    to_dp_partner = [e["ts"] for e in spans if e["name"] == "send to 2" and e["ts"] > backward[0]["ts"]]
    assert to_dp_partner  # the dp all-reduces of the 3 layers' shards
    assert (min(to_dp_partner) < last_backward) == overlap
