#!/bin/bash
# The halves cut's quality runs: gpt_c64s_halves (gpt_c64s cut between each block's attention
# and its MLP as well), the default pipemare at P = 4 and 8 (N = P), the task's rate 1e-3,
# 2,400 steps, seeds 0-2. Two lists so two runs go at once, P = 4's three seeds first (a: its
# seeds 0 and 2, then P = 8's seed 1; b: its seed 1, then P = 8's 0 and 2). The code is a
# frozen archive of commit $COMMIT, as the horizon queues' (../horizon/queue_lib.sh); a run whose
# curve exists is skipped, so the queue resumes. Quality runs only: no step time is read here.
# Started with: nohup setsid experiments/results/horizon_halves/queue.sh a >> experiments/results/horizon_halves/logs/queue.log 2>&1 < /dev/null &
cd /work/main || exit 1
COMMIT=${COMMIT:?the commit to freeze}
CODE=/tmp/halves_code/${COMMIT:0:7}
if [ ! -f "$CODE/pipemare/__init__.py" ]; then
  mkdir -p "$CODE" && git archive "$COMMIT" | tar -x -C "$CODE"
  ln -sfn ../experiments "$CODE/pipemare/experiments"; ln -sfn ../callbacks "$CODE/pipemare/callbacks"
fi
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 WANDB_MODE=disabled PYTHONPATH=$CODE HORIZON_CODE_COMMIT=$COMMIT
OUT=experiments/results/horizon_halves
PY=".venv/bin/python -P experiments/studies/horizon.py"
if [ "${1:-a}" = b ]; then SPECS=("4 1" "8 0" "8 2"); else SPECS=("4 0" "4 2" "8 1"); fi
for spec in "${SPECS[@]}"; do
  read -r P s <<< "$spec"
  name="gpt_c64s_halves-pipemare-P$P-N$P-s$s-2400steps"
  [ -f "$OUT/$name.json" ] && continue
  args="run --task gpt_c64s_halves --variant pipemare --stages $P --seed $s --steps 2400"
  export HORIZON_COMMAND="cd /work/main && OMP_NUM_THREADS=1 WANDB_MODE=disabled PYTHONPATH=$CODE nice -n 19 $PY $args"
  echo "$(date -u +%FT%TZ) start $name: $HORIZON_COMMAND"
  if nice -n 19 $PY $args > "$OUT/logs/$name.log" 2>&1; then
    echo "$(date -u +%FT%TZ) done  $name: $(tail -1 "$OUT/logs/$name.log")"
  else
    echo "$(date -u +%FT%TZ) FAILED $name: see $OUT/logs/$name.log"
  fi
done
