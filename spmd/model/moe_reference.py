"""The mixture of experts on one device, written for reading: the oracle spmd.model.moe is compared with.

It shares nothing with the parallel layer but the rules (spmd.model.moe's docstring): top_k by score, a tie to
the lower expert index; gates not renormalized unless asked; in each sequence an expert takes at most C pairs,
those of the earliest rows; the balancing loss alpha E sum_i f_i P_i per sequence, averaged over the step's
sequences, f_i counted before capacity; DeepSeek-V3's bias, bias_i += gamma sign(mean load - load_i) after each
step from the step's pairs per expert (before capacity), per layer. Every loop here is over experts, rows or
sequences, as the rule says.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import numpy as np

Cache = dict[str, Any]


def router_scores(logits: np.ndarray, router: str) -> np.ndarray:
    if router == "softmax":
        e = np.exp(logits - logits.max(axis=1, keepdims=True))
        return e / e.sum(axis=1, keepdims=True)
    return 0.5 * (1 + np.tanh(0.5 * logits))


def top_choices(scores: np.ndarray, k: int) -> np.ndarray:
    """(rows, k): per row the k experts of highest score, ties to the lower index (a sort by (-score, index))."""
    chosen = []
    for row in scores.tolist():
        ranked = sorted(range(len(row)), key=lambda e, row=row: (-row[e], e))  # type: ignore[misc]
        chosen.append(ranked[:k])
    return np.array(chosen, dtype=np.int64).reshape(len(scores), k)


def kept_pairs(choice: np.ndarray, seq: int, experts: int, factor: float, taken: list[int] | None = None) -> np.ndarray:
    """(rows, k) bools: a pair is kept unless its expert already took C pairs of earlier rows of its sequence.
    `taken` (a decoder reading one sequence in pieces): the pairs each expert took of the earlier pieces, updated."""
    keep = np.ones(choice.shape, dtype=bool)
    if factor <= 0:
        return keep
    limit = math.ceil(Fraction(repr(factor)) * seq * choice.shape[1] / experts)  # CF exact as written
    for start in range(0, len(choice), seq):
        counts = [0] * experts if taken is None else taken
        for row in range(start, min(start + seq, len(choice))):
            for j, e in enumerate(choice[row].tolist()):
                keep[row, j] = counts[e] < limit
                counts[e] += 1
    return keep


def activation(z: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(act(z), act'(z)) of the experts' gate: silu z sigmoid(z), or GELU's tanh approximation
    0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3)))."""
    if name == "gelu":
        c = np.sqrt(2 / np.pi)
        t = np.tanh(c * (z + 0.044715 * z**3))
        return 0.5 * z * (1 + t), 0.5 * (1 + t) + 0.5 * z * (1 - t**2) * c * (1 + 3 * 0.044715 * z**2)
    s = 0.5 * (1 + np.tanh(0.5 * z))
    return z * s, s * (1 + z * (1 - s))


def moe_forward(
    x: np.ndarray, weights, net, bias: np.ndarray | None = None, taken: list[int] | None = None
) -> tuple[np.ndarray, Cache]:
    """(y, saved) of the block's (Wr, W1, W3, W2): y_t = sum over t's kept pairs (t, e) of
    weight_te W2_e (act(x_t W1_e) * (x_t W3_e)), act silu or gelu (--expert-activation). A balancing `bias`
    (--bias-balance) is added to the scores to choose, not to the gates. `taken`: see kept_pairs (x then continues
    one sequence)."""
    wr, w1, w3, w2 = weights
    wide = np.promote_types(x.dtype, np.float32)
    scores = router_scores(x.astype(wide) @ wr.astype(wide), net.router)
    choice = top_choices(scores if bias is None else scores + bias, net.top_k)
    gate = np.take_along_axis(scores, choice, axis=1)
    keep = kept_pairs(choice, net.seq, net.experts, net.capacity_factor, taken)
    total = gate.sum(axis=1, keepdims=True)
    weight = (gate / total if net.renormalize else gate) * keep
    y = np.zeros_like(x)
    experts = []
    for e in range(net.experts):
        rows, slots = np.nonzero(choice == e)
        z, u = x[rows] @ w1[e], x[rows] @ w3[e]
        act, slope = activation(z, net.expert_activation)
        out = (act * u) @ w2[e]
        np.add.at(y, rows, weight[rows, slots, None].astype(x.dtype) * out)
        experts.append({"rows": rows, "slots": slots, "z": z, "u": u, "act": act, "slope": slope, "out": out})
    aux = balance_loss(scores, choice, net) if net.aux_loss else 0.0
    return y, {
        "aux": aux,
        "scores": scores,
        "choice": choice,
        "gate": gate,
        "keep": keep,
        "total": total,
        "weight": weight,
        "experts": experts,
    }


def balance_fractions(choice: np.ndarray, seq: int, experts: int) -> np.ndarray:
    """(rows, E): for each row its sequence's f_i, the fraction of the sequence's pairs routed to expert i."""
    f = np.zeros((len(choice), experts))
    for start in range(0, len(choice), seq):
        counts = np.bincount(choice[start : start + seq].ravel(), minlength=experts)
        f[start : start + seq] = counts / choice[start : start + seq].size
    return f


def balance_loss(scores: np.ndarray, choice: np.ndarray, net) -> float:
    """alpha E sum_i f_i P_i per sequence, averaged over the step's sequences (net.batch)."""
    f = balance_fractions(choice, net.seq, net.experts)
    total = 0.0
    for start in range(0, len(scores), net.seq):
        total += float(np.sum(f[start] * scores[start : start + net.seq].mean(axis=0)))
    return net.aux_loss * net.experts * total / net.batch


def moe_backward(dy: np.ndarray, x: np.ndarray, weights, c: Cache, net):
    """(dx, [dWr, dW1, dW3, dW2]) from dy; the balancing loss's gradient is added at the scores."""
    wr, w1, w3, w2 = weights
    dx = np.zeros_like(x)
    dw1, dw3, dw2 = np.zeros_like(w1), np.zeros_like(w3), np.zeros_like(w2)
    dweight = np.zeros(c["choice"].shape)
    for e, ex in enumerate(c["experts"]):
        rows, slots = ex["rows"], ex["slots"]
        w = c["weight"][rows, slots, None]
        dweight[rows, slots] = np.sum(dy[rows] * ex["out"], axis=1)
        m = ex["act"] * ex["u"]
        dout = w * dy[rows]
        dw2[e] = m.T @ dout
        dm = dout @ w2[e].T
        dz = dm * ex["u"] * ex["slope"]
        du = dm * ex["act"]
        dw1[e], dw3[e] = x[rows].T @ dz, x[rows].T @ du
        np.add.at(dx, rows, dz @ w1[e].T + du @ w3[e].T)
    dgate = dweight * c["keep"]
    if net.renormalize:  # weight_j = gate_j / sum(gate)
        total = c["total"]
        dgate = dgate / total - np.sum(dgate * c["gate"], axis=1, keepdims=True) / total**2
    scores = c["scores"]
    dscores = np.zeros_like(scores)
    np.put_along_axis(dscores, c["choice"], dgate, axis=1)
    if net.aux_loss:  # alpha E mean_sequences sum_i f_i mean_rows(p_ti)
        dscores += (
            net.aux_loss * net.experts / (net.seq * net.batch) * balance_fractions(c["choice"], net.seq, net.experts)
        )
    if net.router == "softmax":
        dlogits = scores * (dscores - np.sum(dscores * scores, axis=1, keepdims=True))
    else:
        dlogits = dscores * scores * (1 - scores)
    dwr = x.T.astype(dlogits.dtype) @ dlogits
    dx = dx + (dlogits @ wr.T.astype(dlogits.dtype)).astype(x.dtype)
    return dx, [dwr, dw1, dw3, dw2]
