"""python -m spmd generate --load DIR --prompt TEXT: sample text from a trained language model's checkpoint.

Loads the newest checkpoint under DIR (saved on any mesh) onto one device, reading every unit whole from the
ranks' files, and decodes with a key/value cache (spmd.model.decode); the tokenizer is the one the run's corpus
was prepared with (the manifest names its folder). The text is printed as it is sampled (spmd.harness.sampling,
the path run.generate takes too), after every flag and the prompt were checked.
"""

from __future__ import annotations

import json
from itertools import chain
from pathlib import Path

import numpy as np

from spmd.data.tokenizer import load_tokenizer
from spmd.harness.sampling import Controls, TextSampler, stop_texts
from spmd.model.config import Net
from spmd.model.registry import full_sizes
from spmd.trainers import checkpoint
from spmd.usage import Parser, at_least, fail, readable, say


def load_units(folder) -> tuple[Net, list[np.ndarray], dict[int, np.ndarray], dict]:
    """(the run's Net, every unit's parameters whole, the balancing bias of each unit that has one (--bias-balance),
    the manifest) of a checkpoint folder."""
    manifest = json.loads((folder / "manifest.json").read_text())
    net = Net(**manifest["run"])
    reader = checkpoint.Reader(folder, manifest)
    units = []
    for unit, size in enumerate(full_sizes(net)):
        values = np.empty(size, dtype=np.float64)
        reader.read(unit, "params", np.arange(size), values)
        units.append(values)
    biases = {}
    for unit in range(len(units)):
        if reader.has(unit, "bias"):
            biases[unit] = np.empty(net.experts, dtype=np.float64)
            reader.read(unit, "bias", np.arange(net.experts), biases[unit])
    return net, units, biases, manifest


def parser() -> Parser:
    p = Parser(prog="python -m spmd generate", description=__doc__.splitlines()[0])
    p.add_argument("--load", required=True, metavar="DIR", help="a checkpoint folder (or the --save folder)")
    given = p.add_mutually_exclusive_group()
    given.add_argument(
        "--prompt", metavar="TEXT", help="the text to continue (left out: start where a document starts)"
    )
    given.add_argument("--prompt-file", metavar="PATH", help="the text to continue, read from a UTF-8 file as is")
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0: the most likely token each time")
    p.add_argument("--top-k", type=int, default=40, help="sample among the k most likely (0: all)")
    p.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        metavar="P",
        help="then among the fewest most likely whose probabilities sum to >= P (nucleus; 1: all)",
    )
    p.add_argument(
        "--stop",
        action="append",
        metavar="TEXT",
        help="end a sample as soon as its new text contains TEXT; TEXT itself is not printed "
        "(repeatable: the first found)",
    )
    p.add_argument(
        "--num-samples",
        type=int,
        default=1,
        metavar="N",
        help="N samples of the prompt, each after a line '--- sample i of N ---'; sample i draws from "
        "(--seed, i - 1), so sample 1 is the single sample's text",
    )
    p.add_argument("--seed", type=int, default=0, help="the sampler's: the same seed, the same text")
    return p


def read_prompt(args) -> tuple[str | None, str]:
    """The prompt (None: none given) and the flag that gave it."""
    if args.prompt_file is None:
        return args.prompt, "--prompt"
    flag = f"--prompt-file {args.prompt_file}"
    data = Path(readable("--prompt-file", args.prompt_file)).read_bytes()
    try:
        return data.decode("utf-8"), flag
    except UnicodeDecodeError as exc:
        raise ValueError(f"{flag}: not UTF-8 (byte 0x{data[exc.start]:02x} at offset {exc.start})") from None


def sampler(args) -> TextSampler:
    """The checkpoint's model and tokenizer, the prompt and the controls, all checked: nothing is printed yet."""
    at_least("--num-samples", args.num_samples, 1)
    controls = Controls(args.max_tokens, args.temperature, args.top_k, args.top_p, stop_texts(args.stop), args.seed)
    controls.check()  # before the checkpoint is read: a typo is told at once
    prompt, flag = read_prompt(args)
    folder = checkpoint.latest(args.load)
    net, units, biases, manifest = load_units(folder)
    if manifest.get("data") is None:
        raise ValueError(
            f"--load {args.load}: trained on synthetic tokens (no --data): there is no tokenizer to "
            "turn its tokens into text"
        )
    tokenizer = load_tokenizer(manifest["data"]["folder"])
    return TextSampler(net, units, biases, tokenizer, prompt, controls, prompt_flag=flag)


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    try:
        samples = sampler(args)
    except (ValueError, OSError) as exc:
        fail(p.prog, str(exc))
    n = args.num_samples
    for index in range(n):
        heading = [f"--- sample {index + 1} of {n} ---\n"] if n > 1 else []
        for piece in chain(heading, samples.pieces(index), ["\n"]):  # each piece printed as soon as it is drawn
            if not say(piece, end=""):  # the reader has gone (| head): stop sampling
                return 0
    return 0
