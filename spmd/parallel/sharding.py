"""What the fsdp axis shards, as data: ZeRO-1, ZeRO-2 and ZeRO-3 (FSDP) are presets, not stage numbers.

ZeRO-1 shards the optimizer state; ZeRO-2 the gradients too (reduce-scattered as each layer's backward
ends, when the step has one micro-batch); ZeRO-3 the parameters too, gathered before each layer's forward
and again before its backward (resharded after forward, FSDP2's default), or, without resharding
(reshard_after_forward=False, FSDP2's choice under pipelines), gathered once a step and kept whole until
the update: half the gathers, a whole model's parameters held. The dp axis replicates: its
gradients are all-reduced (after the fsdp reduce-scatter, when both axes are there: HSDP).
With several micro-batches the gradients accumulate whole and are reduced once, after the last one.
Beside an ep axis ZeRO-3 shards a mixture of experts' dense weights over fsdp x ep (Layout.fsdp_over_ep; the
experts over fsdp), as torchtitan's dp_shard spans the ep ranks; ZeRO-1 and 2 keep them whole over ep.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Sharding:
    name: str
    optimizer: bool
    grads: bool
    params: bool
    reshard_after_forward: bool = True  # ZeRO-3: free the gathered layer after its forward (else keep it)


ZERO = {
    1: Sharding("ZeRO-1", optimizer=True, grads=False, params=False),
    2: Sharding("ZeRO-2", optimizer=True, grads=True, params=False),
    3: Sharding("FSDP (ZeRO-3)", optimizer=True, grads=True, params=True),
}
REPLICATED = Sharding("replicated", optimizer=False, grads=False, params=False)
# (stage, reshard after forward) -> its Sharding, built once: a layout asks for it on every question the cost asks
SHARDINGS = {
    (zero, reshard): Sharding(s.name, s.optimizer, s.grads, s.params, reshard)
    for zero, s in ZERO.items()
    for reshard in (True, False)
}
