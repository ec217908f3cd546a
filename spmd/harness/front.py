"""`python -m spmd`: one front for every strategy, matmul and training, named before or after its flags.

The strategy's name is found anywhere among the arguments and moved first, so
`python -m spmd --devices 4 mlp-dp` and `python -m spmd mlp-dp --devices 4` are the same command.
A name the field spells another way is an alias; a typo gets the closest names.
"""

from __future__ import annotations

import difflib
import sys

from spmd.harness import cli, compose_cli
from spmd.matmul import STRATEGIES
from spmd.trainers.presets import PRESETS
from spmd.usage import fail

PROG = "python -m spmd"
# Names the field uses for a strategy spmd calls otherwise.
ALIASES = {"mlp-zero3": "mlp-fsdp", "mlp-ddp": "mlp-dp", "ddp": "dp"}


def names() -> list[str]:
    return [*STRATEGIES, "train", *PRESETS, *ALIASES]


def overview() -> str:
    width = max(map(len, names())) + 2
    alias_of: dict[str, list[str]] = {}
    for alias, name in ALIASES.items():
        alias_of.setdefault(name, []).append(alias)

    def row(name: str, summary: str) -> str:
        also = f" (also: {', '.join(alias_of[name])})" if name in alias_of else ""
        return f"  {name:<{width}}{summary}{also}"

    return "\n".join(
        [
            f"usage: {PROG} STRATEGY [flags]   (flags before or after STRATEGY; {PROG} STRATEGY --help for its flags)",
            "",
            "matrix multiplication, C = A @ B:",
            *(row(s.name, s.summary) for s in STRATEGIES.values()),
            "",
            "training a model written once, every parallelism composed on one mesh:",
            row(
                "train",
                "--model mlp|transformer|llama --mesh pp=2,dp=2,fsdp=2,tp=2 [--sp] [--pipeline ...] [--data DIR]",
            ),
            "",
            "training an MLP (forward, backward, optimizer), one strategy each:",
            *(row(t.name, t.summary) for t in PRESETS.values()),
            "",
            "real text for the language model:",
            f"  {'data prepare':<{width}}[FILES, FOLDERS, GLOBS...] --out DIR [--tokenizer bpe --vocab N] (default: "
            "Python's standard library, bytes)",
            f"  {'generate':<{width}}--load CHECKPOINT --prompt TEXT (sample from a trained LM)",
            "",
            f"  {'schedules':<{width}}[--pp P --microbatches M --times T_F,T_B,T_W] (the pipeline schedules compared)",
            "",
            "also: python -m spmd.plan (plan a run at scale), python -m spmd.bench, python -m spmd.observe.plot",
        ]
    )


def suggest(word: str) -> str:
    close = difflib.get_close_matches(word, names(), n=3, cutoff=0.5)
    hints = [f"{c} ({ALIASES[c]})" if c in ALIASES else c for c in close]
    return f"; did you mean {' or '.join(hints)}?" if hints else ""


def guess_strategy_word(argv: list[str]) -> str | None:
    """The word meant as the strategy: not a flag, not a flag's value (a word after a flag, or a number)."""
    words = [
        w
        for i, w in enumerate(argv)
        if not w.startswith("-") and not (i > 0 and argv[i - 1].startswith("-") and "=" not in argv[i - 1])
    ]
    return words[0] if words else None


def split_strategy(argv: list[str]) -> tuple[str | None, list[str]]:
    """(the strategy named anywhere in argv, resolved through ALIASES, the other arguments)."""
    for i, word in enumerate(argv):
        if word in STRATEGIES or word in PRESETS or word in ALIASES or word == "train":
            return ALIASES.get(word, word), argv[:i] + argv[i + 1 :]
    return None, argv


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--version"]:
        from importlib.metadata import version

        print(f"spmd {version('spmd')}")
        return 0
    if argv[:1] == ["data"]:
        from spmd.data.cli import main as data_main

        return data_main(argv[1:])
    if argv[:1] == ["schedules"]:
        from spmd.harness.schedules_cli import main as schedules_main

        return schedules_main(argv[1:])
    if argv[:1] == ["generate"]:
        from spmd.harness.generate import main as generate_main

        return generate_main(argv[1:])
    name, rest = split_strategy(argv)
    if name is None:
        if not argv or argv[0] in ("-h", "--help"):
            print(overview())
            return 0
        unknown = guess_strategy_word(argv)
        if unknown is None:
            fail(PROG, f"name a strategy, e.g. {PROG} fsdp --check (see {PROG} --help for all of them)")
        fail(PROG, f"unknown strategy {unknown!r}{suggest(unknown)} (see {PROG} --help for all of them)")
    if name == "train":
        return compose_cli.main(rest)
    if name in PRESETS:
        return compose_cli.main(rest, PRESETS[name])
    return cli.main([name, *rest])
