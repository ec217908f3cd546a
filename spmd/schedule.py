"""The per-step table of what each rank holds, multiplies, sends and receives (--schedule)."""


def ring_steps(size: int) -> list[list[dict]]:
    """For each FSDP step, for each rank: the B shard it multiplies and what it passes on.

    Rotation to the right: at step s rank r holds the shard owned by
    (r - s) mod D, sends it to r + 1, and receives the shard of (r - s - 1) mod D
    from r - 1; the last step only multiplies.
    """
    steps = []
    for s in range(size):
        last = s == size - 1
        steps.append([
            {
                "multiplies": (r - s) % size,
                "sends_to": None if last else (r + 1) % size,
                "receives": None if last else ((r - s - 1) % size, (r - 1) % size),
            }
            for r in range(size)
        ])
    return steps


def format_schedule(strategy: str, size: int) -> str:
    """The schedule of `strategy` ("dp" or "fsdp") on `size` ranks, as a text table."""
    ranks = [f"rank {r}" for r in range(size)]
    if strategy == "dp":
        rows = [["0", *[f"A{r} x all of B" for r in range(size)]]]
        intro = "DP: every rank holds all of B and multiplies its rows of A by it; no B moves."
    else:
        rows = []
        for s, step in enumerate(ring_steps(size)):
            cells = []
            for r, cell in enumerate(step):
                text = f"A{r} x B{cell['multiplies']}"
                if cell["sends_to"] is not None:
                    shard, src = cell["receives"]
                    text += f", B{cell['multiplies']}->{cell['sends_to']}, B{shard}<-{src}"
                cells.append(text)
            rows.append([str(s), *cells])
        intro = ("FSDP: B's column shards rotate right. At each step a rank multiplies its A rows by the shard it\n"
                 "holds (writing that owner's columns of its C rows), sends that shard to the next rank and\n"
                 "receives the next one from the previous rank (both in flight during the multiply).")
    rows.append(["end", *["C rows -> 0" if r else "gathers C" for r in range(size)]])
    table = [["step", *ranks], *rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = [" | ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return intro + "\n\n" + "\n".join(lines)
