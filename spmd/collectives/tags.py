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
    PIPE_FORWARD = 8  # pipeline activations, stage s -> s + 1
    PIPE_BACKWARD = 9  # pipeline gradients, stage s + 1 -> s
