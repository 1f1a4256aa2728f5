#!/bin/bash
# The bench at P = 2 on the release's code (481b72e, 2026-11-24) and on today's, in turn, twice,
# alone on the machine (2026-12-02, 00:12-00:18 UTC). The release's code, laid out so that its
# own pipemare.experiments is found before the installed one:
#   mkdir -p /tmp/oldpkg && git archive 481b72e pipemare experiments callbacks | tar -x -C /tmp/oldpkg
#   ln -s /tmp/oldpkg/experiments /tmp/oldpkg/pipemare/experiments
#   ln -s /tmp/oldpkg/callbacks /tmp/oldpkg/pipemare/callbacks
# Each run's table is OLD-or-NEW-K.md here (and its .jsonl).
cd /tmp
for r in 1 2; do
  for v in old new; do
    if [ $v = old ]; then PP=/tmp/oldpkg; else PP=; fi
    s=$(date +%s)
    OMP_NUM_THREADS=1 WANDB_MODE=disabled PYTHONPATH=$PP /work/main/.venv/bin/python -m pipemare.experiments.bench --out /tmp/ab_${v}_$r --processes 2 --schedules 1f1b async pipemare --memory-stages > /tmp/ab_${v}_$r.log 2>&1
    echo "$v $r rc=$? $(( $(date +%s) - s )) s" >> /tmp/ab_done.log
  done
done
