#!/usr/bin/env bash
# Run a strategy as RANKS MPI processes (default 4), on this machine or on the
# hosts listed one per line in HOSTFILE (MPICH's `-f`; Open MPI's `--hostfile`).
#   RANKS=8 HOSTFILE=hosts.txt launch/mpirun.sh fsdp --check
set -euo pipefail
# The project's venv, when `make` made one: no need to activate it first.
venv="$(cd "$(dirname "$0")/.." && pwd)/.venv/bin"
if [[ -x "$venv/python" ]]; then PATH="$venv:$PATH"; fi
strategy=${1:?usage: [RANKS=n] [HOSTFILE=f] launch/mpirun.sh STRATEGY [flags...]}
shift
hosts=()
if [[ -n "${HOSTFILE:-}" ]]; then hosts=(-f "$HOSTFILE"); fi
exec mpirun -n "${RANKS:-4}" "${hosts[@]}" python -m spmd "$strategy" --backend mpi "$@"
