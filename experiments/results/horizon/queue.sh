#!/bin/bash
# Issue 61's horizon quality runs on gpt_c64s, one at a time per list, in priority order.
# Started with: nohup experiments/results/horizon/queue.sh long >> experiments/results/horizon/logs/queue.log 2>&1 &
#          and: nohup experiments/results/horizon/queue.sh mid >> experiments/results/horizon/logs/queue-mid.log 2>&1 &
# (two lists at once on two cores: quality runs only, no step time is read from them)
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
LIST=${1:-long}  # which list: long (2,400 steps and the rate re-tune) or mid (960 steps)
PY=".venv/bin/python -P experiments/studies/horizon.py"
# variant stages N(default: "-") seed steps lr(default: "-", the task's 1e-3)
LONG=(
  "gpipe 2 - 0 2400 -" "gpipe 2 - 1 2400 -" "gpipe 2 - 2 2400 -"
  "pipemare 4 - 0 2400 -" "pipemare 8 - 0 2400 -" "pipemare 4 - 1 2400 -" "pipemare 8 - 1 2400 -"
  "pipemare 4 - 2 2400 -" "pipemare 8 - 2 2400 -"
  "pipemare 2 - 0 2400 -" "pipemare 2 - 1 2400 -" "pipemare 2 - 2 2400 -"
  "async 4 - 0 2400 -" "async 4 - 1 2400 -" "async 4 - 2 2400 -"
  # added after the first 15: the rate re-tune, then breadth first over the cells left
  "gpipe 2 - 0 2400 0.002" "gpipe 2 - 0 2400 0.0005"
  "async 8 - 0 2400 -" "async 2 - 0 2400 -" "pipemare 4 8 0 2400 -"
  "async 8 - 1 2400 -" "async 2 - 1 2400 -" "pipemare 4 8 1 2400 -"
  "async 8 - 2 2400 -" "async 2 - 2 2400 -" "pipemare 4 8 2 2400 -"
)
MID=(
  "gpipe 2 - 0 960 -" "pipemare 4 - 0 960 -" "pipemare 8 - 0 960 -" "pipemare 2 - 0 960 -"
  "async 4 - 0 960 -"
  "gpipe 2 - 1 960 -" "pipemare 4 - 1 960 -" "pipemare 8 - 1 960 -" "pipemare 2 - 1 960 -"
  "gpipe 2 - 2 960 -" "pipemare 4 - 2 960 -" "pipemare 8 - 2 960 -" "pipemare 2 - 2 960 -"
  "async 4 - 1 960 -" "async 4 - 2 960 -"
)
if [ "$LIST" = mid ]; then RUNS=("${MID[@]}"); else RUNS=("${LONG[@]}"); fi
name_of() {  # variant stages N seed steps lr -> the curve's file name (horizon.py's _name)
  local v=$1 p=$2 n=$3 s=$4 steps=$5 lr=$6
  if [ "$v" = gpipe ]; then p=2; n=1; elif [ "$n" = - ]; then n=$p; fi
  local rate=""; [ "$lr" != - ] && rate="-lr$lr"
  echo "gpt_c64s-$v-P$p-N$n-s$s-${steps}steps$rate"
}
failed=()
for pass in 1 2; do
  for spec in "${RUNS[@]}"; do
    set -- $spec
    v=$1 p=$2 n=$3 s=$4 steps=$5 lr=$6
    name=$(name_of $v $p $n $s $steps $lr)
    [ -f "$OUT/$name.json" ] && continue
    args="run --variant $v --stages $p --seed $s --steps $steps"
    [ "$n" != - ] && args="$args --microbatches $n"
    [ "$lr" != - ] && args="$args --lr $lr"
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
