"""Every unit kind's parameter table (spmd.model.params) against views written independently of it.

The oracles' own views (dense_reference, llama_reference, gpt2_reference) cut the whole unit; the splits each
model's docstring states cut it per tensor (and ep) rank; the table's derived sizes, views, tensor slices and
first holders must agree with them for every kind over tp 1, 2, 4 (and ep 2 for a mixture of experts).
"""

import numpy as np
import pytest

from spmd.model import Net, params
from spmd.model.attention import LocalAttention
from spmd.model.dense_reference import mlp_views, transformer_views
from spmd.model.gpt2_reference import block_views as gpt2_views
from spmd.model.llama import tensor_share
from spmd.model.llama_reference import views as llama_views
from spmd.model.registry import spec_of

LM = dict(layers=2, hidden=8, ffn=12, heads=4, vocab=11, seq=5, batch=2)
NETS = {
    "mlp": dict(model="mlp", layers=2, hidden=8, ffn=12),
    "transformer": dict(model="transformer", layers=2, hidden=8, ffn=12, heads=4),
    "llama": dict(model="llama", **LM),
    "llama-gqa": dict(model="llama", **LM, kv_heads=2),
    "llama-moe": dict(model="llama", **LM, experts=4, top_k=2, moe_every=2, tie_embeddings=True),
    "gpt2-tied": dict(model="gpt2", **LM),
    "gpt2-untied": dict(model="gpt2", **LM, tie_embeddings=False),
}
# the docstrings' splits, by piece name: (axis, the share's range) per split axis; every other piece whole
SPLITS = {
    **dict.fromkeys(("wq", "bq"), ((-1, "heads"),)),
    "wo": ((0, "heads"),),
    **dict.fromkeys(("w1", "w3", "b1"), ((-1, "ffn"),)),
    "w2": ((-2, "ffn"),),
    **dict.fromkeys(("embedding", "lm_head"), ((0, "vocab"),)),
}
EXPERTS = ("w1", "w3", "w2")  # stacked experts' weights: axis 0 is over ep


def net_of(name: str) -> Net:
    return Net(**NETS[name])


def llama_block(net: Net, kind: str, flat: np.ndarray) -> tuple[np.ndarray, ...]:
    return llama_views(flat, net, kind == "moe")


BLOCK_ORACLES = {
    "mlp": lambda net, kind, flat: mlp_views(flat, net.hidden, net.ffn),
    "transformer": lambda net, kind, flat: transformer_views(flat, net.hidden, net.ffn),
    **dict.fromkeys(("llama", "llama-gqa", "llama-moe"), llama_block),
    **dict.fromkeys(
        ("gpt2-tied", "gpt2-untied"), lambda net, kind, flat: gpt2_views(flat, net.hidden, net.ffn, net.hidden)
    ),
}


def reference_views(name: str, net: Net, kind: str, flat: np.ndarray) -> tuple[np.ndarray, ...]:
    """The whole unit's pieces as the oracles cut them (the ends by the models' docstrings: a norm's vectors of
    h, the vocabulary's rows (V, h) and any learned positions (seq, h) after them)."""
    h, v = net.hidden, net.vocab
    if kind in ("block", "moe"):
        return BLOCK_ORACLES[name](net, kind, flat)
    if kind == "norm":
        return tuple(np.split(flat, flat.size // h))
    table = flat[: v * h].reshape(v, h)
    return (table, flat[v * h :].reshape(net.seq, h)) if flat.size > v * h else (table,)


def ranks(net: Net, t: int) -> list[tuple[int, int, int]]:
    """(j, ep, e) of every tensor rank, and with experts of each of 2 ep ranks."""
    return [(j, ep, e) for ep in ((1, 2) if net.experts else (1,)) for e in range(ep) for j in range(t)]


def expected_slice(name: str, whole: np.ndarray, net: Net, t: int, j: int, ep: int, e: int) -> np.ndarray:
    r, d = tensor_share(net, t, j, ep, e), net.head_size
    columns = {"heads": (r["heads"][0] * d, r["heads"][1] * d), "kv": (r["kv"][0] * d, r["kv"][1] * d)}
    bounds = {**columns, "ffn": r["ffn"], "vocab": r["vocab"], "experts": r["experts"]}
    splits = SPLITS.get(name, ())
    if name in ("wk", "wv", "bk", "bv"):  # the Llama's kv heads; GPT-2's and the transformer's: all heads are kv
        splits = ((-1, "kv"),)
    if name in EXPERTS and whole.ndim == 3:
        splits = ((0, "experts"), *splits)
    index = [slice(None)] * whole.ndim
    for axis, key in splits:
        index[axis] = slice(*bounds[key])
    return whole[tuple(index)]


CASES = [(name, t) for name in NETS for t in (1, 2, 4) if not (name == "llama-gqa" and t == 4)]


@pytest.mark.parametrize("name,t", CASES)
def test_each_ranks_views_sizes_and_slice_are_the_whole_units_cut(name, t):
    """Per kind and rank: the slice's size is the unit's size under its share; the slice laid out by its share's
    table has, piece by piece, the oracle's view of the whole cut as the model's docstring says."""
    net = net_of(name)
    spec = spec_of(net)
    for kind in sorted(set(spec.kinds(net))):
        table = spec.table(net, kind)
        whole = np.arange(params.size(table))
        oracle = reference_views(name, net, kind, whole)
        assert [p.shape for p in table] == [v.shape for v in oracle], kind
        by_name = {p.name: view for p, view in zip(table, oracle, strict=True)}
        for j, ep, e in ranks(net, t):
            share = spec.share(net, t, j, ep, e)
            index = spec.tensor_slice(net, kind, t, j, ep, e)
            layout = params.Flat(spec.local(net, kind, share))
            assert index.size == layout.size == spec.unit_size(net, kind, share), (kind, j, e)
            for piece, view in layout.named(index).items():
                np.testing.assert_array_equal(view, expected_slice(piece, by_name[piece], net, t, j, ep, e))


@pytest.mark.parametrize("name", NETS)
def test_pieces_cover_the_flat_vector_exactly_once(name):
    """The table's pieces tile [0, size) in order, size the unit's initial vector's; its dense prefix ends where
    a mixture of experts' experts begin."""
    net = net_of(name)
    spec = spec_of(net)
    for unit, kind in enumerate(spec.kinds(net)):
        layout = params.Flat(spec.table(net, kind))
        starts = [start for start, _, _ in layout.runs]
        stops = [stop for _, stop, _ in layout.runs]
        assert starts == [0, *stops[:-1]] and stops[-1] == layout.size == spec.initial_unit(net, unit).size
        names = [p.name for p in layout.table]
        experts_start = starts[names.index("w1")] if kind == "moe" else layout.size
        assert spec.dense_prefix(net, kind, spec.share(net, 1, 0)) == experts_start, kind


@pytest.mark.parametrize("name,t", CASES)
def test_first_holders_save_every_element_once_as_the_lower_ranks_rule(name, t):
    """Over every (ep, tp) rank, the elements each is the first holder of cover the whole unit exactly once
    (the checkpoint's coverage), and are the elements no lower (ep, tp) rank holds."""
    net = net_of(name)
    spec = spec_of(net)
    for kind in sorted(set(spec.kinds(net))):
        for ep in (1, 2) if net.experts else (1,):
            held = {(e, j): spec.tensor_slice(net, kind, t, j, ep, e) for e in range(ep) for j in range(t)}
            count = np.zeros(params.size(spec.table(net, kind)), dtype=int)
            for (e, j), index in held.items():
                mine = spec.first_holders(net, kind, j, e, over_ep=False)[index]
                lower = [held[k] for k in held if k < (e, j)]
                expected = ~np.isin(index, np.concatenate(lower)) if lower else np.ones(index.size, bool)
                np.testing.assert_array_equal(mine, expected)
                np.add.at(count, index[mine], 1)
            assert (count == 1).all(), (kind, ep)


def test_over_ep_each_ep_rank_is_first_of_its_own_shards():
    """FSDP over ep: the dense weights' shards are each one ep rank's, so only the tp rule is left."""
    net = net_of("llama-moe")
    spec = spec_of(net)
    for j in range(2):
        lead = spec.first_holders(net, "moe", j, 0, over_ep=False)
        assert (spec.first_holders(net, "moe", j, 1, over_ep=True) == lead).all()
        assert not (spec.first_holders(net, "moe", j, 1, over_ep=False) == lead).all()


@pytest.mark.parametrize("name,t", CASES)
def test_the_units_code_lays_out_its_shares_table(name, t):
    """Each unit the spec builds for a rank has its share's size and views of its share's shapes."""
    net = net_of(name)
    spec = spec_of(net)
    for kind in sorted(set(spec.kinds(net))):
        for j, ep, e in ranks(net, t):
            share = spec.share(net, t, j, ep, e)
            core = LocalAttention(share.heads, share.head_size, net.seq, True) if spec.has_attention else None
            unit = spec.unit(net, kind, share, False, core, j, t)
            assert unit.size == spec.unit_size(net, kind, share)
            shapes = [p.shape for p in spec.local(net, kind, share)]
            assert [v.shape for v in unit.views(np.zeros(unit.size))] == shapes


def test_a_piece_refuses_a_split_it_cannot_have():
    with pytest.raises(ValueError, match="a split per axis"):
        params.Piece("w", (2, 3), ("ffn",))
    with pytest.raises(ValueError, match="unknown split"):
        params.Piece("w", (2, 3), (None, "rows"))
