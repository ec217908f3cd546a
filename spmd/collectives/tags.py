"""The tags of the collectives and protocols, one number each within a group's context."""

from enum import IntEnum


class Tag(IntEnum):
    """Each protocol its own tag, so two in flight between the same ranks never take each other's messages."""

    RING = 1  # ring_allgather (the FSDP matmul's rotating shards)
    GATHER = 2
    BARRIER = 3
    REDUCE_SCATTER = 4
    ALL_GATHER = 5
    BROADCAST = 6
    ALL_TO_ALL = 7
    SHIFT = 8  # ring attention's K blocks (ring_shift's default)
    SHIFT_V = 9  # its V blocks and their dK, dV accumulators: all in flight at once
    SHIFT_DK = 10
    SHIFT_DV = 11
    TIED = 12  # a tied weight's gradient, exchanged between the first and the last pipeline stage
    EXPERT_COUNTS = 13  # a mixture of experts over ep: the pairs each rank sends each expert,
    EXPERT_ROWS = 14  # then the pairs' rows (and their gradients back),
    EXPERT_GATES = 15  # and their gates (and the gates' gradients back)
    PIPE = 16  # pipeline messages: 16..255, see pipe_tag


PIPE_MESSAGES = 120  # (micro-batch, chunk) numbers tagged modulo this (one pair and direction stays in order)


def pipe_tag(backward: bool, microbatch: int, boundary: int = 0, boundaries: int = 1) -> int:
    """A pipeline message's tag: its direction, micro-batch and the stage boundary it crosses (stage b to b + 1),
    so a 2-stage pipeline, where both directions join the same two ranks, never takes a gradient for an
    activation (Megatron-LM#750), and an interleaved or V one never takes one chunk's activation for another's."""
    return Tag.PIPE + 2 * ((microbatch * boundaries + boundary) % PIPE_MESSAGES) + int(backward)
