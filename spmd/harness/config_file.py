"""--config run.toml and --print-config: a training command's flags as a TOML file.

Every flag is a key, spelled as on the command line without its dashes (`kv-heads = 2`, `tie-embeddings = true`,
`no-overlap = true`; `kv_heads` is read the same); a flag given on the command line wins over the file. A key
that is no flag of the command, or a value of the wrong type or outside the flag's choices, is refused before any
rank starts, naming the file and the key. --print-config writes the resolved flags (the file's, the command
line's and the defaults) as a file --config reads back to the same run.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import sys

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser as a package
    import tomli as tomllib

from spmd.usage import UsageError, fail

NOT_KEYS = {"help", "config", "print_config"}


def add_config_flags(p) -> None:
    p.add_argument(
        "--config",
        metavar="RUN.toml",
        help="read flags from a TOML file (every flag a key, spelled "
        "without its dashes); flags on the command line win",
    )
    p.add_argument("--print-config", action="store_true", help="print the resolved flags as a --config file, and exit")


def flags_by_key(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Each optional flag's key (its long name without the dashes) -> its action."""
    keys = {}
    for action in parser._actions:
        if action.dest in NOT_KEYS or not action.option_strings:
            continue
        long = [s for s in action.option_strings if s.startswith("--")]
        keys[long[0][2:]] = action
    return keys


def parse_with_config(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The parser's arguments, with --config's file as the defaults the command line overrides."""
    early = argparse.ArgumentParser(add_help=False)
    early.add_argument("--config")
    path = early.parse_known_args(argv)[0].config
    if path is not None:
        try:
            parser.set_defaults(**read_config(path, parser))
        except UsageError as exc:
            fail(parser.prog, str(exc))
    return parser.parse_args(argv)


def read_config(path: str, parser: argparse.ArgumentParser) -> dict:
    """{dest: value} of a TOML file's keys, each checked against its flag."""
    try:
        with open(path, "rb") as f:
            table = tomllib.load(f)
    except OSError as exc:
        raise UsageError(f"--config {path}: cannot be read ({exc.strerror})") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"--config {path}: not TOML ({exc})") from None
    keys = flags_by_key(parser)
    values = {}
    for key, value in table.items():
        action = keys.get(key.replace("_", "-"))
        if action is None:
            close = difflib.get_close_matches(key.replace("_", "-"), keys, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise UsageError(f"--config {path}: {key!r} is not a flag of {parser.prog}{hint}")
        values[action.dest] = checked(action, value, f"--config {path}: {key}")
    return values


def checked(action: argparse.Action, value, where: str):
    """`value` as the flag would have parsed it, or UsageError naming where and what was expected."""
    # a switch (--name, --no-name, or both: BooleanOptionalAction): the key takes true or false
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction | argparse.BooleanOptionalAction):
        if not isinstance(value, bool):
            raise UsageError(f"{where} = {value!r}: expected true or false")
        return not value if isinstance(action, argparse._StoreFalseAction) else value
    if action.type is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise UsageError(f"{where} = {value!r}: expected an integer")
    if action.type is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise UsageError(f"{where} = {value!r}: expected a number")
        value = float(value)
    if action.type not in (int, float):
        if not isinstance(value, str):
            raise UsageError(f"{where} = {value!r}: expected a string")
        if callable(action.type):
            try:
                value = action.type(value)
            except (argparse.ArgumentTypeError, ValueError) as exc:
                raise UsageError(f"{where} = {value!r}: {exc}") from None
    if action.choices is not None and value not in action.choices and value != action.default:  # "": unset
        raise UsageError(f"{where} = {value!r}: expected one of {', '.join(map(str, action.choices))}")
    return value


def resolved(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """{key: value} of every flag that has a value (what --print-config writes and a checkpoint records)."""
    out = {}
    for key, action in flags_by_key(parser).items():
        value = getattr(args, action.dest)
        if isinstance(action, argparse._StoreFalseAction):
            value = not value
        if value is not None:
            out[key] = value
    return out


def as_toml(config: dict) -> str:
    """`config`'s scalars as TOML lines (strings in JSON's escapes, which TOML's basic strings share)."""
    lines = []
    for key, value in config.items():
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, float) and not math.isfinite(value):
            text = "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
        elif isinstance(value, int | float):
            text = repr(value)
        else:
            text = json.dumps(str(value), ensure_ascii=False)
        lines.append(f"{key} = {text}")
    return "\n".join(lines) + "\n"
