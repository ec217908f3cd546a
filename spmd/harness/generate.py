"""python -m spmd generate --load DIR --prompt TEXT: sample text from a trained language model's checkpoint.

Loads the newest checkpoint under DIR (saved on any mesh) onto one device, reading every unit whole from the
ranks' files, and decodes with a key/value cache (spmd.model.decode); the tokenizer is the one the run's corpus
was prepared with (the manifest names its folder).
"""

from __future__ import annotations

import json
import sys

import numpy as np

from spmd.data.tokenizer import load_tokenizer
from spmd.model.config import Net
from spmd.model.decode import generate
from spmd.model.registry import full_sizes
from spmd.trainers import checkpoint
from spmd.usage import Parser, fail


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


def main(argv=None) -> int:
    p = Parser(prog="python -m spmd generate", description=__doc__.splitlines()[0])
    p.add_argument("--load", required=True, metavar="DIR", help="a checkpoint folder (or the --save folder)")
    p.add_argument("--prompt", default="", help="the text to continue")
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0: the most likely token each time")
    p.add_argument("--top-k", type=int, default=40, help="sample among the k most likely (0: all)")
    p.add_argument("--seed", type=int, default=0, help="the sampler's: the same seed, the same text")
    args = p.parse_args(argv)
    try:
        folder = checkpoint.latest(args.load)
        net, units, biases, manifest = load_units(folder)
        if manifest.get("data") is None:
            raise ValueError(f"--load {args.load}: trained on synthetic tokens (no --data): there is no tokenizer to "
                             "turn its tokens into text")
        tokenizer = load_tokenizer(manifest["data"]["folder"])
        prompt = tokenizer.encode(args.prompt)  # nothing: start where a document starts, after the end token
        start = prompt if len(prompt) else np.array([tokenizer.end])
        ids = generate(net, units, start, args.max_tokens, args.temperature, args.top_k, args.seed, biases)
    except (ValueError, OSError) as exc:
        fail(p.prog, str(exc))
    sys.stdout.write(args.prompt + tokenizer.decode(ids) + "\n")
    return 0
