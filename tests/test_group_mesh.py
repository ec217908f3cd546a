"""Group (local ranks, its own tags) and Mesh (named axes, row-major, last axis fastest)."""

import numpy as np
import pytest

from spmd.collectives import Tag, all_reduce, ring_allgather
from spmd.transport.group import MAX_CONTEXT, TAGS_PER_CONTEXT, Group
from spmd.transport.mesh import Mesh
from spmd.transport.threads import Chaos, Communicator, run_threads


def test_mesh_is_row_major_with_the_last_axis_fastest():
    mesh = Mesh({"fsdp": 2, "tp": 2})
    assert [mesh.coords(r) for r in range(4)] == [
        {"fsdp": 0, "tp": 0},
        {"fsdp": 0, "tp": 1},
        {"fsdp": 1, "tp": 0},
        {"fsdp": 1, "tp": 1},
    ]
    assert mesh.members("tp", 0) == (0, 1) and mesh.members("tp", 3) == (2, 3)  # TP peers adjacent
    assert mesh.members("fsdp", 1) == (1, 3)
    assert mesh.members(("fsdp", "tp"), 2) == (0, 1, 2, 3)


@pytest.mark.parametrize("shape", [{"a": 3}, {"dp": 2, "tp": 3}, {"pp": 2, "dp": 2, "tp": 2}])
def test_coordinates_round_trip_and_each_axis_partitions_the_world(shape):
    mesh = Mesh(shape)
    for rank in range(mesh.size):
        assert mesh.rank_of(mesh.coords(rank)) == rank
    for axis in mesh.names:
        groups = {mesh.members(axis, r) for r in range(mesh.size)}
        assert sorted(r for g in groups for r in g) == list(range(mesh.size))  # disjoint, covering
        assert all(len(g) == mesh.axis_size(axis) for g in groups)


def test_each_set_of_axes_has_its_own_context():
    mesh = Mesh({"pp": 2, "dp": 2, "tp": 2})
    contexts = [mesh.context(a) for a in ("pp", "dp", "tp", ("pp", "dp"), ("dp", "tp"), ("pp", "dp", "tp"))]
    assert len(set(contexts)) == len(contexts) and 0 not in contexts  # 0 is the world's
    assert max(contexts) <= MAX_CONTEXT


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda: Mesh({"fsdp": 2, "tp": 2}).check_world(3),
            r"mesh fsdp=2,tp=2 has 4 ranks \(2 x 2\) but the world has 3",
        ),
        (lambda: Mesh({"tp": 0}), "mesh axis 'tp' needs a size >= 1, got 0"),
        (lambda: Mesh([("tp", 2), ("tp", 2)]), "mesh axis names repeat"),
        (lambda: Mesh({}), "at least one axis"),
        (lambda: Mesh.parse("fsdp=2,tp"), "expected name=size parts like fsdp=2,tp=2, got 'tp'"),
        (lambda: Mesh({"tp": 2}).members("dp", 0), "mesh tp=2 has no axis 'dp'"),
        (lambda: Mesh({"tp": 2}).coords(2), "rank 2 is outside mesh tp=2"),
    ],
)
def test_bad_meshes_are_named(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_mesh_parse():
    assert Mesh.parse("fsdp=2, tp=3") == Mesh({"fsdp": 2, "tp": 3})
    assert str(Mesh.parse("dp=4")) == "dp=4"


def test_group_checks_its_arguments():
    comm = Communicator(4)
    with pytest.raises(ValueError, match="rank 1 is not a member of group"):
        Group(comm, 1, (0, 2))
    with pytest.raises(ValueError, match="repeat a rank"):
        Group(comm, 0, (0, 0))
    with pytest.raises(ValueError, match="group member rank 4 is outside 0..3"):
        Group(comm, 0, (0, 4))
    with pytest.raises(ValueError, match=f"outside 0..{MAX_CONTEXT}"):
        Group(comm, 0, (0, 1), context=MAX_CONTEXT + 1)
    with pytest.raises(ValueError, match=f"tag must be an int in 0..{TAGS_PER_CONTEXT - 1}"):
        Group(comm, 0, (0, 1)).send(1, np.zeros(1), tag=TAGS_PER_CONTEXT)


def local_ranks_and_wire_tags(comm, rank):
    """A group of the odd ranks, backwards: local ranks, translation, and context on the wire."""
    odd = tuple(reversed(range(1, comm.num_devices, 2)))
    if rank not in odd:
        return
    group = Group(comm, rank, odd, context=5)
    assert group.size == len(odd) and group.to_global(group.rank) == rank
    right = (group.rank + 1) % group.size
    group.send(right, np.array([group.rank]), tag=3)
    src, data = group.recv(tag=3)
    assert src == (group.rank - 1) % group.size and data.tolist() == [src]
    sent = comm.traffic(rank).sent_bytes
    assert set(sent) == {(group.to_global(right), 5 * TAGS_PER_CONTEXT + 3)}  # global peer, wire tag


def test_group_local_ranks(world):
    world.run(local_ranks_and_wire_tags)


def both_axes_at_once(comm, rank):
    """On a 2 x 2 mesh, a ring on each axis and an all-reduce on each, interleaved, same tags: no cross-talk."""
    mesh = Mesh({"fsdp": 2, "tp": 2})
    world = Group.world(comm, rank)
    fsdp, tp = mesh.group(world, "fsdp"), mesh.group(world, "tp")
    for round_ in range(3):
        mine = {
            name: np.full(3, 100 * round_ + 10 * (name == "tp") + rank, dtype=np.float64) for name in ("fsdp", "tp")
        }
        rings = {
            name: ring_allgather(g, mine[name], lambda owner: (3,), tag=Tag.RING)
            for name, g in (("fsdp", fsdp), ("tp", tp))
        }
        got = {name: [] for name in rings}
        for _step in range(2):  # step both rings in lockstep: their messages are in flight together
            for name, ring in rings.items():
                owner, block, _ = next(ring)
                got[name].append((owner, block.copy()))
        for ring in rings.values():
            assert next(ring, None) is None
        for name, g in (("fsdp", fsdp), ("tp", tp)):
            want = [g.to_global(owner) for owner, _ in got[name]]
            assert [int(b[0]) % 10 for _, b in got[name]] == want
        sums = {name: all_reduce(g, mine[name]) for name, g in (("fsdp", fsdp), ("tp", tp))}
        for name, g in (("fsdp", fsdp), ("tp", tp)):
            np.testing.assert_array_equal(sums[name], sum(100 * round_ + 10 * (name == "tp") + m for m in g.members))


def test_a_2x2_mesh_runs_both_axes_at_once_under_chaos():
    for seed in range(8):
        run_threads(4, both_axes_at_once, chaos=Chaos(seed=seed, max_delay=0.002))


def test_a_2x2_mesh_runs_both_axes_at_once(world):
    if world.size == 4:
        world.run(both_axes_at_once)
    else:
        with pytest.raises(ValueError, match=f"but the world has {world.size}"):
            Mesh({"fsdp": 2, "tp": 2}).check_world(world.size)
