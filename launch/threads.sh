#!/usr/bin/env bash
# Run a strategy on threads in this process: no MPI needed.
#   launch/threads.sh fsdp --devices 4 --check
set -euo pipefail
strategy=${1:?usage: launch/threads.sh STRATEGY [flags...]}
shift
exec python -m spmd "$strategy" --backend threads "$@"
