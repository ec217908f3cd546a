"""How an array travels under MPI: a fixed-size header message, then the raw bytes.

The header (HEADER_BYTES of ASCII "<dtype.str> <dim0> <dim1> ...", space
padded) goes on one channel, the array's bytes straight from its buffer on
another, with the same source and tag; MPI keeps both in order, so the n-th
header from a rank matches its n-th data message. No pickling, no copy of the
data: a receiver that knows what to expect posts its receive into its own
buffer at once, and checks the header when both have arrived.
"""

import numpy as np

from spmd.transport.comm import CommError, is_numeric

HEADER_BYTES = 256


def pack_header(dtype: np.dtype, shape: tuple) -> np.ndarray:
    """The header of an array of `dtype` and `shape`, as HEADER_BYTES uint8."""
    text = " ".join([dtype.str, *map(str, shape)]).encode("ascii")
    if len(text) > HEADER_BYTES:
        raise ValueError(f"an array of {len(shape)} dimensions is too many to send")
    header = np.full(HEADER_BYTES, ord(" "), dtype=np.uint8)
    header[: len(text)] = np.frombuffer(text, np.uint8)
    return header


def unpack_header(header: np.ndarray) -> tuple[np.dtype, tuple]:
    """(dtype, shape) from a header; CommError if it is not one."""
    try:
        dtype_str, *dims = header.tobytes().decode("ascii").split()
        dtype = np.dtype(dtype_str)
        shape = tuple(int(d) for d in dims)
    except (ValueError, TypeError, UnicodeDecodeError) as exc:
        raise CommError(f"malformed message header: {exc}") from exc
    if not is_numeric(dtype) or min(shape, default=0) < 0:
        raise CommError(f"malformed message header: dtype {dtype}, shape {shape}")
    return dtype, shape


def as_bytes(array: np.ndarray) -> np.ndarray:
    """A uint8 view of a C-contiguous array's buffer (what goes on the wire)."""
    if not array.flags.c_contiguous:
        raise ValueError("only C-contiguous arrays travel without a copy")
    return array.reshape(-1).view(np.uint8)
