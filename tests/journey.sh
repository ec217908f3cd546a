#!/usr/bin/env bash
# The README's journey at toy size, typed as a user would: prepare the default corpus, train the LM on 4 MPI
# ranks with evaluation and a checkpoint, resume it on 2 ranks of another mesh, generate text from it; then a BPE
# corpus of a glob of files (the bpe extra), trained on 2 threads and generated from.
# PY and MPIEXEC: the venv's python and mpiexec (the Makefile passes them).
set -euo pipefail
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
"$PY" -m spmd data prepare --out corpus
size="--model llama --data corpus --layers 2 --hidden 32 --ffn 64 --heads 2 --seq 32 --batch 8 --optimizer adamw --lr 3e-3"
# shellcheck disable=SC2086
"$MPIEXEC" -n 4 "$PY" -m spmd train $size --mesh pp=2,fsdp=2 --steps 4 --eval-every 2 --save ckpt --check --quiet
# shellcheck disable=SC2086
"$MPIEXEC" -n 2 "$PY" -m spmd train $size --mesh tp=2 --sp --steps 6 --eval-every 2 --load ckpt --save ckpt --check --quiet
"$PY" -m spmd generate --load ckpt --prompt "def " --max-tokens 40 --seed 1 | tee sample.txt
test "$(head -c 4 sample.txt)" = "def "
lib=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
"$PY" -m spmd data prepare "$lib/email/**/*.py" --tokenizer bpe --vocab 512 --val-fraction 0.2 --out bpe
"$PY" -m spmd train --model llama --data bpe --layers 1 --hidden 16 --ffn 32 --heads 2 --seq 16 --batch 4 --steps 3 \
    --devices 2 --eval-every 3 --eval-tokens 64 --save bpe-ckpt --quiet
"$PY" -m spmd generate --load bpe-ckpt --prompt "def " --max-tokens 20 --seed 1 | tee bpe-sample.txt
test "$(head -c 4 bpe-sample.txt)" = "def "
echo "journey: OK"
