"""Timelines as a Chrome trace: every rank's spans (recorded by spmd.transport.clock) written out, and the
overlap of transfers with compute read off them. The file opens in Perfetto (ui.perfetto.dev) or
chrome://tracing.
"""

import json


def chrome_trace(spans: list) -> dict:
    """The Chrome trace-event document of `spans`: one process row per rank, times from the first span."""
    origin = min((s[3] for s in spans), default=0.0)
    events = [
        {
            "name": name,
            "cat": category,
            "ph": "X",
            "ts": start - origin,
            "dur": max(end - start, 0.0),
            "pid": rank,
            "tid": 0,
            "args": args,
        }
        for rank, name, category, start, end, args in spans
    ]
    for rank in sorted({s[0] for s in spans}):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def overlap_us(a: tuple, b: tuple) -> float:
    """Length of the intersection of two (start, end) intervals."""
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def hidden_fraction(spans: list) -> float | None:
    """The part of all receive transfers' time that some compute of the same rank covered.

    A transfer runs from posting the receive to the moment it was seen
    complete; None if there were no transfers.
    """
    total = hidden = 0.0
    for rank in {s[0] for s in spans}:
        compute = merged([(s[3], s[4]) for s in spans if s[0] == rank and s[2] == "compute"])
        for s in spans:
            if s[0] == rank and s[2] == "transfer":
                total += s[4] - s[3]
                hidden += sum(overlap_us((s[3], s[4]), c) for c in compute)
    return hidden / total if total > 0 else None


def write_trace(path: str, spans: list, mesh=None) -> None:
    """The trace as JSON; with the run's mesh in otherData, so a picture can say which axis a transfer used."""
    document = chrome_trace(spans)
    if mesh is not None:
        document["otherData"] = {"mesh": str(mesh)}
    with open(path, "w") as f:
        json.dump(document, f)


def merged(intervals: list) -> list:
    """The union of (start, end) intervals as disjoint ones (nested compute spans, as a ring step inside its
    layer, count once)."""
    out: list = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out
