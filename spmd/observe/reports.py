"""Reading spmd's JSON outputs (a --json report, a --trace timeline) for the observe tools: which kind each file
is, and a one-line error naming the file and the flag when it cannot be read, is empty, is not spmd's, or is another
kind than the tool draws."""

from __future__ import annotations

import json

from spmd.usage import UsageError


def load_json(path: str, flag: str):
    """The last JSON line of `path` (a report) or its whole content (a trace); UsageError naming the file."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError as exc:
        raise UsageError(f"{flag} {path}: cannot be read: {exc.strerror}") from None
    if not text:
        raise UsageError(f"{flag} {path}: is empty (did the run that should have written it fail?)")
    try:
        document = json.loads(text if text.startswith('{"traceEvents"') else text.splitlines()[-1])
    except ValueError:
        raise UsageError(f"{flag} {path}: is not JSON written by spmd (--json or --trace)") from None
    if isinstance(document, dict) and "mlp" in document and "model" not in document:
        document["model"] = document.pop("mlp")  # a training report written before the key was "model"
    return document


def kind_of(document) -> str:
    """ "trace", "matmul" or "training": which spmd output a loaded document is."""
    if isinstance(document, dict) and "traceEvents" in document:
        return "trace"
    if isinstance(document, dict) and "model" in document and "memory" in document:
        return "training"
    if isinstance(document, dict) and "bytes_sent" in document and "m" in document:
        return "matmul"
    return "unknown"


FLAG_OF = {"trace": "a trace file (positional)", "matmul": "--reports", "training": "--memory"}
WHAT = {
    "trace": "a --trace timeline",
    "matmul": "a matmul --json report",
    "training": "a training --json report",
    "unknown": "no spmd output",
}


def load_all(paths: list, flag: str, want: str) -> list:
    documents = []
    for path in paths:
        document = load_json(path, flag)
        found = kind_of(document)
        if found != want:
            hint = f"; give it as {FLAG_OF[found]}" if found in FLAG_OF else ""
            raise UsageError(f"{flag} {path}: is {WHAT[found]}, {flag} takes {WHAT[want]}{hint}")
        documents.append(document)
    return documents
