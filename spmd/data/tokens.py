"""The token file: a 64-byte header, then the tokens, memory-mapped (llm.c's idea: one header, then the ids).

Header (little-endian): magic b"SPMDTOK1", version (u32), bytes a token (u32: 2 for uint16, 4 for uint32),
token count (u64), vocabulary size (u64), document count (u64), 24 bytes reserved (zero). uint16 suffices up to
65,536 tokens. Opening checks the magic, the version, that the file holds exactly the tokens the header counts
(a truncated or padded file is refused naming it) and never reads past its end; no pickle anywhere.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

MAGIC = b"SPMDTOK1"
VERSION = 1
HEADER = struct.Struct("<8sIIQQQ24s")  # 64 bytes
DTYPES: dict[int, np.dtype] = {2: np.dtype("<u2"), 4: np.dtype("<u4")}


class TokenFileError(ValueError):
    """A token file that cannot be read as one; the message names the file and why."""


def token_dtype(vocab: int) -> np.dtype:
    """The narrowest id type the file format has for `vocab` ids: uint16 up to 65,536, uint32 above."""
    return DTYPES[2] if vocab <= 1 << 16 else DTYPES[4]


def write_tokens(path: str | Path, tokens: np.ndarray, vocab: int, documents: int) -> None:
    """Write `tokens` (ids below `vocab`) with the header; atomically (a .tmp file renamed)."""
    width = token_dtype(vocab).itemsize
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(HEADER.pack(MAGIC, VERSION, width, tokens.size, vocab, documents, bytes(16)))
        f.write(np.ascontiguousarray(tokens, dtype=DTYPES[width]).tobytes())
    tmp.replace(path)


class TokenFile:
    """A token file opened read-only through a memory map: `tokens` (a read-only array view), `vocab`,
    `documents`."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                head = f.read(HEADER.size)
        except OSError as exc:
            raise TokenFileError(f"{self.path}: cannot be read ({exc.strerror})") from None
        if len(head) < HEADER.size:
            raise TokenFileError(f"{self.path}: {size} bytes, shorter than the {HEADER.size}-byte header")
        magic, version, width, count, vocab, documents, _ = HEADER.unpack(head)
        if magic != MAGIC:
            raise TokenFileError(f"{self.path}: not an spmd token file (magic {magic!r}, expected {MAGIC!r})")
        if version != VERSION or width not in DTYPES:
            raise TokenFileError(f"{self.path}: version {version} with {width}-byte tokens is not one this reads")
        if size != HEADER.size + count * width:
            raise TokenFileError(
                f"{self.path}: the header counts {count} tokens ({HEADER.size + count * width} "
                f"bytes) but the file has {size} bytes: truncated or damaged"
            )
        self.vocab, self.documents, self.count = int(vocab), int(documents), int(count)
        self.tokens: np.ndarray = np.zeros(0, dtype=DTYPES[width])
        if count:
            self.tokens = np.memmap(self.path, dtype=DTYPES[width], mode="r", offset=HEADER.size, shape=(count,))

    def check_ids(self, chunk: int = 1 << 24) -> None:
        """Refuse ids at or above the vocabulary (a damaged body), naming the file; read a chunk at a time."""
        for start in range(0, self.count, chunk):
            top = int(self.tokens[start : start + chunk].max())
            if top >= self.vocab:
                raise TokenFileError(f"{self.path}: holds token {top}, outside its vocabulary of {self.vocab}: damaged")
