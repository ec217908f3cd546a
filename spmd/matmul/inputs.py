"""Where a rank's blocks of A and B come from: generated from a seed, or .npy files.

Either way a rank makes or reads only the blocks it owns, so no rank holds
all of A or B (rank 0 does only when asked to check the result).
"""

import math
from dataclasses import dataclass, field

import numpy as np

from spmd.transport.comm import is_numeric

TILE = 256  # generated matrices are made of TILE x TILE tiles, each seeded alone


class InputError(ValueError):
    """An input matrix cannot be used; the message says which and why."""


def describe(inputs) -> str:
    """'A 10x6 float64, B 6x7 float64': what a rank's inputs are, for comparing ranks."""
    return ", ".join(
        f"{name} {shape[0]}x{shape[1]} {dtype}"
        for name, shape, dtype in zip("AB", inputs.shapes, inputs.dtypes, strict=True)
    )


def _tile(seed: int, matrix: int, ti: int, tj: int, dtype: np.dtype) -> np.ndarray:
    """Tile (ti, tj) of generated matrix `matrix`: a fixed function of its position."""
    rng = np.random.default_rng([seed, matrix, ti, tj])
    shape = (TILE, TILE)
    if dtype.kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    if dtype.kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, shape).astype(dtype)
    low = -9 if dtype.kind == "i" else 0  # small integers: exact products in any int type
    return rng.integers(low, 10, shape).astype(dtype)


@dataclass(frozen=True)
class GeneratedInputs:
    """A (m x k) and B (k x n) filled with seeded random numbers of `dtype`.

    The value at (i, j) depends only on the seed, the matrix and (i, j), never
    on how the matrix is split, so every strategy and rank count sees the same A and B.
    """

    m: int
    k: int
    n: int
    dtype: np.dtype
    seed: int

    @property
    def shapes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        return (self.m, self.k), (self.k, self.n)

    @property
    def dtypes(self) -> tuple[np.dtype, np.dtype]:
        return self.dtype, self.dtype

    def block(self, matrix: int, rows: tuple[int, int], cols: tuple[int, int]) -> np.ndarray:
        """Rows [r0, r1) and columns [c0, c1) of A (matrix 0) or B (matrix 1)."""
        (r0, r1), (c0, c1) = rows, cols
        out = np.empty((r1 - r0, c1 - c0), dtype=self.dtype)
        for ti in range(r0 // TILE, math.ceil(r1 / TILE)):
            for tj in range(c0 // TILE, math.ceil(c1 / TILE)):
                tile = _tile(self.seed, matrix, ti, tj, self.dtype)
                # The part of this tile inside the block, in matrix coordinates.
                i0, i1 = max(r0, ti * TILE), min(r1, (ti + 1) * TILE)
                j0, j1 = max(c0, tj * TILE), min(c1, (tj + 1) * TILE)
                out[i0 - r0 : i1 - r0, j0 - c0 : j1 - c0] = tile[
                    i0 - ti * TILE : i1 - ti * TILE, j0 - tj * TILE : j1 - tj * TILE
                ]
        return out


NPY_MAGIC = b"\x93NUMPY"


def open_matrix(path: str, flag: str) -> np.ndarray:
    """Memory-map the 2-D numeric matrix in .npy file `path`, or raise InputError.

    Pickled content is refused, never loaded (allow_pickle=False); nothing is
    read here but the header.
    """
    try:
        with open(path, "rb") as f:
            magic = f.read(len(NPY_MAGIC))
    except OSError as exc:
        raise InputError(f"{flag} {path}: cannot be opened: {exc.strerror}") from None
    if magic != NPY_MAGIC:
        raise InputError(f"{flag} {path}: is not a .npy file (it lacks the .npy magic bytes)")
    try:
        m = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        if "object" in str(exc).lower():
            raise InputError(
                f"{flag} {path}: holds Python objects, which would need unpickling; "
                f"spmd reads numeric .npy matrices only"
            ) from None
        raise InputError(f"{flag} {path}: cannot be read as a .npy array: {exc}") from None
    if m.ndim != 2:
        raise InputError(f"{flag} {path}: must hold a 2-D matrix, holds shape {m.shape}")
    if not is_numeric(m.dtype):
        raise InputError(f"{flag} {path}: must hold numbers, holds dtype {m.dtype}")
    return m


@dataclass(frozen=True)
class FileInputs:
    """A and B read from .npy files, memory-mapped so a rank reads only its blocks."""

    a_path: str
    b_path: str
    _matrices: tuple = field(init=False, repr=False, compare=False)  # (A, B), memory-mapped

    def __post_init__(self):
        a, b = open_matrix(self.a_path, "--a"), open_matrix(self.b_path, "--b")
        if a.shape[1] != b.shape[0]:
            raise InputError(
                f"--a {self.a_path} is {a.shape[0]}x{a.shape[1]} but --b {self.b_path} is "
                f"{b.shape[0]}x{b.shape[1]}: A's columns must equal B's rows"
            )
        object.__setattr__(self, "_matrices", (a, b))

    @property
    def shapes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        a, b = self._matrices
        return a.shape, b.shape

    @property
    def dtypes(self) -> tuple[np.dtype, np.dtype]:
        a, b = self._matrices
        return a.dtype, b.dtype

    def block(self, matrix: int, rows: tuple[int, int], cols: tuple[int, int]) -> np.ndarray:
        """Rows [r0, r1) and columns [c0, c1) of A (matrix 0) or B (matrix 1), read into memory."""
        return np.array(self._matrices[matrix][slice(*rows), slice(*cols)])
