"""python -m spmd data prepare [FILES_FOLDERS_OR_GLOBS...] --out DIR: text into token files, split by document.

With no input it takes a corpus every machine with Python has: the standard library's own .py files (its
test and site-packages folders left out), so the whole journey works offline. The inputs are files, folders and
globs of text and JSON lines (spmd.data.sources says what each gives). A document goes to validation when the
sha256 of its name (its path within its input; file:line for a JSON line) starts below --val-fraction of the
range (the same split on every machine for the same files). The tokenizer is bytes (V = 257) or, with
--tokenizer bpe --vocab N, a byte-level BPE of at most N tokens trained on the training documents alone (the
validation text stays unseen). Writes DIR/train.bin and DIR/val.bin (spmd.data.tokens' format: each document's
tokens, then the end-of-document token; uint16 ids up to 65,536 tokens, uint32 above), DIR/tokenizer.json and
DIR/meta.json: documents, tokens, vocabulary, the unigram entropy of the validation tokens (the loss of a model
that learned only how often each token occurs) and a fingerprint of the three files (a resumed run checks it).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from spmd.data.sources import Documents
from spmd.data.tokenizer import KINDS, MIN_BPE_VOCAB, BPETokenizer, ByteTokenizer, Tokenizer
from spmd.data.tokens import token_dtype, write_tokens
from spmd.usage import Parser, UsageError

MAX_VOCAB = 1 << 32  # uint32 ids


def in_validation(name: str, fraction: float) -> bool:
    return int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) < fraction * 16**8


def unigram_entropy(tokens: np.ndarray, vocab: int) -> float:
    """-sum p log p over the tokens' frequencies, in nats (the loss's unit)."""
    counts = np.bincount(tokens, minlength=vocab).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def fingerprint(folder: Path) -> str:
    digest = hashlib.sha256()
    for name in ("train.bin", "val.bin", "tokenizer.json"):
        digest.update((folder / name).read_bytes())
    return digest.hexdigest()[:16]


def check_vocab(tokenizer: str, vocab: int | None) -> None:
    if tokenizer not in KINDS:
        raise UsageError(f"--tokenizer {tokenizer}: not one of {', '.join(KINDS)}")
    if tokenizer == "bpe" and vocab is None:
        raise UsageError("--tokenizer bpe needs --vocab N: the BPE's size (e.g. --vocab 4096)")
    if tokenizer != "bpe" and vocab is not None:
        raise UsageError(
            f"--vocab {vocab} sizes a BPE: give it with --tokenizer bpe (the {tokenizer} tokenizer "
            f"has {ByteTokenizer.vocab} tokens)"
        )
    if vocab is not None and not MIN_BPE_VOCAB <= vocab <= MAX_VOCAB:
        raise UsageError(
            f"--vocab {vocab}: a BPE has {MIN_BPE_VOCAB} tokens at least (the 256 bytes and the end "
            f"of a document) and {MAX_VOCAB:,} at most"
        )


def make_tokenizer(docs: Documents, tokenizer: str, vocab: int | None, val_fraction: float) -> Tokenizer:
    """The byte tokenizer, or a BPE trained on the training documents (one pass over the inputs)."""
    if tokenizer == "bytes":
        return ByteTokenizer()
    assert vocab is not None
    train = (text for name, text in docs.read("training the BPE") if not in_validation(name, val_fraction))
    return BPETokenizer.train(train, vocab)


def tokenize(docs: Documents, coder: Tokenizer, val_fraction: float) -> dict[str, list[np.ndarray]]:
    """Each split's pieces: a document's tokens, then the end-of-document token, document after document."""
    end = np.array([coder.end], dtype=token_dtype(coder.vocab))
    parts: dict[str, list[np.ndarray]] = {"train": [], "val": []}
    for name, text in docs.read("tokenizing"):
        parts["val" if in_validation(name, val_fraction) else "train"] += [coder.encode(text), end]
    return parts


def prepare(
    inputs: list[str], out: str, tokenizer: str = "bytes", val_fraction: float = 0.05, vocab: int | None = None
) -> dict:
    """Tokenize, split, write; returns the summary written to meta.json."""
    if not 0 < val_fraction < 1:
        raise UsageError(f"--val-fraction must be in (0, 1), got {val_fraction}")
    check_vocab(tokenizer, vocab)
    docs = Documents(inputs)
    coder = make_tokenizer(docs, tokenizer, vocab, val_fraction)
    parts = tokenize(docs, coder, val_fraction)
    if not parts["val"] or not parts["train"]:
        found = (len(parts["val"]) + len(parts["train"])) // 2
        hint = " (a folder gives its .txt, .md, .py and .jsonl files; name other files or glob them)" * (not found)
        raise UsageError(
            f"{found} text documents cannot make both a training and a validation split at "
            f"--val-fraction {val_fraction}: give more documents{hint}"
        )
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    summary: dict = {"tokenizer": coder.kind, "vocab": coder.vocab, "skipped_documents": docs.skipped}
    if vocab is not None:
        summary["vocab_asked"] = vocab
    for split, pieces in parts.items():
        tokens = np.concatenate(pieces)
        write_tokens(folder / f"{split}.bin", tokens, coder.vocab, len(pieces) // 2)
        summary[f"{split}_documents"], summary[f"{split}_tokens"] = len(pieces) // 2, int(tokens.size)
        if split == "val":
            summary["unigram_entropy"] = unigram_entropy(tokens, coder.vocab)
    coder.save(folder)
    summary["fingerprint"] = fingerprint(folder)
    (folder / "meta.json").write_text(json.dumps(summary, indent=1))
    return summary


def main(argv=None) -> int:
    p = Parser(prog="python -m spmd data prepare", description=__doc__.splitlines()[0])
    p.add_argument(
        "inputs",
        nargs="*",
        help="text files, folders (their .txt, .md, .py, .jsonl files) or globs "
        "('docs/**/*.md'); a .jsonl file's lines are objects with a \"text\" field (default: the "
        "Python standard library's source)",
    )
    p.add_argument("--out", required=True, help="the folder to write")
    p.add_argument(
        "--tokenizer",
        choices=KINDS,
        default="bytes",
        help="bytes: 256 bytes and the end of a document; bpe: a byte-level BPE trained on the training "
        "documents (needs spmd[bpe])",
    )
    p.add_argument("--vocab", type=int, help="the BPE's size, at least 257 (with --tokenizer bpe)")
    p.add_argument("--val-fraction", type=float, default=0.05, help="of the documents, by a hash of their names")
    args = p.parse_args(argv)
    s = prepare(args.inputs, args.out, args.tokenizer, args.val_fraction, args.vocab)
    fewer = (
        f", of {s['vocab_asked']} asked: the text allows no more merges" if s.get("vocab_asked", 0) > s["vocab"] else ""
    )
    n = s["skipped_documents"]
    skipped = f"; {n} file{'s' * (n != 1)} not UTF-8 text left out" if n else ""
    print(
        f"{args.out}: {s['train_documents']} + {s['val_documents']} documents (train + validation), "
        f"{s['train_tokens']:,} + {s['val_tokens']:,} tokens, vocabulary {s['vocab']} ({s['tokenizer']}{fewer}); "
        f"unigram entropy of the validation tokens {s['unigram_entropy']:.4f} nats; fingerprint {s['fingerprint']}"
        f"{skipped}"
    )
    return 0
