#!/bin/bash
# The quality queue, one run at a time, on the frozen code of commit $CODE (a git archive with
# pipemare/{experiments,callbacks,configs} linked, as experiments/results/horizon does).
CODE=${CODE:-/tmp/nbound_code/096e292}
OUT=/work/nbound/experiments/results/n_bound
cd "$CODE" || exit 1
export PYTHONPATH=$CODE OMP_NUM_THREADS=1 WANDB_MODE=disabled
for stages in "4 8" "2"; do
  nice -n 19 /work/main/.venv/bin/python -P experiments/results/n_bound/run.py \
    --out "$OUT" --stages $stages --seeds 3
done
