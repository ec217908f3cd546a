"""Precision policies: the dtype of each kind of array a rank holds, and where mixed precision casts.

fp64 and fp32 keep everything in one dtype (the parameters are the optimizer's). fp16 and bf16 are mixed
precision (Micikevicius et al. 2018; ZeRO's setting): 16-bit parameters, activations and scratch for the
compute; fp32 master weights (a memory kind of their own, sharded as the optimizer state is), fp32 optimizer
state, and gradients in the reduction dtype (fp32 unless --reduce-dtype says otherwise: the gradients are
accumulated and reduced in it). A 16-bit parameter cannot absorb an update below its precision
(bf16(1 - 6e-4) == 1): the optimizer steps the master copy and the parameters are cast from it.
numpy has no bfloat16: it comes from ml_dtypes (the package JAX uses); numpy's float16 matmul runs without
BLAS (slow, but exact to its definition). ml_dtypes is imported when bf16 is first asked for: importing it takes
about a second, which every command and MPI rank in fp64 would pay.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PRECISIONS = ("fp64", "fp32", "fp16", "bf16")
NUMPY_DTYPES: dict[str, np.dtype] = {
    "fp64": np.dtype(np.float64),
    "fp32": np.dtype(np.float32),
    "fp16": np.dtype(np.float16),
}
NAME_OF = {"float64": "fp64", "float32": "fp32"}  # --dtype's spelling


def dtype_of(name: str) -> np.dtype:
    """The dtype a precision's name stands for (bf16: ml_dtypes', imported on first use)."""
    if name == "bf16" and name not in NUMPY_DTYPES:  # added once: the cost functions ask it per unit and rank
        import ml_dtypes

        NUMPY_DTYPES[name] = np.dtype(ml_dtypes.bfloat16)
    return NUMPY_DTYPES[name]


@dataclass(frozen=True)
class Precision:
    name: str = "fp64"
    reduce_name: str = ""  # the gradients' dtype; "" is the policy's default (fp32 when mixed)

    def __post_init__(self):
        if self.name not in PRECISIONS:
            raise ValueError(f"--precision must be one of {', '.join(PRECISIONS)}, got {self.name!r}")
        if self.reduce_name and self.reduce_name not in PRECISIONS:
            raise ValueError(f"--reduce-dtype must be one of {', '.join(PRECISIONS)}, got {self.reduce_name!r}")
        if self.reduce_name and not self.mixed and self.reduce_name != self.name:
            raise ValueError(
                f"--reduce-dtype {self.reduce_name} is for mixed precision (fp16, bf16): "
                f"--precision {self.name} keeps everything in {self.name}"
            )

    @property
    def mixed(self) -> bool:
        return self.name in ("fp16", "bf16")

    @property
    def compute(self) -> np.dtype:
        """Parameters (the compute copy), activations, scratch."""
        return dtype_of(self.name)

    @property
    def reduce(self) -> np.dtype:
        """Gradients: accumulated and reduced in this dtype."""
        return dtype_of(self.reduce_name or ("fp32" if self.mixed else self.name))

    @property
    def state(self) -> np.dtype:
        """Master weights (mixed only) and optimizer state."""
        return dtype_of("fp32") if self.mixed else self.compute

    def dtypes(self) -> dict[str, np.dtype]:
        """The dtype of each memory kind."""
        return {
            "params": self.compute,
            "master": self.state,
            "grads": self.reduce,
            "optimizer": self.state,
            "activations": self.compute,
            "buffers": self.compute,
        }

    @property
    def epsilon(self) -> float:
        """The compute dtype's machine epsilon (2^-7 for bf16, 2^-10 for fp16)."""
        if self.name != "bf16":
            return float(np.finfo(self.compute).eps)
        import ml_dtypes  # its finfo knows bfloat16 (numpy's does not)

        return float(ml_dtypes.finfo(self.compute).eps)


def native(dtype: np.dtype) -> bool:
    """Whether numpy computes in `dtype` itself (einsum, BLAS): float32 and float64."""
    return dtype in (np.dtype(np.float32), np.dtype(np.float64))
