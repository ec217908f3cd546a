"""All-to-all on a Group: every rank sends a block of its own to every other rank, directly."""

import numpy as np

from spmd.collectives.tags import Tag
from spmd.transport.group import Group


def all_to_all(group: Group, blocks: list, tag: int = Tag.ALL_TO_ALL) -> list:
    """Send blocks[q] to rank q; return the block each rank sent here, in source order.

    Communication: pairwise, not around a ring: at step k this rank sends to
    rank + k and receives from rank - k, so each block crosses one link once.
    Blocks may differ in shape and size (all-to-all-v); the receiver learns
    each from its message. Its own block stays (no copy, no message).
    """
    size, rank = group.size, group.rank
    if len(blocks) != size:
        raise ValueError(f"all_to_all needs one block per rank ({size}), got {len(blocks)}")
    received: list = [None] * size
    received[rank] = blocks[rank]
    sending = []
    for k in range(1, size):
        sending.append(group.isend((rank + k) % size, np.asarray(blocks[(rank + k) % size], order="C"), tag))
        src, received[(rank - k) % size] = group.recv(src=(rank - k) % size, tag=tag)
    for request in sending:
        request.wait()
    return received


def all_to_all_into(group: Group, blocks: list, out: list, tag: int = Tag.ALL_TO_ALL) -> None:
    """all_to_all into preallocated blocks: out[q] receives what rank q addressed here (its shape fixed by the
    caller, so nothing is allocated). Every block must be C-contiguous; its own block is copied."""
    size, rank = group.size, group.rank
    if len(blocks) != size or len(out) != size:
        raise ValueError(
            f"all_to_all_into needs one block and one out per rank ({size}), got {len(blocks)} and {len(out)}"
        )
    np.copyto(out[rank], blocks[rank])
    receiving = [group.irecv((rank - k) % size, tag, out[(rank - k) % size]) for k in range(1, size)]
    sending = [group.isend((rank + k) % size, blocks[(rank + k) % size], tag) for k in range(1, size)]
    for request in receiving + sending:
        request.wait()
