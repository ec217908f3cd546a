"""Real training state: the optimizers and the precision policies, beyond the composition tests' runs."""

import ml_dtypes
import numpy as np
import pytest

from spmd.model import Net
from spmd.model.optimizers import AdamW, adamw_reference
from spmd.model.precision import Precision
from spmd.parallel.strategy import Composition
from spmd.transport.group import Group
from spmd.transport.mesh import Mesh
from spmd.transport.threads import run_threads

BF16 = np.dtype(ml_dtypes.bfloat16)


def test_a_bf16_parameter_cannot_absorb_a_small_update_which_is_why_the_master_copy_exists():
    """field-notes B9: bf16(1 - 6e-4) == 1, so 100 such steps on a bf16 weight leave it at 1; the fp32 master
    moves to 0.94000196, which casts to 0.941406."""
    weight, master = np.ones(1, BF16), np.ones(1, np.float32)
    for _ in range(100):
        weight -= np.array([6e-4], BF16)
        master -= np.float32(6e-4)
    assert weight[0] == 1
    assert master[0] == np.float32(0.94000196)
    assert float(master.astype(BF16)[0]) == 0.94140625


def mixed_run(comm, rank, lr):
    net = Net(model="mlp", layers=2, hidden=8, ffn=16, batch=4, seq=2, steps=20, precision="bf16", lr=lr, momentum=0.0)
    strategy, world = Composition(), Group.world(comm, rank)
    mesh = strategy.validate(net, world.size, Mesh.parse("dp=2"))
    engine = strategy.build(world, mesh, net)
    first = np.stack(engine.state.master)
    for step in range(net.steps):
        engine.step(*net.batch_data(step))
    return first, np.stack(engine.state.master), np.stack(engine.state.params)


def test_the_engine_steps_the_fp32_master_and_casts_the_bf16_parameters_from_it():
    """Updates below bf16's resolution: each alone would round away on a bf16 weight, but the master adds them up,
    and the parameters, always exactly its cast, move."""
    for first, master, params in run_threads(2, lambda comm, rank: mixed_run(comm, rank, 1e-7)):
        np.testing.assert_array_equal(params, master.astype(BF16))
        half_ulp = 2.0 ** (np.floor(np.log2(np.abs(first))) - 8)
        each_rounds_away = np.abs(master - first) / 20 < half_ulp
        assert np.any((params != first.astype(BF16)) & each_rounds_away)


def test_adamw_in_place_equals_the_plain_formula():
    rng = np.random.default_rng(0)
    opt = AdamW(lr=1e-2, weight_decay=0.1)
    p, m, v = rng.standard_normal(50), np.zeros(50), np.zeros(50)
    p2, m2, v2 = p.copy(), m.copy(), v.copy()
    for t in range(1, 6):
        g = rng.standard_normal(50)
        opt.step(p, g.copy(), m, v, np.empty(50), t)
        adamw_reference(p2, g, m2, v2, t, opt)
    np.testing.assert_allclose(p, p2, rtol=1e-14)
    np.testing.assert_allclose(v, v2, rtol=1e-14)


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"optimizer": "lamb"}, "--optimizer must be one of sgd, adamw"),
        ({"precision": "fp8"}, "--precision must be one of fp64, fp32, fp16, bf16"),
        ({"precision": "fp32", "reduce_dtype": "bf16"}, "--reduce-dtype bf16 is for mixed precision"),
        ({"integers": True, "optimizer": "adamw"}, "--integers needs --optimizer sgd"),
        ({"integers": True, "precision": "bf16"}, "--integers needs --optimizer sgd"),
        ({"weight_decay": 1.5}, r"--weight-decay must be in \[0, 1\)"),
    ],
)
def test_a_bad_optimizer_or_precision_is_refused_naming_the_flag(fields, words):
    with pytest.raises(ValueError, match=words):
        Net(**fields)


def test_the_memory_per_parameter_is_the_policys():
    """DP, one rank: bf16 params 2 + fp32 master 4 + two fp32 moments 8 + grads 4 (fp32 reduction) or 2."""
    for reduce, grads in (("", 4), ("bf16", 2)):
        net = Net(
            model="mlp",
            layers=2,
            hidden=8,
            ffn=16,
            batch=2,
            seq=1,
            precision="bf16",
            optimizer="adamw",
            reduce_dtype=reduce,
        )
        memory = Composition().cost(net, Mesh.parse("dp=1")).memory[0]
        count = net.layers * net.layer_size
        assert (memory["params"], memory["master"], memory["optimizer"], memory["grads"]) == (
            2 * count,
            4 * count,
            8 * count,
            grads * count,
        )
    assert Precision("bf16").dtypes()["params"] == BF16
