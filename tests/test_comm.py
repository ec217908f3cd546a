"""Point-to-point semantics, one body per behaviour, on threads and on MPI."""

import numpy as np
import pytest

from spmd.transport.comm import ANY, CommError
from spmd.transport.wire import as_bytes, pack_header, unpack_header

PAYLOADS = [
    np.arange(12, dtype=np.float64).reshape(3, 4),
    np.arange(6, dtype=np.float32).reshape(2, 3).T,  # not contiguous
    (np.arange(4) + 1j).astype(np.complex128),
    np.array([[True, False]]),
    np.arange(-3, 3, dtype=np.int8),
    np.arange(5, dtype=">i4"),  # big-endian stays big-endian
    np.float64(2.5),  # 0-d
    np.empty((0, 7)),
    np.ones((2, 3, 4), dtype=np.uint16),
    np.random.default_rng(0).standard_normal((512, 300)),  # 1.2 MB: far past MPICH's eager limit
]


def exchange_preserves_every_payload(comm, rank):
    """Each rank sends every payload to its right neighbour before receiving any."""
    size = comm.num_devices
    for payload in PAYLOADS:
        comm.send(rank, (rank + 1) % size, payload)
    for payload in PAYLOADS:
        src, got = comm.recv(rank, src=(rank - 1) % size)
        assert src == (rank - 1) % size
        assert got.shape == np.shape(payload) and got.dtype == np.asarray(payload).dtype
        np.testing.assert_array_equal(got, payload)


def test_payloads_arrive_with_shape_and_dtype(world):
    world.run(exchange_preserves_every_payload)


def sender_may_reuse_its_buffer(comm, rank):
    size = comm.num_devices
    buf = np.full(1000, float(rank))
    comm.send(rank, (rank + 1) % size, buf)
    buf[:] = -1.0  # changing the buffer after send must not change the message
    _, got = comm.recv(rank, src=(rank - 1) % size)
    assert np.all(got == (rank - 1) % size)
    got[0] = 123.0  # the receiver owns what it got: writable


def test_send_hands_over_a_copy(world):
    world.run(sender_may_reuse_its_buffer)


def tags_and_sources_select_messages(comm, rank):
    """Rank 0 receives in the reverse of the order messages were sent, by tag and source."""
    size = comm.num_devices
    if rank != 0:
        for tag in (5, 6, 7):
            comm.send(rank, 0, np.array([rank, tag]), tag=tag)
        return
    for tag in (7, 6, 5):
        for src in reversed(range(1, size)):
            got_src, got = comm.recv(0, src=src, tag=tag)
            assert got_src == src and got.tolist() == [src, tag]
    comm.send(0, 0, np.array([1.0]), tag=9)  # a rank may message itself
    assert comm.recv(0, src=ANY, tag=9)[0] == 0


def test_recv_matches_tag_and_source(world):
    world.run(tags_and_sources_select_messages)


def same_pair_same_tag_is_fifo(comm, rank):
    size = comm.num_devices
    right, left = (rank + 1) % size, (rank - 1) % size
    for i in range(50):
        comm.send(rank, right, np.array([i]), tag=3)
    assert [comm.recv(rank, src=left, tag=3)[1][0] for _ in range(50)] == list(range(50))


def test_order_between_one_pair_is_kept(world):
    world.run(same_pair_same_tag_is_fifo)


def bad_calls_raise_named_errors(comm, rank):
    size = comm.num_devices
    with pytest.raises(ValueError, match=f"dst rank {size} is outside"):
        comm.send(rank, size, np.zeros(1))
    with pytest.raises(ValueError, match="src rank -2 is outside"):
        comm.recv(rank, src=-2)
    with pytest.raises(ValueError, match="tag 40000 is outside"):
        comm.send(rank, rank, np.zeros(1), tag=40000)
    with pytest.raises(TypeError, match="numeric arrays only"):
        comm.send(rank, rank, np.array([{"a": 1}], dtype=object))
    with pytest.raises(TypeError, match="must be an int rank"):
        comm.send(rank, "0", np.zeros(1))
    if size > 1:
        other = (rank + 1) % size
        with pytest.raises(ValueError, match=f"rank {rank} cannot send as rank {other}"):
            comm.send(other, rank, np.zeros(1))
        with pytest.raises(ValueError, match=f"rank {rank} cannot receive for rank {other}"):
            comm.recv(other)


def test_bad_calls_are_clear_errors(world):
    world.run(bad_calls_raise_named_errors)


def irecv_into_preallocated_buffers(comm, rank):
    """isend from the array itself, irecv straight into a buffer posted before the message."""
    size = comm.num_devices
    right, left = (rank + 1) % size, (rank - 1) % size
    out = np.empty((300, 40))  # 96 KB: past the eager limit
    incoming = comm.irecv(rank, left, 6, out)  # posted before anything was sent
    data = np.full((300, 40), float(rank))
    sending = comm.isend(rank, right, data, tag=6)
    assert incoming.wait() == (left, out)
    assert np.all(out == left)
    sending.wait()
    assert sending.test() and incoming.test()  # complete requests stay complete


def test_isend_and_irecv(world):
    world.run(irecv_into_preallocated_buffers)


def mismatched_message_names_both_ranks(comm, rank):
    size = comm.num_devices
    right, left = (rank + 1) % size, (rank - 1) % size
    sending = comm.isend(rank, right, np.zeros((2, 3), dtype=np.float32), tag=7)
    with pytest.raises(
        CommError, match=f"rank {rank} expected float64 \\(3, 2\\) from rank {left} \\(tag 7\\), got float32 \\(2, 3\\)"
    ):
        comm.irecv(rank, left, 7, np.empty((3, 2))).wait()
    if size == 1:
        return  # the message checked was our own: its receive was cancelled
    # The sender's request completes (the data went nowhere); nothing else is disturbed.
    comm.send(rank, right, np.arange(3), tag=8)
    assert comm.recv(rank, src=left, tag=8)[1].tolist() == [0, 1, 2]
    del sending


def test_a_message_that_does_not_fit_is_an_error_naming_both_ranks(world):
    world.run(mismatched_message_names_both_ranks)


def irecv_argument_errors(comm, rank):
    with pytest.raises(ValueError, match="writeable C-contiguous"):
        comm.irecv(rank, rank, 1, np.empty((4, 4))[:, :2])
    with pytest.raises(ValueError, match="src rank -1 is outside"):
        comm.irecv(rank, -1, 1, np.empty(2))


def test_irecv_needs_a_source_and_a_buffer(world):
    world.run(irecv_argument_errors)


@pytest.mark.parametrize("payload", PAYLOADS, ids=lambda p: f"{np.asarray(p).dtype}{np.shape(p)}")
def test_wire_header_round_trip(payload):
    array = np.asarray(payload)
    assert unpack_header(pack_header(array.dtype, array.shape)) == (array.dtype, array.shape)
    assert as_bytes(np.ascontiguousarray(array)).nbytes == array.nbytes


def test_wire_rejects_garbled_headers():
    garbled = pack_header(np.dtype(np.float64), (3,))
    garbled[:3] = np.frombuffer(b"|O8", np.uint8)
    with pytest.raises(CommError, match="malformed message header"):
        unpack_header(garbled)
    with pytest.raises(CommError, match="malformed message header"):
        unpack_header(np.frombuffer(b"<f8 -3".ljust(256), np.uint8))
