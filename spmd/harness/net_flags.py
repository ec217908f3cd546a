"""A training command's model flags, generated from the fields of spmd.model.config.Net.

Each field made with config.flag() is a flag `--name-with-dashes` (or as an mlp-* preset spells it: --tokens
for --batch) whose value lands in the field of the same name: its type from the default (a bool is a switch),
its help, choices and group from the field. So a field added to Net is a flag of `python -m spmd train`, a
--config key and a keyword of spmd.train at once, and the command builds its Net from the parsed flags without
listing them again.
"""

from __future__ import annotations

import argparse
from dataclasses import fields

from spmd.model.config import FLAG_GROUPS, Net

CLI_ONLY = ("group", "help", "cli_default")  # the metadata keys that are not argparse's


def net_flags(names: tuple[str, ...] | None = None) -> list:
    """Net's flag fields, in declaration order (only `names`, when given)."""
    return [f for f in fields(Net) if "group" in f.metadata and (names is None or f.name in names)]


def add_net_flags(parser: argparse.ArgumentParser, names=None, groups=None) -> dict:
    """Add Net's flags (or those of `names`) to `parser`, each in its group's argument group (made here, or
    taken from `groups`: key -> group); returns the groups by key. `names` as a dict: field -> how the command
    words the flag where train's words do not fit ({"flag": "tokens", "default": 64, "help": ...})."""
    groups = dict(groups or {})
    words = names if isinstance(names, dict) else {}
    for f in net_flags(None if names is None else tuple(names)):
        key = f.metadata["group"]
        if key not in groups:
            groups[key] = parser.add_argument_group(FLAG_GROUPS[key])
        options = {k: v for k, v in f.metadata.items() if k not in CLI_ONLY}
        own = dict(words.get(f.name, {}))
        flag = own.pop("flag", f.name)
        default = own.pop("default", f.metadata.get("cli_default", f.default))
        options.update(help=own.pop("help", f.metadata["help"]), **own)  # the rest: argparse's (metavar)
        if isinstance(f.default, bool):
            options["action"] = "store_true"
        elif "choices" not in options and "action" not in options:
            options.setdefault("type", type(f.default))
        groups[key].add_argument("--" + flag.replace("_", "-"), dest=f.name, default=default, **options)
    return groups


def net_fields(args: argparse.Namespace, names: tuple[str, ...] | None = None) -> dict:
    """{field: value} of the Net flags the parser has (or of `names`), for Net(**...)."""
    return {f.name: getattr(args, f.name) for f in net_flags(names) if hasattr(args, f.name)}
