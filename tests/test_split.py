"""spmd.split: a rank with cores to itself splits its attention and its SiLU and GELU over them, and gets the
same bits a rank of one core computes."""

import time

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from spmd import split
from spmd.model import lm_kernels as lm
from spmd.model.attention import SoftmaxAttention
from spmd.model.blocks import Buffers

RNG = np.random.default_rng(5)


def rows(shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


def kernels(z):
    """Every split kernel of the LM once (SiLU's and GELU's), into fresh outputs."""
    out = {name: np.empty_like(z) for name in ("silu", "act", "keep", "gelu", "gelu_grad", "tmp")}
    lm.silu(z, out["silu"])
    lm.silu_parts(z, out["act"], out["keep"])
    lm.gelu(z, out["gelu"])
    lm.gelu_grad(z, out["gelu_grad"], out["tmp"])
    return out


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_row_kernels_split_give_the_same_bits(dtype, monkeypatch):
    calls = []
    run = split.run
    monkeypatch.setattr(split, "run", lambda tasks: (calls.append(len(tasks)), run(tasks)))
    z = rows((1031, 96), dtype)  # rows no core count divides
    whole = kernels(z)
    assert not calls
    with split.own_cores(3):
        pieces = kernels(z)
    assert calls and set(calls) == {3}  # every kernel split three ways
    for name, array in whole.items():
        assert np.array_equal(array, pieces[name]), name


def test_small_arrays_do_not_split(monkeypatch):
    calls = []
    monkeypatch.setattr(split, "run", lambda tasks: calls.append(tasks))
    z = rows((10, 10))
    with split.own_cores(2):
        lm.silu(z, np.empty_like(z))
    assert not calls


def test_a_failing_piece_raises_after_every_piece_ends():
    ended = []

    def piece(i):
        def work():
            if i == 1:
                raise ValueError("piece 1 failed")
            time.sleep(0.05 * i)  # the last to end is after the failure
            ended.append(i)

        return work

    with split.own_cores(3), pytest.raises(ValueError, match="piece 1 failed"):
        split.run([piece(i) for i in range(3)])
    assert sorted(ended) == [0, 2]
    assert split.width() == 1  # own_cores has ended


def attention(att: SoftmaxAttention, sequences: int, keep: bool):
    """One forward and backward of attention over `sequences` sequences: (o, dq, dk, dv)."""
    width, seq = att.heads * att.d, att.seq
    s = Buffers(**{k: np.zeros(v, np.float32) for k, v in att.scratch_shapes(sequences).items()})
    att.prepare(s)
    local = np.random.default_rng(1)
    q, k, v, do = (local.standard_normal((sequences * seq, width)).astype(np.float32) for _ in range(4))
    o, dq, dk, dv = (np.zeros_like(q) for _ in range(4))
    probs = np.zeros(att.probs_shape(sequences)["p"], np.float32) if keep else None
    att.attend(q, k, v, o, probs, s)
    att.attend_backward(q, k, v, do, dq, dk, dv, probs, s)
    return o, dq, dk, dv


@pytest.mark.parametrize(
    "sequences, seq, block, keep",
    [(6, 32, None, True), (5, 48, 16, False), (1, 32, None, True), (7, 40, 16, True)],
)
def test_attention_split_by_sequences_equals_one_core(sequences, seq, block, keep, monkeypatch):
    """Each piece a core, with its share of the scratch: the bits of one BLAS thread, unsplit (a one-core rank's).
    Query blocks (block < seq), recomputed or kept probabilities, an odd count, and one sequence (whole)."""
    att = SoftmaxAttention(heads=4, head_size=8, seq=seq, keep_probs=keep, block=block)
    with threadpool_limits(1, "blas"):
        alone = attention(att, sequences, keep)
    calls = []
    run = split.run
    monkeypatch.setattr(split, "run", lambda tasks: (calls.append(len(tasks)), run(tasks)))
    with split.own_cores(2):
        cut = attention(att, sequences, keep)
    assert bool(calls) == (sequences > 1)
    for a, b in zip(alone, cut, strict=True):
        assert np.array_equal(a, b)
