"""The models, each written once: a block's forward and backward call the parallel context at Megatron's
conjugate points, and a plain single-device reference step checks every parallel run."""

from spmd.model.config import Net
from spmd.model.registry import MODELS

__all__ = ["MODELS", "Net"]
