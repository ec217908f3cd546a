#!/usr/bin/env bash
# Run a strategy on threads in this process: no MPI needed.
#   launch/threads.sh fsdp --devices 4 --check
set -euo pipefail
# The project's venv, when `make` made one: no need to activate it first.
venv="$(cd "$(dirname "$0")/.." && pwd)/.venv/bin"
if [[ -x "$venv/python" ]]; then PATH="$venv:$PATH"; fi
strategy=${1:?usage: launch/threads.sh STRATEGY [flags...]}
shift
exec python -m spmd "$strategy" --backend threads "$@"
