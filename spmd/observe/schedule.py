"""Any strategy's schedule as a text table: one row per step, one column per rank (--schedule)."""

from spmd.strategies.base import Schedule


def format_schedule(schedule: Schedule) -> str:
    """The intro, then the step x rank table of `schedule`."""
    size = len(schedule.steps[0][1]) if schedule.steps else 0
    table = [["step", *[f"rank {r}" for r in range(size)]]]
    table += [[label, *[cell.text for cell in cells]] for label, cells in schedule.steps]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = [" | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in table]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return schedule.intro + "\n\n" + "\n".join(lines)
