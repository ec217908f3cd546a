"""Group: one rank's view of a subset of the world, with local ranks and its own tags.

Collectives and strategies talk only to a Group. Peers are local ranks
(0..size-1); a message's tag is the group's tag plus the group's context, so
messages of two groups (two mesh axes, say) between the same two ranks can
never match each other. Written once over the base communicator: the same
on threads and under MPI, and traffic stays recorded per global peer and wire tag.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from spmd.transport.comm import ANY, MAX_TAG, BaseCommunicator, Request, check_rank
from spmd.transport.traffic import Traffic

TAGS_PER_CONTEXT = 256  # tags a group may use: 0..255
MAX_CONTEXT = (MAX_TAG + 1) // TAGS_PER_CONTEXT - 1  # 127: wire tags stay within MPI's guaranteed range


@dataclass(frozen=True, eq=False)
class Group:
    """The ranks `members` (global ranks, in local-rank order) as seen from `global_rank`.

    Args:
        comm: the world's communicator (threads or MPI).
        global_rank: the calling rank, one of `members`.
        members: global ranks of the group; local rank i is members[i].
        context: 0..MAX_CONTEXT; groups that share a rank and are used at
            the same time need different contexts (a Mesh gives each axis its own).
    """

    comm: BaseCommunicator
    global_rank: int
    members: tuple[int, ...]
    context: int = 0
    _local: dict = field(init=False, repr=False)

    def __post_init__(self):
        members = tuple(int(m) for m in self.members)
        object.__setattr__(self, "members", members)
        for m in members:
            check_rank("group member", m, self.comm.num_devices)
        if len(set(members)) != len(members):
            raise ValueError(f"group members repeat a rank: {members}")
        if self.global_rank not in members:
            raise ValueError(f"rank {self.global_rank} is not a member of group {members}")
        if isinstance(self.context, bool) or not 0 <= self.context <= MAX_CONTEXT:
            raise ValueError(f"group context {self.context!r} is outside 0..{MAX_CONTEXT}")
        object.__setattr__(self, "_local", {g: i for i, g in enumerate(members)})

    @classmethod
    def world(cls, comm: BaseCommunicator, rank: int) -> Group:
        """Every rank of `comm`, local rank = global rank, context 0 (tags unchanged on the wire)."""
        return cls(comm, rank, tuple(range(comm.num_devices)), 0)

    @property
    def rank(self) -> int:
        """This rank's place in the group."""
        return self._local[self.global_rank]

    @property
    def size(self) -> int:
        return len(self.members)

    def to_global(self, local: int) -> int:
        """The world rank of local rank `local`."""
        check_rank("local", local, self.size)
        return self.members[local]

    def wire_tag(self, tag: int) -> int:
        """The tag a message of this group carries between processes."""
        if isinstance(tag, bool) or not isinstance(tag, (int, np.integer)) or not 0 <= tag < TAGS_PER_CONTEXT:
            raise ValueError(f"a group's tag must be an int in 0..{TAGS_PER_CONTEXT - 1}, got {tag!r}")
        return self.context * TAGS_PER_CONTEXT + int(tag)

    def send(self, dst: int, data, tag: int = 0) -> None:
        """Send a copy of `data` to local rank `dst`; never blocks."""
        self.comm.send(self.global_rank, self.to_global(dst), as_bits(data), tag=self.wire_tag(tag))

    def isend(self, dst: int, data: np.ndarray, tag: int = 0) -> Request:
        """Start sending `data` (not copied: leave it alone until the request completes)."""
        return self.comm.isend(self.global_rank, self.to_global(dst), as_bits(data), tag=self.wire_tag(tag))

    def recv(self, src: int = ANY, tag: int = 0) -> tuple[int, np.ndarray]:
        """(local sender, array): the oldest message of this group's `tag` from `src` (or any member)."""
        sender, data = self.comm.recv(self.global_rank, ANY if src == ANY else self.to_global(src), self.wire_tag(tag))
        if sender not in self._local:  # only a group with a context shared by an overlapping group gets here
            raise ValueError(
                f"rank {self.global_rank} got a message of context {self.context} from rank {sender}, "
                f"not a member of {self.members}: give overlapping groups different contexts"
            )
        return self._local[sender], data

    def irecv(self, src: int, tag: int, out: np.ndarray) -> Request:
        """Start receiving the next message of `tag` from local rank `src` into `out`."""
        return _LocalRecv(
            self.comm.irecv(self.global_rank, self.to_global(src), self.wire_tag(tag), as_bits(out)), src, out
        )

    def traffic(self) -> Traffic:
        """This rank's traffic on the whole communicator (every group's messages, by global peer and wire tag)."""
        return self.comm.traffic(self.global_rank)

    def __repr__(self) -> str:
        return f"Group(rank {self.rank} of {self.members}, context {self.context})"


class _LocalRecv(Request):
    """An irecv whose wait returns the local source rank."""

    def __init__(self, request: Request, src: int, out: np.ndarray):
        self._request, self._src, self._out = request, src, out

    def test(self) -> bool:
        return self._request.test()

    def wait(self) -> tuple[int, np.ndarray]:
        self._request.wait()
        return self._src, self._out


def as_bits(data):
    """A float type numpy lacks (ml_dtypes' bfloat16: MPI has no datatype for it) travels as its bits: the same
    bytes viewed as an unsigned integer; anything else as it is."""
    if (
        isinstance(data, np.ndarray)
        and data.dtype.kind == "V"
        and data.dtype.fields is None
        and data.dtype.itemsize in (1, 2, 4, 8)
    ):
        return data.view(f"u{data.dtype.itemsize}")
    return data
