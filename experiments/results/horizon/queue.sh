#!/bin/bash
# Issue 61's horizon quality runs on gpt_c64s, 2,400 steps, one at a time, in priority order.
# Started with: nohup experiments/results/horizon/queue.sh > experiments/results/horizon/logs/queue.log 2>&1 &
# A run whose curve (experiments/results/horizon/<name>.json) exists is skipped, so the queue can
# be restarted. The code is a frozen archive of commit $COMMIT (git archive), so the other
# engineer's edits in the working tree do not change runs mid-queue.
cd /work/main
COMMIT=509e7b900d655f13cd4f83f45304db9da311f47d
CODE=/tmp/horizon_code/${COMMIT:0:7}
if [ ! -f "$CODE/pipemare/__init__.py" ]; then  # rebuild the frozen archive if /tmp was cleared
  mkdir -p "$CODE" && git archive "$COMMIT" | tar -x -C "$CODE"
  ln -sfn ../experiments "$CODE/pipemare/experiments"; ln -sfn ../callbacks "$CODE/pipemare/callbacks"
fi
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 WANDB_MODE=disabled PYTHONPATH=$CODE HORIZON_CODE_COMMIT=$COMMIT
OUT=experiments/results/horizon
STEPS=2400
PY=".venv/bin/python -P experiments/studies/horizon.py"
RUNS=(
  # variant stages N(default: "-") seed
  "gpipe 2 - 0" "gpipe 2 - 1" "gpipe 2 - 2"
  "pipemare 4 - 0" "pipemare 8 - 0" "pipemare 4 - 1" "pipemare 8 - 1" "pipemare 4 - 2" "pipemare 8 - 2"
  "pipemare 2 - 0" "pipemare 2 - 1" "pipemare 2 - 2"
  "async 4 - 0" "async 4 - 1" "async 4 - 2"
  "async 8 - 0" "async 8 - 1" "async 8 - 2"
  "async 2 - 0" "async 2 - 1" "async 2 - 2"
  "pipemare 4 8 0" "pipemare 8 16 0" "pipemare 4 8 1" "pipemare 8 16 1"
)
name_of() {  # variant stages N seed -> the curve's file name (gpipe: P = 2, N = 1; default N = P)
  local v=$1 p=$2 n=$3 s=$4
  if [ "$v" = gpipe ]; then p=2; n=1; elif [ "$n" = - ]; then n=$p; fi
  echo "gpt_c64s-$v-P$p-N$n-s$s-${STEPS}steps"
}
failed=()
for pass in 1 2; do
  for spec in "${RUNS[@]}"; do
    set -- $spec
    v=$1 p=$2 n=$3 s=$4
    name=$(name_of $v $p $n $s)
    [ -f "$OUT/$name.json" ] && continue
    args="run --variant $v --stages $p --seed $s --steps $STEPS"
    [ "$n" != - ] && args="$args --microbatches $n"
    export HORIZON_COMMAND="cd /work/main && OMP_NUM_THREADS=1 WANDB_MODE=disabled PYTHONPATH=$CODE nice -n 19 $PY $args"
    echo "$(date -u +%FT%TZ) start $name: $HORIZON_COMMAND"
    if nice -n 19 $PY $args > "$OUT/logs/$name.log" 2>&1; then
      echo "$(date -u +%FT%TZ) done  $name: $(tail -1 "$OUT/logs/$name.log")"
    else
      echo "$(date -u +%FT%TZ) FAILED $name (pass $pass): see $OUT/logs/$name.log"
    fi
    nice -n 19 $PY table >> "$OUT/logs/table.log" 2>&1
  done
done
echo "$(date -u +%FT%TZ) queue finished"
