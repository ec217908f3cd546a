"""The PyTorch peer trained on text: spmd/bench/torch_peer.py's model, started from spmd's own initial values (the
same numbers, not only the same distribution), fed spmd's batches of a prepared corpus (spmd.data.loader.Corpus:
the same samples in the same order), stepped by the same AdamW, learning-rate schedule (Net.rate_at) and global-norm
clipping, and scored on the same validation batches. Whatever differs between its run and spmd's is then the
number of steps each fits in the time, and float32 rounding.

python -m spmd.bench.torch_text CONFIG_JSON prints one JSON line: the first step's loss (the whole batch's), rank
0's step seconds (every step), their sum and the validation loss at the end (nats a token and bits a byte).
"""

from __future__ import annotations

import json
import math
import sys
import time

from spmd.bench.torch_peer import build, launch


def spmd_net(config: dict):
    """spmd's Net of the peer's config: what gives the initial values, the schedule and the optimizer's constants."""
    from spmd.model import Net

    fields = ("layers", "hidden", "ffn", "heads", "seq", "batch", "vocab", "steps", "lr", "warmup", "lr_min")
    return Net(
        model="llama",
        dtype="float32",
        optimizer="adamw",
        lr_schedule="cosine",
        clip_grad=config["clip_grad"],
        **{k: config[k] for k in fields},
    )


def load_initial(model, net) -> None:
    """spmd's step-0 parameters into the torch model: its matrices are x @ W, nn.Linear's x @ weight^T."""
    import torch

    from spmd.model.llama import initial_unit, table, unit_kinds
    from spmd.model.params import Flat

    linear = ("wq", "wk", "wv", "wo", "w1", "w3", "w2")
    state = {}
    for unit, kind in enumerate(unit_kinds(net)):
        pieces = Flat(table(net, kind)).named(initial_unit(net, unit))
        if kind in ("embed", "head", "norm"):
            key = {"embed": "embed.weight", "head": "head.weight", "norm": "g"}[kind]
            state[key] = pieces[table(net, kind)[0].name]
            continue
        for name, value in pieces.items():
            key = f"blocks.{unit - 1}.{name}" + (".weight" if name in linear else "")
            state[key] = value.T if name in linear else value
    model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in state.items()})


def batch_mean(loss: float, ranks: int) -> float:
    """The whole batch's mean loss from each rank's (equal shares)."""
    if ranks == 1:
        return loss
    import torch
    import torch.distributed as dist

    value = torch.tensor(loss / ranks, dtype=torch.float64)
    dist.all_reduce(value)
    return float(value)


def run(config: dict, rank: int, ranks: int) -> dict:
    import numpy as np
    import torch

    from spmd.data.loader import Corpus
    from spmd.harness.loop import evaluations

    net = spmd_net(config)
    model = build(config)
    load_initial(model, net)
    if ranks > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=net.rate_at(1), weight_decay=net.weight_decay)
    corpus = Corpus(config["data"], net.seq, net.batch, net.seed)
    rows = slice(rank * net.tokens // ranks, (rank + 1) * net.tokens // ranks)  # this rank's sequences of a batch
    tensor = lambda rows_of: torch.from_numpy(rows_of[rows]).view(-1, net.seq)  # noqa: E731
    first, seconds = math.nan, []
    for step in range(1, net.steps + 1):
        ids, targets = corpus.batch_data(step - 1)
        start = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = net.rate_at(step)
        optimizer.zero_grad(set_to_none=True)
        loss = model(tensor(ids), tensor(targets))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), net.clip_grad)
        optimizer.step()
        if step == 1:
            first = float(loss.detach())  # this rank's rows' mean (under DDP: its share of the batch)
        seconds.append(time.perf_counter() - start)
    evals = evaluations(corpus, config["eval_tokens"], net.steps)
    assert evals is not None
    with torch.no_grad():
        scored = (model(*(torch.from_numpy(np.asarray(b)).view(-1, net.seq) for b in pair)) for pair in evals.batches)
        loss = float(np.mean([float(x) for x in scored]))
    return {
        "first_loss": batch_mean(first, ranks),
        "step_seconds": seconds,
        "train_seconds": sum(seconds),
        "validation": {"loss": loss, "bits_per_byte": loss * evals.bits_a_nat},
    }


if __name__ == "__main__":
    from spmd.bench.torch_text import run as train  # by its module's name: spawn pickles it

    print(json.dumps(launch(json.loads(sys.argv[1]), train)))
