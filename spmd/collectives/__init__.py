"""Collectives written once on a Group's point-to-point messages; each has a reference and a cost.

ring.py: all-gather (streamed or in place), reduce-scatter, all-reduce;
rooted.py: gather, row gather, barrier, broadcast; alltoall.py: all-to-all(v); shift.py: ring shift;
reference.py: what each must give (`*_ref`); cost.py: bytes per rank.
"""

from spmd.collectives.alltoall import all_to_all, all_to_all_into
from spmd.collectives.ring import all_gather, all_reduce, reduce_scatter, ring_allgather
from spmd.collectives.rooted import (
    alone_at_root,
    barrier,
    broadcast,
    gather,
    gather_rows,
    result_rows,
    stream_rows,
)
from spmd.collectives.shift import ring_shift, start_shift
from spmd.collectives.tags import Tag
from spmd.collectives.workspace import Workspace, scratch

__all__ = [
    "Tag",
    "Workspace",
    "alone_at_root",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "all_to_all_into",
    "barrier",
    "broadcast",
    "gather",
    "gather_rows",
    "reduce_scatter",
    "result_rows",
    "ring_allgather",
    "ring_shift",
    "scratch",
    "start_shift",
    "stream_rows",
]
