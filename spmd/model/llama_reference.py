"""The Llama-style language model on one device, written for reading, not speed: the oracle the parallel runs
are compared with. It shares nothing with the parallel blocks but the units' flat layouts and initial values
(spmd.model.llama); every gradient is written by hand.

Units: 0 the embedding E (V, h); 1..L the blocks; L+1 the final RMSNorm gain gf (h); L+2 the head W (V, h),
logits = x W^T (a tied head is E itself). Rows are the step's batch x seq tokens, sequence after sequence.
A block: n1 = RMSNorm(x; g1); q, k, v = n1 Wq, n1 Wk, n1 Wv with RoPE on q and k; causal grouped-query
attention o; h1 = x + o Wo; n2 = RMSNorm(h1; g2); y = h1 + (silu(n2 W1) * (n2 W3)) W2. The loss is the mean
over the rows of the cross-entropy of RMSNorm(y_L; gf) W^T against the targets.

Under mixed precision the parameters are cast to the compute dtype (numpy promotes as it will); RMSNorm,
RoPE and the softmaxes compute in at least float32 and hand back the dtype they were given.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from spmd.model.fields import NetFields
from spmd.model.llama import initial_unit, is_moe, unit_kinds
from spmd.model.moe_reference import moe_backward, moe_forward
from spmd.model.optimizers import adamw_reference
from spmd.model.tokens import token_batch

Cache = dict[str, Any]


class LlamaRun(NamedTuple):
    losses: list[float]  # the loss of each step, before its update
    grad_norms: list[float]  # the global gradient norm of each step, before clipping
    units: list[np.ndarray]  # the final master flat vectors, in unit order
    routing: list[np.ndarray]  # a mixture of experts' per step: pairs to each expert over the layers, then dropped
    biases: list[np.ndarray]  # --bias-balance: each layer's bias after the last step


def _wide(x: np.ndarray) -> np.ndarray:
    """x in at least float32 (16-bit floats widened; float32 and float64 as they are)."""
    return x.astype(np.float32) if x.dtype.itemsize < 4 else x


# ---------------------------------------------------------------- RMSNorm


def rms_norm(x: np.ndarray, g: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(g * xhat, xhat, r) per row: xhat = x r, r = 1 / sqrt(mean_j x_j^2 + eps)."""
    xw = _wide(x)
    r = 1 / np.sqrt(np.mean(xw * xw, axis=-1, keepdims=True) + eps)
    xhat = xw * r
    return (_wide(g) * xhat).astype(np.result_type(x, g)), xhat, r


def rms_norm_backward(dy: np.ndarray, g: np.ndarray, xhat: np.ndarray, r: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(dx, dg): dx = r (dy g - xhat mean_j(dy g xhat)), dg = sum over rows of dy xhat."""
    dyw = _wide(dy)
    dyg = dyw * _wide(g)
    dx = r * (dyg - xhat * np.mean(dyg * xhat, axis=-1, keepdims=True))
    return dx.astype(dy.dtype), np.sum(dyw * xhat, axis=0)


# ---------------------------------------------------------------- RoPE


def rope_tables(positions: np.ndarray, d: int, base: float) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin), each (positions, d/2): the angles position x theta_i, theta_i = base^(-2i/d)."""
    theta = base ** (-2 * np.arange(d // 2) / d)
    angle = np.asarray(positions, dtype=np.float64)[:, None] * theta[None, :]
    return np.cos(angle), np.sin(angle)


def rope(u: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Each head vector (last axis, d) turned half-split style: channel i with channel i + d/2,
    [u1 cos - u2 sin, u2 cos + u1 sin]. cos, sin broadcast against (..., positions, d/2)."""
    uw = _wide(u)
    c, s = cos.astype(uw.dtype), sin.astype(uw.dtype)
    half = u.shape[-1] // 2
    u1, u2 = uw[..., :half], uw[..., half:]
    return np.concatenate([u1 * c - u2 * s, u2 * c + u1 * s], axis=-1).astype(u.dtype)


def rope_backward(du: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """The gradient through rope: the rotation by minus the angle (its transpose)."""
    return rope(du, cos, -sin)


# ---------------------------------------------------------------- attention


def causal_softmax(scores: np.ndarray) -> np.ndarray:
    """Softmax over the last axis, each query seeing only keys at or before its position."""
    s = scores.shape[-1]
    masked = np.where(np.tril(np.ones((s, s), dtype=bool)), _wide(scores), -np.inf)
    e = np.exp(masked - masked.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)).astype(scores.dtype)


def softmax_backward(p: np.ndarray, dp: np.ndarray) -> np.ndarray:
    """d of the scores from d of the probabilities: p (dp - sum_j dp_j p_j)."""
    pw, dpw = _wide(p), _wide(dp)
    return (pw * (dpw - np.sum(dpw * pw, axis=-1, keepdims=True))).astype(dp.dtype)


def split_heads(t: np.ndarray, batch: int, seq: int, heads: int) -> np.ndarray:
    """(rows, heads d) -> (batch, heads, seq, d); head j is columns j d:(j+1) d."""
    return t.reshape(batch, seq, heads, -1).transpose(0, 2, 1, 3)


def merge_heads(t: np.ndarray) -> np.ndarray:
    """(batch, heads, seq, d) -> (rows, heads d), the inverse of split_heads."""
    b, a, s, d = t.shape
    return t.transpose(0, 2, 1, 3).reshape(b * s, a * d)


def attention(
    n1: np.ndarray, wq: np.ndarray, wk: np.ndarray, wv: np.ndarray, net: NetFields
) -> tuple[np.ndarray, Cache]:
    """(o (rows, a d), saved): causal grouped-query attention of the normed rows n1, RoPE on q and k;
    query head j reads kv head j // (a / kv)."""
    b, s, d, group = net.batch, net.seq, net.head_size, net.heads // net.kv
    cos, sin = rope_tables(np.arange(s), d, net.rope_base)
    q = rope(split_heads(n1 @ wq, b, s, net.heads), cos, sin)
    k = rope(split_heads(n1 @ wk, b, s, net.kv), cos, sin)
    v = split_heads(n1 @ wv, b, s, net.kv)
    k_all, v_all = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # kv head of each query head
    p = causal_softmax(q @ k_all.swapaxes(-1, -2) / np.sqrt(d))
    o = merge_heads(p @ v_all)
    return o, {"q": q, "k_all": k_all, "v_all": v_all, "p": p, "cos": cos, "sin": sin}


def group_sum(t: np.ndarray, group: int) -> np.ndarray:
    """(batch, a, seq, d) -> (batch, a / group, seq, d): each kv head's gradient summed over its query group."""
    b, a, s, d = t.shape
    return t.reshape(b, a // group, group, s, d).sum(axis=2)


def attention_backward(do: np.ndarray, saved: Cache, net: NetFields) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dq, dk, dv), each (rows, width) as n1 Wq, n1 Wk, n1 Wv, from d of the attention's output o."""
    b, s, d, group = net.batch, net.seq, net.head_size, net.heads // net.kv
    q, k_all, v_all, p, cos, sin = (saved[key] for key in ("q", "k_all", "v_all", "p", "cos", "sin"))
    dh = split_heads(do, b, s, net.heads)
    dp = dh @ v_all.swapaxes(-1, -2)
    dv_all = p.swapaxes(-1, -2) @ dh
    dscores = softmax_backward(p, dp) / np.sqrt(d)
    dq = dscores @ k_all
    dk_all = dscores.swapaxes(-1, -2) @ q
    dq = rope_backward(dq, cos, sin)
    dk = rope_backward(group_sum(dk_all, group), cos, sin)
    dv = group_sum(dv_all, group)
    return merge_heads(dq), merge_heads(dk), merge_heads(dv)


# ---------------------------------------------------------------- the block


def sigmoid(z: np.ndarray) -> np.ndarray:
    """1 / (1 + exp(-z)), written with tanh so that no exp overflows."""
    return 0.5 * (1 + np.tanh(0.5 * z))


def views(flat: np.ndarray, net: NetFields, moe: bool):
    """The block's (g1, Wq, Wk, Wv, Wo, g2, W1, W3, W2) views of its flat vector; of a mixture of experts (`moe`)
    (g1, Wq, Wk, Wv, Wo, g2, Wr, W1, W3, W2), the experts' stacked."""
    h, f, e, q, kv = net.hidden, net.ffn, net.experts, net.heads * net.head_size, net.kv * net.head_size
    ffn = ((h, e), (e, h, f), (e, h, f), (e, f, h)) if moe else ((h, f), (h, f), (f, h))
    arrays, at = [], 0
    for shape in ((h,), (h, q), (h, kv), (h, kv), (q, h), (h,), *ffn):  # written here, not read from the model
        arrays.append(flat[at : at + int(np.prod(shape))].reshape(shape))
        at += int(np.prod(shape))
    return tuple(arrays)


def block_forward(
    x: np.ndarray, flat: np.ndarray, net: NetFields, bias=None, moe: bool = False
) -> tuple[np.ndarray, Cache]:
    """(y, saved): y = h1 + (silu(n2 W1) * (n2 W3)) W2, h1 = x + attention(RMSNorm(x; g1)) Wo, n2 = RMSNorm(h1; g2)."""
    g1, wq, wk, wv, wo, g2, *ffn = views(flat, net, moe)
    n1, xhat1, r1 = rms_norm(x, g1, net.norm_eps)
    o, att = attention(n1, wq, wk, wv, net)
    h1 = x + o @ wo
    n2, xhat2, r2 = rms_norm(h1, g2, net.norm_eps)
    common = {"n1": n1, "xhat1": xhat1, "r1": r1, "att": att, "o": o, "n2": n2, "xhat2": xhat2, "r2": r2}
    if moe:  # the mixture of experts in the FFN's place
        y, routed = moe_forward(n2, ffn, net, bias)
        return h1 + y, {**common, "moe": routed}
    w1, w3, w2 = ffn
    z, u = n2 @ w1, n2 @ w3
    sz = sigmoid(z)
    m = z * sz * u
    y = h1 + m @ w2
    return y, {**common, "z": z, "u": u, "sz": sz, "m": m}


def block_backward(dy: np.ndarray, flat: np.ndarray, saved: Cache, net: NetFields) -> tuple[np.ndarray, np.ndarray]:
    """(dx, the block's flat gradient) from dy, d of the block's output."""
    moe = "moe" in saved
    g1, wq, wk, wv, wo, g2, *ffn = views(flat, net, moe)
    c = saved
    if moe:
        dn2, dffn = moe_backward(dy, c["n2"], ffn, c["moe"], net)
    else:  # the MLP: y = h1 + m W2, m = silu(z) u
        w1, w3, w2 = ffn
        dw2 = c["m"].T @ dy
        dm = dy @ w2.T
        silu_z, silu_grad = c["z"] * c["sz"], c["sz"] * (1 + c["z"] * (1 - c["sz"]))
        dz, du = dm * c["u"] * silu_grad, dm * silu_z
        dw1, dw3 = c["n2"].T @ dz, c["n2"].T @ du
        dn2, dffn = dz @ w1.T + du @ w3.T, [dw1, dw3, dw2]
    dh1_norm, dg2 = rms_norm_backward(dn2, g2, c["xhat2"], c["r2"])
    dh1 = dy + dh1_norm
    # attention: h1 = x + o Wo
    dwo = c["o"].T @ dh1
    dq, dk, dv = attention_backward(dh1 @ wo.T, c["att"], net)
    n1 = c["n1"]
    dwq, dwk, dwv = n1.T @ dq, n1.T @ dk, n1.T @ dv
    dx_norm, dg1 = rms_norm_backward(dq @ wq.T + dk @ wk.T + dv @ wv.T, g1, c["xhat1"], c["r1"])
    pieces = (dg1, dwq, dwk, dwv, dwo, dg2, *dffn)
    grad = np.empty(flat.size, dtype=np.result_type(*pieces))
    for view, piece in zip(views(grad, net, moe), pieces, strict=True):
        view[...] = piece
    return dh1 + dx_norm, grad


# ---------------------------------------------------------------- the model


def cross_entropy(logits: np.ndarray, targets: np.ndarray) -> tuple[float, np.ndarray]:
    """(mean over rows of logsumexp(logits) - logits[target], its gradient (softmax - onehot) / rows)."""
    z = _wide(logits)
    rows = np.arange(z.shape[0])
    top = z.max(axis=1, keepdims=True)
    lse = top + np.log(np.exp(z - top).sum(axis=1, keepdims=True))
    loss = np.sum(lse[:, 0] - z[rows, targets]) / z.shape[0]
    dz = np.exp(z - lse)
    dz[rows, targets] -= 1
    return float(loss), (dz / z.shape[0]).astype(logits.dtype)


def loss_and_grads(
    net: NetFields,
    units: list[np.ndarray],
    ids: np.ndarray,
    targets: np.ndarray,
    dtype: Any = np.float64,
    routing: list | None = None,
    biases: list | None = None,
) -> tuple[float, list[np.ndarray]]:
    """(loss, gradient of each unit) of one batch, the units cast to `dtype` (float64: the oracle). A tied
    model's embedding and head each get their own contribution here (units[L+2] is read as the head). With
    experts, `routing` gets an (L, E + 1) array: per layer the batch's pairs to each expert, then the pairs
    dropped; `biases` (one per layer) choose with the scores (--bias-balance)."""
    v, h, layers = net.vocab, net.hidden, net.layers
    params = [np.asarray(p).astype(dtype) for p in units]
    table, gain, head = params[0].reshape(v, h), params[layers + 1], params[layers + 2].reshape(v, h)
    x = table[ids]
    saved = []
    for layer, flat in enumerate(params[1 : layers + 1]):
        x, cache = block_forward(x, flat, net, None if biases is None else biases[layer], is_moe(net, layer))
        saved.append(cache)
    n, xhat, r = rms_norm(x, gain, net.norm_eps)
    if net.experts and routing is not None:
        routing.append(
            np.stack(
                [
                    np.r_[
                        np.bincount(c["moe"]["choice"].ravel(), minlength=net.experts),
                        np.count_nonzero(~c["moe"]["keep"]),
                    ]
                    for c in saved
                    if "moe" in c
                ]
            )
        )
    loss, dlogits = cross_entropy(n @ head.T, targets)
    d_head = dlogits.T @ n
    dx, d_gain = rms_norm_backward(dlogits @ head, gain, xhat, r)
    block_grads = []
    for flat, cache in zip(reversed(params[1 : layers + 1]), reversed(saved), strict=True):
        dx, grad = block_backward(dx, flat, cache, net)
        block_grads.append(grad)
    d_table = np.zeros((v, h), dtype=_wide(dx).dtype)
    np.add.at(d_table, ids, dx)  # a token used by several rows sums their gradients
    return loss, [d_table.ravel(), *reversed(block_grads), d_gain, d_head.ravel()]


# ---------------------------------------------------------------- training


def trained_units(net: NetFields) -> list[int]:
    """The units the optimizer steps: all, but a tied head is the embedding (stepped once, as unit 0)."""
    head = len(unit_kinds(net)) - 1
    return [u for u in range(head + 1) if not (net.tie_embeddings and u == head)]


def combined_grads(net: NetFields, grads: list[np.ndarray]) -> list[np.ndarray]:
    """The gradients the optimizer applies, one per trained unit: a tied embedding's is its own plus the head's."""
    grads = list(grads)
    if net.tie_embeddings:
        grads[0] = grads[0] + grads[-1]
    return [grads[u] for u in trained_units(net)]


def global_norm(grads: list[np.ndarray]) -> float:
    """sqrt of the sum of squares of every gradient element, in float64."""
    return float(np.sqrt(sum(np.sum(np.square(g.astype(np.float64))) for g in grads)))


def clip_scale(net: NetFields, norm: float) -> float:
    """The factor every gradient is multiplied by: min(1, clip / (norm + 1e-6)), 1 when clipping is off."""
    return min(1.0, net.clip_grad / (norm + 1e-6)) if net.clip_grad > 0 else 1.0


def step_batch(net: NetFields, source, step: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids, targets) of step `step` (from 0): `source`'s (a prepared corpus) or the run's synthetic tokens."""
    batch = (
        source.batch_data(step) if source is not None else token_batch(net.vocab, net.batch, net.seq, net.seed, step)
    )
    return np.asarray(batch[0]), np.asarray(batch[1])


def reference_run(net: NetFields, source=None) -> LlamaRun:
    """Every step on one device: forward, backward, global-norm clipping, the optimizer on the master weights.
    The batches are `source`'s (a prepared corpus: spmd.data.loader.Corpus) or the net's synthetic tokens."""
    policy = net.policy
    count = len(unit_kinds(net))
    master = [initial_unit(net, u).astype(policy.state) for u in range(count)]
    trained = trained_units(net)
    state = {u: [np.zeros_like(master[u]) for _ in range(2 if net.optimizer == "adamw" else 1)] for u in trained}
    losses, norms, routing = [], [], []  # type: list[float], list[float], list[np.ndarray]
    biases = [np.zeros(net.experts) for _ in range(net.layers)]
    for step in range(1, net.steps + 1):
        ids, targets = step_batch(net, source, step - 1)
        loss, grads = loss_and_grads(
            net,
            master,
            ids,
            targets,
            dtype=policy.compute,
            routing=routing,
            biases=biases if net.bias_balance else None,
        )
        if net.bias_balance:  # DeepSeek-V3: from the step's loads, for the next step's choices
            layers = [layer for layer in range(net.layers) if is_moe(net, layer)]
            for layer, load in zip(layers, routing[-1][:, :-1], strict=True):
                biases[layer] += net.bias_balance * np.sign(load.mean() - load)
        applied = [g.astype(policy.reduce) for g in combined_grads(net, grads)]
        norm = global_norm(applied)
        scale = clip_scale(net, norm)
        losses.append(loss)
        norms.append(norm)
        for u, grad in zip(trained, applied, strict=True):
            grad = grad * np.asarray(scale, dtype=grad.dtype) if scale < 1 else grad
            p = master[u]
            if net.optimizer == "adamw":
                adamw_reference(p, grad, state[u][0], state[u][1], step, net.adamw_at(step))
            else:
                velocity = state[u][0]
                velocity[...] = net.momentum * velocity + net.rate_at(step) * grad
                p -= velocity
        if net.tie_embeddings:
            master[-1] = master[0].copy()
    return LlamaRun(losses, norms, master, [r.sum(axis=0) for r in routing], biases)


def reference_train(net: NetFields, source=None) -> tuple[list[float], list[np.ndarray]]:
    """(loss per step, final master units): reference_run without the gradient norms."""
    run = reference_run(net, source)
    return run.losses, run.units
