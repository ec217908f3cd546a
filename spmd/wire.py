"""How one array travels as one MPI message: a short text header, then the raw bytes.

Layout: 8 bytes little-endian header length H, H bytes of ASCII
"<dtype.str> <dim0> <dim1> ...", padded so the data starts at a multiple of 64
bytes, then the array's C-order bytes. No pickling: the receiver rebuilds the
array as a view of the received bytes, after checking the sizes agree.
"""

import numpy as np

from spmd.comm import CommError, is_numeric

_ALIGN = 64
_LEN_BYTES = 8


def pack(payload: np.ndarray) -> np.ndarray:
    """Return a new uint8 buffer holding `payload`'s header and a copy of its bytes."""
    text = " ".join([payload.dtype.str, *map(str, payload.shape)]).encode("ascii")
    start = -(-(_LEN_BYTES + len(text)) // _ALIGN) * _ALIGN  # round up to _ALIGN
    packet = np.empty(start + payload.nbytes, dtype=np.uint8)
    packet[:_LEN_BYTES] = np.frombuffer((start - _LEN_BYTES).to_bytes(8, "little"), np.uint8)
    packet[_LEN_BYTES : _LEN_BYTES + len(text)] = np.frombuffer(text, np.uint8)
    packet[_LEN_BYTES + len(text) : start] = ord(" ")
    np.copyto(packet[start:].view(payload.dtype).reshape(payload.shape), payload)
    return packet


def unpack(packet: np.ndarray) -> np.ndarray:
    """Return the array a `pack`ed buffer holds, as a view of `packet`."""
    if packet.size < _LEN_BYTES:
        raise CommError(f"malformed message: {packet.size} bytes, shorter than a header")
    header_len = int.from_bytes(packet[:_LEN_BYTES].tobytes(), "little")
    start = _LEN_BYTES + header_len
    try:
        dtype_str, *dims = packet[_LEN_BYTES:start].tobytes().decode("ascii").split()
        dtype = np.dtype(dtype_str)
        shape = tuple(int(d) for d in dims)
    except (ValueError, TypeError, UnicodeDecodeError) as exc:
        raise CommError(f"malformed message header: {exc}") from exc
    if not is_numeric(dtype) or min(shape, default=0) < 0:
        raise CommError(f"malformed message header: dtype {dtype}, shape {shape}")
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if packet.size - start != expected:
        raise CommError(
            f"malformed message: header says {dtype} {shape} ({expected} bytes), "
            f"but {packet.size - start} bytes of data arrived"
        )
    return packet[start:].view(dtype).reshape(shape)
