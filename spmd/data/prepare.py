"""python -m spmd data prepare [TEXT_FILES_OR_FOLDERS...] --out DIR: text into token files, split by document.

With no input it takes a corpus every machine with Python has: the standard library's own .py files (its
test and site-packages folders left out), so the whole journey works offline. A document is a file; it goes to
validation when the sha256 of its path within its input starts below --val-fraction of the range (the same split
on every machine for the same files). Writes DIR/train.bin and DIR/val.bin (spmd.data.tokens' format: each
document's tokens, then the end-of-document token), DIR/tokenizer.json and DIR/meta.json: documents, tokens,
vocabulary, the unigram entropy of the validation tokens (the loss of a model that learned only how often each
token occurs) and a fingerprint of the three files (a resumed run checks it).
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from pathlib import Path

import numpy as np

from spmd.data.tokenizer import TOKENIZERS
from spmd.data.tokens import write_tokens
from spmd.usage import Parser, UsageError

SKIPPED_FOLDERS = {"test", "tests", "site-packages", "idlelib", "__pycache__"}


def default_corpus() -> list[Path]:
    """The standard library's .py files, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if not SKIPPED_FOLDERS & set(p.relative_to(root).parts[:-1]))


def documents(inputs: list[str]) -> list[tuple[str, Path]]:
    """(name for the split, path) of every file under the inputs, sorted by name; a folder's files recursively."""
    if not inputs:
        root = Path(sysconfig.get_paths()["stdlib"])
        return [(str(p.relative_to(root)), p) for p in default_corpus()]
    found = []
    for text in inputs:
        path = Path(text)
        if path.is_dir():
            found += [(str(p.relative_to(path)), p) for p in sorted(path.rglob("*")) if p.is_file()]
        elif path.is_file():
            found.append((path.name, path))
        else:
            raise UsageError(f"{text}: no such file or folder")
    return sorted(found)


def in_validation(name: str, fraction: float) -> bool:
    return int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) < fraction * 16 ** 8


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


def prepare(inputs: list[str], out: str, tokenizer: str = "bytes", val_fraction: float = 0.05) -> dict:
    """Tokenize, split, write; returns the summary written to meta.json."""
    if not 0 < val_fraction < 1:
        raise UsageError(f"--val-fraction must be in (0, 1), got {val_fraction}")
    coder = TOKENIZERS[tokenizer]()
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    parts: dict[str, list[np.ndarray]] = {"train": [], "val": []}
    skipped = 0
    docs = documents(inputs)
    for name, path in docs:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            skipped += 1  # not text: left out, and counted
            continue
        split = "val" if in_validation(name, val_fraction) else "train"
        parts[split] += [coder.encode(text), np.array([coder.end], dtype=np.uint16)]
    if not parts["val"] or not parts["train"]:
        raise UsageError(f"{len(docs) - skipped} text documents cannot make both a training and a validation split "
                         f"at --val-fraction {val_fraction}: give more documents")
    summary: dict = {"tokenizer": coder.kind, "vocab": coder.vocab, "skipped_documents": skipped}
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
    p.add_argument("inputs", nargs="*", help="text files or folders (default: the Python standard library's source)")
    p.add_argument("--out", required=True, help="the folder to write")
    p.add_argument("--tokenizer", choices=sorted(TOKENIZERS), default="bytes")
    p.add_argument("--val-fraction", type=float, default=0.05, help="of the documents, by a hash of their names")
    args = p.parse_args(argv)
    s = prepare(args.inputs, args.out, args.tokenizer, args.val_fraction)
    print(f"{args.out}: {s['train_documents']} + {s['val_documents']} documents (train + validation), "
          f"{s['train_tokens']:,} + {s['val_tokens']:,} tokens, vocabulary {s['vocab']} ({s['tokenizer']}); "
          f"unigram entropy of the validation tokens {s['unigram_entropy']:.4f} nats; fingerprint {s['fingerprint']}")
    return 0
