"""Ring shift on a Group: every rank passes a block to the next rank and takes one from the previous.

Ring attention's step: the K/V blocks (and in backward their gradient accumulators) move one hop around
the context-parallel ring while the ranks compute on the blocks they hold. Started, not finished: the
caller computes, then waits on the two requests, so the transfer runs under the compute.
"""

from __future__ import annotations

import numpy as np

from spmd.collectives.tags import Tag
from spmd.transport.comm import Request
from spmd.transport.group import Group


def start_shift(group: Group, block: np.ndarray, out: np.ndarray, tag: int = Tag.SHIFT) -> tuple[Request, Request]:
    """Send `block` to rank + 1 and receive rank - 1's into `out` (its shape the caller's to know). Returns
    (receive, send): wait in that order (on threads a send completes only once its receiver waits)."""
    size, rank = group.size, group.rank
    receiving = group.irecv((rank - 1) % size, tag, out)
    return receiving, group.isend((rank + 1) % size, block, tag)


def ring_shift(group: Group, block: np.ndarray, out: np.ndarray, tag: int = Tag.SHIFT) -> np.ndarray:
    """The blocking form: out holds rank - 1's block."""
    for request in start_shift(group, block, out, tag):
        request.wait()
    return out


def progress(requests) -> None:
    """Let MPI move messages in flight while the caller computes (a large message moves only inside MPI calls)."""
    for request in requests:
        request.test()
