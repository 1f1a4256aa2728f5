#!/bin/bash
# One sitting of the links check (issue 62), run alone on the machine (pause other work first):
#   experiments/results/links/sitting.sh K [links...]
# For the compute-bound GPT (width 192, 8 blocks, context 64) and the dispatch-bound one (64, 4,
# 32): the default pipemare run (its advice replays both schedules from the layers measured at
# setup, over the link measured at setup), then 1F1B at the N the advice found fastest; then the
# same over each simulated link given (default: none). Appends to results.jsonl.
cd "$(dirname "$0")/../../.."
K=${1:?sitting number}; shift
PY=".venv/bin/python -P experiments/results/links/measure.py"
export PYTHONPATH= OMP_NUM_THREADS=1 WANDB_MODE=disabled
for model in "192 8 64" "64 4 32"; do
  for link in real "$@"; do
    extra=""; [ "$link" != real ] && extra="--link $link"
    line=$($PY $model pipemare --sitting "$K" $extra 2>&1 | grep '^RESULT')
    echo "$line"
    n=$(echo "$line" | sed -n 's/.*"baseline_n": \([0-9]*\).*/\1/p')
    [ -n "$n" ] && $PY $model 1f1b "$n" --sitting "$K" $extra 2>&1 | grep '^RESULT'
  done
done
