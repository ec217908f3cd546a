"""The ep axis's route (spmd.parallel.expert), on one rank's numbers: what it sends each ep rank, where what it
receives lands, the received pairs in expert order, and the pairs it counts."""

import numpy as np

from spmd.parallel.expert import ExpertParallel


def test_a_route_sends_each_rank_its_experts_pairs_and_orders_what_arrives_by_expert():
    ep = ExpertParallel(size=2, coord=0)  # 4 experts, 2 a rank; no group: rank 0's view
    assert ep.held(4) == 2
    bounds = np.array([0, 2, 3, 3, 7])  # this rank's pairs by expert: 2, 1, 0, 4
    rc = np.array([[2, 1], [3, 0]])  # received for experts 0 and 1: from rank 0 (2, 1), from rank 1 (3, 0)
    route = ep.route(bounds, rc, backward=False)
    assert route.outgoing == [slice(0, 3), slice(3, 7)]
    assert route.incoming == [slice(0, 3), slice(3, 6)]
    assert route.perm.tolist() == [0, 1, 3, 4, 5, 2]  # expert 0's from rank 0, then rank 1; then expert 1's
    assert route.segments == [(slice(0, 5), 0), (slice(5, 6), 1)]
    assert ep.exchanged.tolist() == [4, 3, 0, 0]  # sent to and received from rank 1, in forward
    ep.route(bounds, rc, backward=True)
    assert ep.exchanged.tolist() == [4, 3, 4, 3]
