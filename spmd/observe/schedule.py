"""A strategy's schedule as data (a Cell per rank and step) and as the text table --schedule prints."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Cell:
    """What one rank does in one step of a schedule: a short text, and the ranks it sends to, in order."""

    text: str
    sends_to: tuple[int, ...] = ()


@dataclass(frozen=True)
class Schedule:
    """A strategy's steps on a mesh: `steps` holds (label, one Cell per rank)."""

    intro: str
    steps: list[tuple[str, list[Cell]]]
    more: tuple["Schedule", ...] = ()  # tables printed after this one (e.g. attention over the cp axis)

    def sends(self, rank: int) -> list[int]:
        """Every destination `rank` sends to, in order: what its traffic log must show."""
        return [dst for _, cells in self.steps for dst in cells[rank].sends_to]


def format_schedule(schedule: Schedule) -> str:
    """The intro, then the step x rank table of `schedule`."""
    size = len(schedule.steps[0][1]) if schedule.steps else 0
    table = [["step", *[f"rank {r}" for r in range(size)]]]
    table += [[label, *[cell.text for cell in cells]] for label, cells in schedule.steps]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = [" | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in table]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n\n".join([schedule.intro + "\n\n" + "\n".join(lines), *map(format_schedule, schedule.more)])
