"""Tokenizers that need nothing downloaded: byte-level (every UTF-8 byte a token, and one end-of-document token,
V = 257), saved beside the corpus as tokenizer.json. A BPE tokenizer (Hugging Face `tokenizers`, trained
locally) is the optional extra the issue asks for; it is not built here yet."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

END = 256  # the end-of-document token of the byte tokenizer


@dataclass(frozen=True)
class ByteTokenizer:
    kind = "bytes"
    vocab = 257
    end = END

    def token_bytes(self) -> np.ndarray:
        """The UTF-8 bytes each id stands for (bits a byte divides by their sum): 1, and 0 for the end token."""
        lengths = np.ones(self.vocab, dtype=np.int64)
        lengths[END] = 0
        return lengths

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def decode(self, ids) -> str:
        """The text of `ids`; the end-of-document token as a blank line, bytes that are not UTF-8 replaced."""
        out = bytearray()
        for i in np.asarray(ids).tolist():
            out += b"\n\n" if i == END else bytes([i])
        return out.decode("utf-8", errors="replace")

    def save(self, folder: Path) -> None:
        (folder / "tokenizer.json").write_text(json.dumps({"kind": self.kind, "vocab": self.vocab, "end": END}))


TOKENIZERS = {"bytes": ByteTokenizer}


def load_tokenizer(folder: str | Path) -> ByteTokenizer:
    path = Path(folder) / "tokenizer.json"
    try:
        spec = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot be read as a tokenizer ({exc})") from None
    if spec.get("kind") not in TOKENIZERS:
        raise ValueError(f"{path}: tokenizer kind {spec.get('kind')!r} is not one of {', '.join(TOKENIZERS)}")
    return TOKENIZERS[spec["kind"]]()
