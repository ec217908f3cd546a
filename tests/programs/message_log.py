"""Print every rank's ordered message log of every registered strategy, run on threads or under mpiexec.

    python tests/programs/message_log.py threads 3
    mpiexec -n 3 python tests/programs/message_log.py mpi
print the same JSON: {"dp": [log of rank 0, ...], "fsdp": [...], ...}.
"""

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent.parent))  # tests/, for strategy_run
from spmd.collectives import gather  # noqa: E402
from spmd.matmul import STRATEGIES  # noqa: E402
from spmd.transport.group import Group  # noqa: E402
from strategy_run import run_strategy  # noqa: E402

M, K, N = 11, 5, 7  # uneven over 3 ranks on purpose


def logs(comm, rank):
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((M, K)), rng.standard_normal((K, N))
    result = {}
    comm.traffic(rank).keep_log = True
    for name, strategy in STRATEGIES.items():
        start = len(comm.traffic(rank).log)
        run_strategy(comm, rank, strategy, a, b)
        result[name] = [list(event) for event in comm.traffic(rank).log[start:]]
    return result


def main():
    backend = sys.argv[1]
    if backend == "threads":
        from spmd.transport.threads import run_threads

        per_rank = run_threads(int(sys.argv[2]), logs)
    else:
        from spmd.transport.mpi import run_mpi

        def mpi_logs(comm, rank):
            mine = json.dumps(logs(comm, rank)).encode()
            everyone = gather(Group.world(comm, rank), np.frombuffer(mine, dtype=np.uint8), tag=50)
            return None if everyone is None else [json.loads(e.tobytes()) for e in everyone]

        per_rank = run_mpi(mpi_logs)
        if per_rank is None:
            return
    print(json.dumps({s: [r[s] for r in per_rank] for s in STRATEGIES}))


if __name__ == "__main__":
    main()
