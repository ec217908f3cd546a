"""The PyTorch peer of the LM benchmark: the same Llama-style model (RMSNorm, half-split RoPE, SwiGLU, untied head,
mean cross-entropy, AdamW, float32) written the plain way in PyTorch eager, on the same cores: one process of
`threads` threads, or `ranks` processes of one thread each under DDP or FSDP2 over gloo. An optional peer,
imported only when torch is: never a dependency of spmd or of its tests.

python -m spmd.bench.torch_peer CONFIG_JSON prints one JSON line: rank 0's step seconds (the first step, which
touches fresh memory, left out).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Callable
from queue import Empty

Runner = Callable[[dict, int, int], object]


def build(config: dict):
    import torch
    from torch import nn

    h, f, heads, seq, vocab = config["hidden"], config["ffn"], config["heads"], config["seq"], config["vocab"]
    d = h // heads

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.g1, self.g2 = nn.Parameter(torch.ones(h)), nn.Parameter(torch.ones(h))
            self.wq, self.wk, self.wv, self.wo = (nn.Linear(h, h, bias=False) for _ in range(4))
            self.w1, self.w3 = nn.Linear(h, f, bias=False), nn.Linear(h, f, bias=False)
            self.w2 = nn.Linear(f, h, bias=False)

        def forward(self, x, cos, sin):
            b = x.shape[0]
            n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.g1
            q, k, v = (w(n).view(b, seq, heads, d).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            o = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.wo(o.transpose(1, 2).reshape(b, seq, h))
            n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.g2
            return x + self.w2(nn.functional.silu(self.w1(n)) * self.w3(n))

    def rotate(u, cos, sin):
        a, b = u[..., : d // 2], u[..., d // 2 :]
        return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, h)
            self.blocks = nn.ModuleList(Block() for _ in range(config["layers"]))
            self.g = nn.Parameter(torch.ones(h))
            self.head = nn.Linear(h, vocab, bias=False)
            theta = 10000.0 ** (-2 * torch.arange(d // 2) / d)
            angle = torch.arange(seq)[:, None] * theta[None, :]
            self.register_buffer("cos", angle.cos(), persistent=False)
            self.register_buffer("sin", angle.sin(), persistent=False)

        def forward(self, ids, targets):
            x = self.embed(ids)
            for block in self.blocks:
                x = block(x, self.cos, self.sin)
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.g
            return nn.functional.cross_entropy(self.head(x).view(-1, vocab), targets.view(-1))

    return LM()


def run(config: dict, rank: int, ranks: int) -> list[float]:
    import torch

    torch.manual_seed(0)
    model = build(config)
    if config["mode"] == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif config["mode"] == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = config["batch"] // ranks
    generator = torch.Generator().manual_seed(rank)
    seconds = []
    for _ in range(config["steps"] + 1):
        ids = torch.randint(0, config["vocab"], (batch, config["seq"]), generator=generator)
        targets = torch.randint(0, config["vocab"], (batch, config["seq"]), generator=generator)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        model(ids, targets).backward()
        optimizer.step()
        seconds.append(time.perf_counter() - start)
    return seconds[1:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank: int, ranks: int, config: dict, port: int, queue, run: Runner) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    try:
        result = run(config, rank, ranks)
        if rank == 0:
            queue.put(result)
    finally:
        dist.destroy_process_group()


def launch(config: dict, run: Runner):
    """run(config, rank, ranks) in one process of config["threads"] threads (mode "single"), or on
    config["ranks"] processes of a thread each joined over gloo: rank 0's result."""
    import torch
    import torch.multiprocessing as mp

    if config["mode"] == "single":
        torch.set_num_threads(config["threads"])
        return run(config, 0, 1)
    ranks, context = config["ranks"], mp.get_context("spawn")
    queue = context.Queue()
    port = free_port()
    processes = [context.Process(target=worker, args=(r, ranks, config, port, queue, run)) for r in range(ranks)]
    for p in processes:
        p.start()
    try:
        while True:  # rank 0's result, or the first rank that died (the others would wait in gloo for ever)
            try:
                result = queue.get(timeout=1)
                break
            except Empty:
                dead = [r for r, p in enumerate(processes) if p.exitcode not in (None, 0)]
                if dead:
                    for p in processes:
                        p.terminate()  # the living ranks wait for the dead one in gloo
                    raise RuntimeError(
                        f"the PyTorch peer's rank {dead[0]} of {ranks} failed (its traceback above)"
                    ) from None
    finally:
        for p in processes:
            p.join(60 if p.exitcode is None else 0)
            if p.is_alive():
                p.terminate()
    return result


def step_seconds(config: dict, rank: int, ranks: int) -> dict:
    """The JSON line's record: rank `rank`'s step seconds on random tokens (run)."""
    return {"step_seconds": run(config, rank, ranks)}


if __name__ == "__main__":
    from spmd.bench.torch_peer import step_seconds as by_name  # spawn pickles a function by its module's name

    print(json.dumps(launch(json.loads(sys.argv[1]), by_name)))
