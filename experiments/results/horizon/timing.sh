#!/bin/bash
# The 240-step timing of one run (pipemare P = 4, seed 0) to estimate the queue's length.
# Not a step time: quality runs share this 2-core machine with the other engineer's work.
cd /work/main
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 WANDB_MODE=disabled PYTHONPATH=/tmp/horizon_code/509e7b9 HORIZON_CODE_COMMIT=509e7b900d655f13cd4f83f45304db9da311f47d
for v in pipemare gpipe; do
  /usr/bin/time -v nice -n 19 .venv/bin/python -P experiments/studies/horizon.py run --variant $v --stages 4 --seed 0 --steps 240 --out experiments/results/horizon/timing
done
