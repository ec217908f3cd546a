"""The single-device oracle of any model: its spec's own (spmd.model.registry), the one every parallel run is
compared with."""

from __future__ import annotations

import numpy as np

from spmd.model.fields import NetFields
from spmd.model.registry import spec_of


def reference_train(net: NetFields, source=None) -> tuple[list[float], list[np.ndarray]]:
    """Every step on one device: (loss per step, final flat layers), by the model's own oracle (its spec's
    `reference`; `source`: a corpus to read the batches from, the language models')."""
    own = spec_of(net).reference
    return own(net, source) if source is not None else own(net)
