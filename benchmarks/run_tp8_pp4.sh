#!/usr/bin/env bash
# The literal example of the README: tp=8 × pp=4 = 32 worker processes on one CPU machine.
#   bash benchmarks/run_tp8_pp4.sh
# gpt-nano has 8 heads of width 8, the smallest GPT that tp=8 can shard. On a 2-core
# machine most of the ~5 minutes is 32 processes starting and compiling; the steps
# themselves take ~2 s each. Output of one run: benchmarks/results/tp8_pp4.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/fxpipe run --model gpt-nano --tp 8 --pp 4 --seq 32 --steps 3 --log-interval 1 \
  --micro-batch-size 2 --timeout 300 --timeline benchmarks/results/tp8_pp4 "$@"
