#!/bin/bash
# The quality queue, one run at a time, on the frozen code of commit $COMMIT (a git archive with
# pipemare/{experiments,callbacks,configs} linked, as experiments/results/horizon does; rebuilt
# if /tmp was cleared). Seed-major over P = 4, 8 and 2 (run.py's order): seed 0's cells at P = 2
# first, then every cell of seed 1, then of seed 2; stored runs are skipped, so it resumes.
# Started with: nohup setsid experiments/results/n_bound/queue.sh >> experiments/results/n_bound/logs/queue3.log 2>&1 < /dev/null &
COMMIT=${COMMIT:-b336ff8}
CODE=/tmp/nbound_code/$COMMIT
OUT=/work/main/experiments/results/n_bound
if [ ! -f "$CODE/pipemare/__init__.py" ]; then
  mkdir -p "$CODE" && (cd /work/main && git archive "$COMMIT" | tar -x -C "$CODE")
  for m in callbacks experiments configs; do ln -sfn ../$m "$CODE/pipemare/$m"; done
fi
cd "$CODE" || exit 1
export PYTHONPATH=$CODE OMP_NUM_THREADS=1 WANDB_MODE=disabled
echo "$(date -u +%FT%TZ) start: seeds 0-2 at P = 4 8 2 from $CODE"
nice -n 19 /work/main/.venv/bin/python -P experiments/results/n_bound/run.py \
  --out "$OUT" --stages 4 8 2 --seeds 3
echo "$(date -u +%FT%TZ) done"
