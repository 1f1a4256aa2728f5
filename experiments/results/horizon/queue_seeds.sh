#!/bin/bash
# Issue 61: the seeds still missing at the re-tuned rate (2e-3), so every cell has three:
# one device's third, P = 2's second and third, P = 4's and P = 8's third.
# Two lists so two runs go at once (a, b); a finished run is skipped, so the queue restarts.
# Started with: nohup setsid experiments/results/horizon/queue_seeds.sh a >> experiments/results/horizon/logs/queue-seeds.log 2>&1 < /dev/null &
cd /work/main
COMMIT=509e7b900d655f13cd4f83f45304db9da311f47d
CODE=/tmp/horizon_code/${COMMIT:0:7}
if [ ! -f "$CODE/pipemare/__init__.py" ]; then  # rebuild the frozen archive if /tmp was cleared
  mkdir -p "$CODE" && git archive "$COMMIT" | tar -x -C "$CODE"
  ln -sfn ../experiments "$CODE/pipemare/experiments"; ln -sfn ../callbacks "$CODE/pipemare/callbacks"
fi
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 WANDB_MODE=disabled PYTHONPATH=$CODE HORIZON_CODE_COMMIT=$COMMIT
OUT=experiments/results/horizon
if [ "${1:-a}" = b ]; then SPECS=("pipemare 8 2 0.002" "pipemare 2 2 0.002")
else SPECS=("gpipe 2 2 0.002" "pipemare 2 1 0.002" "pipemare 4 2 0.002"); fi
for spec in "${SPECS[@]}"; do
  set -- $spec
  v=$1 p=$2 s=$3 lr=$4
  n=$p; [ "$v" = gpipe ] && { p=2; n=1; }
  name="gpt_c64s-$v-P$p-N$n-s$s-2400steps-lr$lr"
  [ -f "$OUT/$name.json" ] && continue
  args="run --variant $v --stages $p --seed $s --steps 2400 --lr $lr"
  export HORIZON_COMMAND="cd /work/main && OMP_NUM_THREADS=1 WANDB_MODE=disabled PYTHONPATH=$CODE nice -n 19 .venv/bin/python -P experiments/studies/horizon.py $args"
  echo "$(date -u +%FT%TZ) start $name: $HORIZON_COMMAND"
  nice -n 19 .venv/bin/python -P experiments/studies/horizon.py $args > "$OUT/logs/$name.log" 2>&1 \
    && echo "$(date -u +%FT%TZ) done  $name: $(tail -1 "$OUT/logs/$name.log")" \
    || echo "$(date -u +%FT%TZ) FAILED $name"
done
