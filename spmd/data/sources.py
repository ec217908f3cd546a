"""The documents `data prepare` reads: files, folders and globs of text, and JSON lines.

A file is one document, named for the split by its path within the folder or glob that found it (its own name
when given by itself), so the same files split alike on every machine. A folder gives its .txt, .md, .py and
.jsonl files (hidden files and folders left out: a .git or .venv is not the user's text); a glob (`'docs/**/*.md'`,
`**` any depth) the files it matches; a file named explicitly is read whatever its suffix. A .jsonl file is one
document a line: an object whose "text" field is a string, named file:line. A file that is not UTF-8 text is left
out and counted. A progress bar on stderr for inputs over 50 MB.
"""

from __future__ import annotations

import glob
import json
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from spmd.usage import UsageError

SUFFIXES = {".txt", ".md", ".py", ".jsonl"}
SKIPPED_FOLDERS = {"test", "tests", "site-packages", "idlelib", "__pycache__"}  # of the default corpus
LARGE = 50 << 20  # bytes of input from which reading shows its progress


def default_corpus() -> list[Path]:
    """The standard library's .py files, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if not SKIPPED_FOLDERS & set(p.relative_to(root).parts[:-1]))


def folder_files(folder: Path) -> list[tuple[str, Path]]:
    found = []
    for path in sorted(folder.rglob("*")):
        relative = path.relative_to(folder)
        if path.is_file() and path.suffix in SUFFIXES and not any(p.startswith(".") for p in relative.parts):
            found.append((relative.as_posix(), path))
    return found


def glob_files(pattern: str) -> list[tuple[str, Path]]:
    """The files `pattern` matches (a matched folder gives its files), named within the pattern's fixed part."""
    parts = Path(pattern).parts
    fixed = next((i for i, part in enumerate(parts) if glob.has_magic(part)), len(parts))
    root = Path(*parts[:fixed]) if fixed else Path(".")
    found = []
    for match in sorted(glob.glob(pattern, recursive=True)):
        path = Path(match)
        if path.is_dir():
            found += [((path.relative_to(root) / name).as_posix(), p) for name, p in folder_files(path)]
        elif path.is_file():
            found.append((path.relative_to(root).as_posix(), path))
    if not found:
        raise UsageError(f"{pattern}: the pattern matches no file")
    return found


def sources(inputs: list[str]) -> list[tuple[str, Path]]:
    """(name for the split, path) of every file the inputs give, sorted by name, each file once."""
    if not inputs:
        root = Path(sysconfig.get_paths()["stdlib"])
        return [(p.relative_to(root).as_posix(), p) for p in default_corpus()]
    found: list[tuple[str, Path]] = []
    for text in inputs:
        path = Path(text)
        if path.is_dir():
            found += folder_files(path)
        elif path.is_file():
            found.append((path.name, path))
        elif glob.has_magic(text):
            found += glob_files(text)
        else:
            raise UsageError(f"{text}: no such file or folder")
    seen: set[Path] = set()
    unique = []
    for name, path in sorted(found):
        if path.resolve() not in seen:  # a file given twice (a folder and a glob) is one document
            seen.add(path.resolve())
            unique.append((name, path))
    return unique


def json_lines(name: str, path: Path, text: str) -> Iterator[tuple[str, str, int]]:
    """The documents of a JSON-lines file: each line's "text", and the characters read up to it; blank lines
    skipped."""
    read = 0
    for number, line in enumerate(text.splitlines(keepends=True), 1):
        read += len(line)
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise UsageError(f"{path}:{number}: not a JSON line ({exc})") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise UsageError(f'{path}:{number}: a JSON line must be an object with a string "text" field')
        yield f"{name}:{number}", record["text"], read


class Progress:
    """A progress bar of bytes read on stderr for large inputs: redrawn in place on a terminal, else a line
    every tenth (a log gets no carriage returns)."""

    def __init__(self, label: str, total: int, stream: TextIO | None = None, large: int = LARGE):
        self.label, self.total, self.done, self.stream = label, total, 0, stream or sys.stderr
        self.shown = total > large
        self.terminal = self.stream.isatty()
        self.tenths = 0

    def advance(self, size: int) -> None:
        self.done += size
        if not self.shown:
            return
        fraction = min(1.0, self.done / self.total)
        if self.terminal:
            bar = "#" * int(30 * fraction)
            self.stream.write(f"\r{self.label} [{bar:<30}] {fraction:4.0%} of {self.total / 2**20:,.0f} MB")
        elif int(10 * fraction) > self.tenths:
            self.tenths = int(10 * fraction)
            self.stream.write(f"{self.label}: {fraction:.0%} of {self.total / 2**20:,.0f} MB\n")
        self.stream.flush()

    def close(self) -> None:
        if self.shown and self.terminal:
            self.stream.write("\n")
            self.stream.flush()


class Documents:
    """The documents of some inputs, read again each time they are iterated (a BPE is trained on one pass and
    the tokens written on the next): (name, text) pairs in name order; `skipped` counts the files left out."""

    def __init__(self, inputs: list[str]):
        self.files = sources(inputs)
        self.total = sum(path.stat().st_size for _, path in self.files)
        self.skipped = 0

    def read(self, label: str, stream: TextIO | None = None, large: int = LARGE) -> Iterator[tuple[str, str]]:
        progress = Progress(label, self.total, stream, large)
        self.skipped = 0
        for name, path in self.files:
            size = path.stat().st_size
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                self.skipped += 1  # not text: left out, and counted
                progress.advance(size)
                continue
            if path.suffix != ".jsonl":
                progress.advance(size)
                yield name, text
                continue
            shown = 0  # a large corpus is often one JSON-lines file: the bar moves line by line
            for document, content, read in json_lines(name, path, text):
                progress.advance(size * read // max(1, len(text)) - shown)
                shown = size * read // max(1, len(text))
                yield document, content
            progress.advance(size - shown)
        progress.close()
