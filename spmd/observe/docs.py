"""python -m spmd.observe.docs [--check] [NAME ...]: the documents' generated figures, from the recipes beside them.

A generated figure is a region of README.md (or a page of docs/) written as

    <!-- recipe: NAME -->
    ```sh
    the commands, as a reader pastes them
    ```
    <!-- prints: NAME -->
    what the last command prints (in a ``` block unless it is a markdown table)
    <!-- end: NAME -->

Its recipe is the sh block itself: run in a scratch folder (with links to .venv, launch/ and docs/, so the block's
`. .venv/bin/activate` and `--out docs/X.png` work as in a clone), every command but the last quietly, the last
one's output kept. Without --check each region is rewritten with that output (and the pictures the block draws land
in docs/); with --check nothing is written, docs/ is a scratch copy, and the exit status says whether every region
equals its recipe's output: text exactly, numbers as printed, except a table's columns the prints marker names as
measured (`<!-- prints: NAME; measured: peak MiB -->`: tracemalloc's peak), within MEASURED_TOLERANCE, and those it
names as timed (`; timed: A; B`: times and what follows from them), not compared at all (columns are separated by
";" in the marker, as their names may hold commas); a region with timed columns draws timed pictures too, compared
by what they draw without its numbers. A picture the block draws (`--out docs/NAME.png`) is compared by
what it draws: the plot keeps its bars' and curves' numbers as the PNG's Description, and the check compares them
with the committed picture's (pixels differ between matplotlib versions; the numbers may not).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from spmd.usage import Parser

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = ("README.md", "docs/benchmarks.md", "docs/reliability.md")
MEASURED_TOLERANCE = 0.05  # a measured cell may differ by 5% of its value from run to run
REGION = re.compile(
    r"<!-- recipe: (?P<name>[\w-]+) -->\n```sh\n(?P<script>.*?)```\n"
    r"<!-- prints: (?P=name)(?:; measured: (?P<measured>[^;>]*?))?(?:; timed: (?P<timed>[^>]*?))? -->\n"
    r"(?P<output>.*?)"
    r"<!-- end: (?P=name) -->",
    re.S,
)


@dataclass(frozen=True)
class Figure:
    document: str
    name: str
    script: str
    measured: tuple[str, ...]
    output: str
    timed: tuple[str, ...] = ()


def figures(names: list[str] | None = None) -> list[Figure]:
    """Every generated region of the documents (those named, if any), in order."""
    found = []
    for document in DOCUMENTS:
        path = ROOT / document
        if not path.exists():
            continue
        for m in REGION.finditer(path.read_text()):
            measured, timed = (
                tuple(c.strip() for c in (m[key] or "").split(";") if c.strip()) for key in ("measured", "timed")
            )
            found.append(Figure(document, m["name"], m["script"], measured, m["output"], timed))
    unknown = set(names or ()) - {f.name for f in found}
    if unknown:
        raise SystemExit(f"python -m spmd.observe.docs: no recipe named {', '.join(sorted(unknown))}")
    return [f for f in found if not names or f.name in names]


def as_commands(script: str) -> list[str]:
    """The block's commands, a continued line as one; the virtual environment's activation left out (the
    recipe runs with it first on PATH)."""
    lines = script.replace("\\\n", " ").splitlines()
    return [line for line in lines if line.strip() and not line.startswith(". .venv/bin/activate")]


def run(figure: Figure, docs: Path, timeout: int = 1800) -> str:
    """What the recipe's last command prints, every earlier one run quietly, in a scratch folder."""
    commands = as_commands(figure.script)
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        (folder / ".venv").symlink_to(Path(sys.prefix))
        (folder / "launch").symlink_to(ROOT / "launch")
        (folder / "docs").symlink_to(docs)
        body = "\n".join(commands[:-1])
        script = f"set -e -o pipefail\n{{\n{body}\n}} >/dev/null\n{commands[-1]}\n" if body else commands[-1]
        env_path = f"{Path(sys.prefix) / 'bin'}:{os.environ.get('PATH', '')}"
        done = subprocess.run(
            ["bash", "-c", script],
            cwd=folder,
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, "PATH": env_path},
        )
    if done.returncode != 0:
        raise RuntimeError(
            f"recipe {figure.name} ({figure.document}) failed:\n{figure.script}\n--- stderr\n{done.stderr[-3000:]}"
        )
    printed = done.stdout.strip() + "\n"
    return printed if is_table(printed) else "```\n" + printed + "```\n"  # a transcript, as it looks


def is_table(text: str) -> bool:
    """A markdown table, after at most one line of caption: left as markdown (anything else is fenced)."""
    lines = text.splitlines()
    rows = lines[1:] if lines and not lines[0].startswith("|") else lines
    return bool(rows) and all(line.startswith("|") for line in rows)


NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def differences(figure: Figure, fresh: str) -> list[str]:
    """Where the document's output and a fresh run's differ (none: equal as printed, measured columns within
    MEASURED_TOLERANCE)."""
    old, new = unfenced(figure.output).splitlines(), unfenced(fresh).splitlines()
    if len(old) != len(new):
        return [f"{len(old)} lines in the document, {len(new)} printed now"]
    measured: set[int] = set()
    timed: set[int] = set()
    header = True
    found = []
    for number, (a, b) in enumerate(zip(old, new, strict=True), 1):
        if a.startswith("|") and b.startswith("|"):
            cells_a, cells_b = a.strip("|").split("|"), b.strip("|").split("|")
            if header:  # the table's first line: which columns are measured, which timed
                measured = {i for i, cell in enumerate(cells_a) if cell.strip() in figure.measured}
                timed = {i for i, cell in enumerate(cells_a) if cell.strip() in figure.timed}
                header = False
            if len(cells_a) != len(cells_b):
                found.append(f"line {number}: {a!r} now {b!r}")
                continue
            for i, (x, y) in enumerate(zip(cells_a, cells_b, strict=True)):
                if x.strip() != y.strip() and i not in timed and not (i in measured and close(x, y)):
                    found.append(f"line {number}, column {i + 1}: {x.strip()!r} now {y.strip()!r}")
        elif a != b:
            found.append(f"line {number}: {a!r} now {b!r}")
    return found


def stale(figure: Figure, fresh: str) -> bool:
    """Whether a rewrite replaces the document's output: where it differs, a measured cell moved within its
    tolerance staying; a timed region whenever its text moved at all, since its pictures were just redrawn from
    the same run."""
    return bool(differences(figure, fresh)) or (bool(figure.timed) and unfenced(fresh) != unfenced(figure.output))


def unfenced(text: str) -> str:
    """A transcript without its ``` block (a table as it is)."""
    text = text.strip()
    return text[3:-3].strip() if text.startswith("```") and text.endswith("```") else text


def close(a: str, b: str) -> bool:
    """Two printed measurements within MEASURED_TOLERANCE of each other (their text apart from numbers equal)."""
    if NUMBER.sub("#", a.strip()) != NUMBER.sub("#", b.strip()):
        return False
    pairs = zip(map(float, NUMBER.findall(a)), map(float, NUMBER.findall(b)), strict=True)
    return all(abs(x - y) <= MEASURED_TOLERANCE * max(abs(x), abs(y)) for x, y in pairs)


def pictures(figure: Figure) -> list[str]:
    """The pictures the recipe draws, as docs/NAME.png."""
    return re.findall(r"--out (docs/[\w.-]+\.png)", figure.script)


def drawn(path: Path) -> str | None:
    """The Description a PNG keeps (what spmd.observe.plot drew), or None: its tEXt chunk, read directly."""
    if not path.exists():
        return None
    data, at = path.read_bytes(), 8
    while at + 8 <= len(data):
        length, kind = int.from_bytes(data[at : at + 4], "big"), data[at + 4 : at + 8]
        if kind == b"tEXt":
            key, _, value = data[at + 8 : at + 8 + length].partition(b"\0")
            if key == b"Description":
                return value.decode("latin-1")
        at += 12 + length
    return None


def picture_differences(figure: Figure, docs: Path) -> list[str]:
    """The pictures whose drawn numbers differ from the committed ones'."""
    found = []
    for name in pictures(figure):
        now, committed = drawn(docs / Path(name).name), drawn(ROOT / name)
        if figure.timed and now is not None and committed is not None:  # timed bars: what is drawn, not how long
            now, committed = NUMBER.sub("#", now), NUMBER.sub("#", committed)
        if now is None or now != committed:
            found.append(
                f"{name} draws other numbers now (make docs)"
                if committed is not None
                else f"{name}: the committed picture keeps no drawn numbers (make docs)"
            )
    return found


def rewrite(figure: Figure, fresh: str) -> None:
    path = ROOT / figure.document
    text = path.read_text()
    start = f"<!-- recipe: {figure.name} -->"
    at = text.index(start)
    prints = text.index(f"<!-- prints: {figure.name}", at)
    head_end = text.index("-->\n", prints) + len("-->\n")
    end = text.index(f"<!-- end: {figure.name} -->", head_end)
    path.write_text(text[:head_end] + fresh + text[end:])


def main(argv=None) -> int:
    p = Parser(prog="python -m spmd.observe.docs", description=__doc__.splitlines()[0])
    p.add_argument("names", nargs="*", help="the recipes to run (default: every one)")
    p.add_argument(
        "--check",
        action="store_true",
        help="compare each region with a fresh run instead of rewriting it (default: rewrite)",
    )
    p.add_argument("--list", action="store_true", help="name every recipe and its document, run none")
    args = p.parse_args(argv)
    chosen = figures(args.names)
    if args.list:
        for f in chosen:
            print(f"{f.name:<24} {f.document}" + (f" (measured: {', '.join(f.measured)})" if f.measured else ""))
        return 0
    failed = 0
    with tempfile.TemporaryDirectory() as scratch:
        docs = ROOT / "docs"
        if args.check:  # the pictures a recipe draws go to a copy: a check writes nothing
            docs = Path(scratch) / "docs"
            shutil.copytree(ROOT / "docs", docs)
        for figure in chosen:
            fresh = run(figure, docs)
            if not args.check:
                changed = stale(figure, fresh)
                if changed:
                    rewrite(figure, fresh)
                print(
                    f"{figure.name}: {figure.document} {'rewritten' if changed else 'already as printed'}",
                    file=sys.stderr,
                )
                continue
            found = differences(figure, fresh) + picture_differences(figure, docs)
            failed += bool(found)
            print(
                f"{figure.name} ({figure.document}): "
                + ("as documented" if not found else "DIFFERS\n  " + "\n  ".join(found[:10]))
            )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
