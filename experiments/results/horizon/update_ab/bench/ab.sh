#!/bin/bash
cd /tmp
for r in 1 2 3 4; do
  for v in old new; do
    if [ $v = old ]; then PP=/tmp/oldpkg; else PP=; fi
    s=$(date +%s)
    OMP_NUM_THREADS=1 WANDB_MODE=disabled PYTHONPATH=$PP /work/main/.venv/bin/python -m pipemare.experiments.bench --out /tmp/bab_${v}_$r --processes 2 --schedules 1f1b async pipemare --memory-stages > /tmp/bab_${v}_$r.log 2>&1
    echo "$v $r rc=$? $(( $(date +%s) - s )) s $(date +%T)" >> /tmp/bab_done.log
  done
done
