#!/bin/bash
# Issue 61's T3 study: gpt_c64s (2,400 steps, the task's rate 1e-3, nanoGPT's recipe), the
# default pipemare at P = 4, N = 4 with its first K steps synchronous (1F1B), K = 5%, 10%, 20%
# and a third of the run; seed 0 first at every K, then seeds 1 and 2. Its curves go to
# ../horizon beside the default's, and `horizon.py table` reads them there. The code is a frozen
# archive of commit $COMMIT (as ../horizon/queue_lib.sh); a run whose curve exists is skipped,
# so the queue resumes. Quality runs only: no step time is read here.
# Started with: COMMIT=<sha> nohup setsid experiments/results/horizon_t3/queue.sh >> experiments/results/horizon_t3/logs/queue.log 2>&1 < /dev/null &
cd /work/main || exit 1
COMMIT=${COMMIT:?the commit to freeze}
CODE=/tmp/t3_code/${COMMIT:0:7}
if [ ! -f "$CODE/pipemare/__init__.py" ]; then
  mkdir -p "$CODE" && git archive "$COMMIT" | tar -x -C "$CODE"
  ln -sfn ../experiments "$CODE/pipemare/experiments"; ln -sfn ../callbacks "$CODE/pipemare/callbacks"
fi
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 WANDB_MODE=disabled PYTHONPATH=$CODE HORIZON_CODE_COMMIT=$COMMIT
OUT=experiments/results/horizon
PY=".venv/bin/python -P experiments/studies/horizon.py"
for s in ${SEEDS:-0 1 2}; do
  for k in ${KS:-240 480 800 120}; do
    name="gpt_c64s-pipemare+T3w$k-P4-N4-s$s-2400steps"
    [ -f "$OUT/$name.json" ] && continue
    args="run --variant pipemare+T3w$k --stages 4 --seed $s --steps 2400"
    export HORIZON_COMMAND="cd /work/main && OMP_NUM_THREADS=1 WANDB_MODE=disabled PYTHONPATH=$CODE nice -n 19 $PY $args"
    echo "$(date -u +%FT%TZ) start $name: $HORIZON_COMMAND"
    if nice -n 19 $PY $args > "experiments/results/horizon_t3/logs/$name.log" 2>&1; then
      echo "$(date -u +%FT%TZ) done  $name: $(tail -1 "experiments/results/horizon_t3/logs/$name.log")"
    else
      echo "$(date -u +%FT%TZ) FAILED $name: see experiments/results/horizon_t3/logs/$name.log"
    fi
  done
done
