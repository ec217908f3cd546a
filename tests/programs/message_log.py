"""Print every rank's ordered message log of DP and FSDP, run on threads or under mpiexec.

    python tests/programs/message_log.py threads 3
    mpiexec -n 3 python tests/programs/message_log.py mpi
print the same JSON: {"dp": [log of rank 0, ...], "fsdp": [...]}.
"""

import json
import sys

import numpy as np

from spmd.collectives import gather
from spmd.dp import dp_rank
from spmd.fsdp import fsdp_rank
from spmd.layout import block_range

M, K, N = 11, 5, 7  # uneven over 3 ranks on purpose


def logs(comm, rank):
    size = comm.num_devices
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((M, K)), rng.standard_normal((K, N))
    a_block = a[slice(*block_range(M, size, rank))]
    result = {}
    for strategy in ("dp", "fsdp"):
        start = len(comm.traffic(rank).log)
        if strategy == "dp":
            dp_rank(comm, rank, a_block, b, m_rows=M)
        else:
            fsdp_rank(comm, rank, a_block, b[:, slice(*block_range(N, size, rank))], (M, N))
        result[strategy] = [list(event) for event in comm.traffic(rank).log[start:]]
    return result


def main():
    backend = sys.argv[1]
    if backend == "threads":
        from spmd.threads import run_threads

        per_rank = run_threads(int(sys.argv[2]), logs)
    else:
        from spmd.mpi import run_mpi

        def mpi_logs(comm, rank):
            mine = json.dumps(logs(comm, rank)).encode()
            everyone = gather(comm, rank, np.frombuffer(mine, dtype=np.uint8), tag=50)
            return None if everyone is None else [json.loads(e.tobytes()) for e in everyone]

        per_rank = run_mpi(mpi_logs)
        if per_rank is None:
            return
    print(json.dumps({s: [r[s] for r in per_rank] for s in ("dp", "fsdp")}))


if __name__ == "__main__":
    main()
