#!/usr/bin/env bash
# Install spmd the way users on a cluster do (non-editable), each into a throwaway venv, and run it from
# outside the source tree: once from the built wheel, once with `pip install .`. Catches a wheel that
# leaves out subpackages or py.typed (the editable install of `make` cannot see that).
set -euo pipefail
PYTHON=${PYTHON:-python3}
SRC=$(cd "$(dirname "$0")/../.." && pwd)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

"$PYTHON" -m venv "$WORK/build"
"$WORK/build/bin/pip" install --quiet --upgrade pip build
"$WORK/build/bin/python" -m build --wheel --outdir "$WORK/dist" "$SRC" > "$WORK/build.log" 2>&1 \
    || { cat "$WORK/build.log"; exit 1; }
WHEEL=$(ls "$WORK"/dist/spmd-*.whl)

run_installed() {  # $1: venv; runs from an empty folder so the source tree cannot be imported by accident
    local venv=$1
    mkdir -p "$WORK/cwd" && cd "$WORK/cwd"
    "$venv/bin/python" -c "import spmd, spmd.collectives, spmd.trainers, importlib.resources as r; \
assert r.files('spmd').joinpath('py.typed').is_file(), 'py.typed missing'; \
assert 'site-packages' in spmd.__file__, spmd.__file__"
    "$venv/bin/python" -m spmd fsdp --devices 2 --check
    "$venv/bin/mpiexec" -n 2 "$venv/bin/python" -m spmd fsdp --check
    "$venv/bin/python" -m spmd mlp-dp --devices 2 --check --quiet
    cd "$SRC"
}

echo "== the wheel ($(basename "$WHEEL")) in a fresh venv"
"$PYTHON" -m venv "$WORK/wheel"
"$WORK/wheel/bin/pip" install --quiet "$WHEEL[mpich]"
run_installed "$WORK/wheel"

echo "== pip install . in a fresh venv"
"$PYTHON" -m venv "$WORK/source"
"$WORK/source/bin/pip" install --quiet "$SRC[mpich]"
run_installed "$WORK/source"
echo "install check: both installs run"
