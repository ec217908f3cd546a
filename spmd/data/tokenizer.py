"""The corpus's tokenizer, saved beside it as tokenizer.json. Two kinds:

- bytes (the default, needs nothing): every UTF-8 byte a token, and one end-of-document token, V = 257.
- bpe: a byte-level BPE trained on the corpus's training documents with the Hugging Face `tokenizers` library
  (the optional extra spmd[bpe], imported only when a BPE is trained or read), saved in that library's own JSON
  format, `<|endoftext|>` its end-of-document token.

Every tokenizer has `kind`, `vocab`, `end` (the end-of-document id), `encode(text)`, `decode(ids)`, `save(folder)`
and `token_bytes()` (the UTF-8 bytes each id stands for, 0 for special tokens: bits a byte divides by their sum).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from spmd.data.tokens import token_dtype
from spmd.usage import UsageError

END = 256  # the end-of-document token of the byte tokenizer
END_TEXT = "<|endoftext|>"  # the BPE's end-of-document token
MIN_BPE_VOCAB = 257  # the 256 bytes and the end token: a BPE with no merges
NEEDS_LIBRARY = "--tokenizer bpe needs the tokenizers library: pip install 'spmd[bpe]'"


class Tokenizer(Protocol):
    kind: str
    vocab: int
    end: int

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, ids) -> str: ...

    def save(self, folder: Path) -> None: ...

    def token_bytes(self) -> np.ndarray: ...


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


def _library() -> Any:
    """The `tokenizers` module, imported here only: spmd itself never needs it."""
    try:
        import tokenizers
    except ImportError:
        raise UsageError(NEEDS_LIBRARY) from None
    return tokenizers


def _byte_of_char() -> dict[str, int]:
    """The byte-level alphabet (GPT-2's, which the library's ByteLevel pre-tokenizer uses): a byte that Latin-1
    prints visibly stands for itself; the others, in byte order, for the characters from U+0100 on."""
    visible = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    char_of = {b: chr(b) for b in visible}
    for b in range(256):
        if b not in char_of:
            char_of[b] = chr(0x100 + len(char_of) - len(visible))
    return {c: b for b, c in char_of.items()}


BYTE_OF_CHAR = _byte_of_char()


class BPETokenizer:
    """A byte-level BPE of the `tokenizers` library: `inner` is its Tokenizer."""

    kind = "bpe"

    def __init__(self, inner: Any, source: str = "the trained BPE"):
        self.inner = inner
        inner.encode_special_tokens = True  # "<|endoftext|>" written in a document is its text, not a document end
        self.vocab = int(inner.get_vocab_size())
        end = inner.token_to_id(END_TEXT)
        if end is None:
            raise ValueError(f"{source}: has no {END_TEXT} token to end a document")
        self.end = int(end)
        self._bytes = self._bytes_of_ids(source)

    def _bytes_of_ids(self, source: str) -> list[bytes]:
        """What each id stands for in UTF-8 bytes: b"" for a special token (the end of a document)."""
        special = {i for i, token in self.inner.get_added_tokens_decoder().items() if token.special}
        vocab = self.inner.get_vocab()
        if sorted(vocab.values()) != list(range(self.vocab)):
            raise ValueError(f"{source}: its {self.vocab} ids are not 0 ... {self.vocab - 1}: damaged")
        table = [b""] * self.vocab
        for token, i in vocab.items():
            if i in special:
                continue
            try:
                table[i] = bytes(BYTE_OF_CHAR[c] for c in token)
            except KeyError:
                raise ValueError(f"{source}: token {i} ({token!r}) is not byte-level BPE text") from None
        return table

    @classmethod
    def train(cls, texts: Iterable[str], vocab: int) -> BPETokenizer:
        """A BPE of at most `vocab` tokens learned from `texts` (fewer if the texts allow fewer merges).
        Deterministic: the trainer counts words, sorts the alphabet, and breaks ties of pair counts by the pair's
        ids; the randomness of its hash maps reaches only continuing-subword prefixes, which this leaves out."""
        lib = _library()
        inner = lib.Tokenizer(lib.models.BPE())
        inner.pre_tokenizer = lib.pre_tokenizers.ByteLevel(add_prefix_space=False)
        inner.decoder = lib.decoders.ByteLevel()
        trainer = lib.trainers.BpeTrainer(
            vocab_size=vocab,
            special_tokens=[END_TEXT],
            show_progress=False,
            initial_alphabet=lib.pre_tokenizers.ByteLevel.alphabet(),
        )
        inner.train_from_iterator(texts, trainer)
        return cls(inner)

    @classmethod
    def read(cls, path: Path) -> BPETokenizer:
        try:
            lib = _library()
        except UsageError:
            raise UsageError(
                f"{path}: a BPE tokenizer; reading it needs the tokenizers library: pip install 'spmd[bpe]'"
            ) from None
        try:
            inner = lib.Tokenizer.from_file(str(path))
        except Exception as exc:  # the library raises a bare Exception with serde's message
            raise ValueError(f"{path}: cannot be read as a BPE tokenizer ({exc}): damaged") from None
        return cls(inner, str(path))

    def token_bytes(self) -> np.ndarray:
        return np.array([len(b) for b in self._bytes], dtype=np.int64)

    def encode(self, text: str) -> np.ndarray:
        ids = self.inner.encode(text, add_special_tokens=False).ids
        return np.array(ids, dtype=token_dtype(self.vocab))

    def decode(self, ids) -> str:
        """The text of `ids`; the end-of-document token as a blank line (as the byte tokenizer's), bytes that are
        not UTF-8 replaced."""
        return b"".join(b"\n\n" if i == self.end else self._bytes[i] for i in np.asarray(ids).tolist()).decode(
            "utf-8", errors="replace"
        )

    def save(self, folder: Path) -> None:
        self.inner.save(str(folder / "tokenizer.json"))


KINDS = ("bpe", "bytes")


def load_tokenizer(folder: str | Path) -> Tokenizer:
    """The tokenizer saved in `folder`: spmd's own JSON for bytes, the `tokenizers` library's for a BPE."""
    path = Path(folder) / "tokenizer.json"
    try:
        spec = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot be read as a tokenizer ({exc})") from None
    if not isinstance(spec, dict):
        raise ValueError(f"{path}: cannot be read as a tokenizer (not a JSON object)")
    if "kind" in spec:
        if spec["kind"] != ByteTokenizer.kind:
            raise ValueError(f"{path}: tokenizer kind {spec['kind']!r} is not one of {', '.join(KINDS)}")
        return ByteTokenizer()
    model = spec.get("model")
    if isinstance(model, dict) and model.get("type") == "BPE":
        return BPETokenizer.read(path)
    raise ValueError(f"{path}: neither spmd's byte tokenizer nor a tokenizers-library BPE")
