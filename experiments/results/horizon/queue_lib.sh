# Sourced by the horizon queues (queue.sh, queue_retune.sh, queue_seeds.sh, queue_nowp.sh, ...):
# the frozen code and one run. Each queue lists its runs as "variant stages N seed steps lr"
# ("-": the default N, P, or the task's rate 1e-3) and calls run_one on each; a run whose curve
# ($OUT/<name>.json; OUT is $HORIZON_OUT, else experiments/results/horizon) exists is skipped,
# so a queue can be restarted. The
# code is a frozen archive of commit $COMMIT (git archive), so edits in the working tree do not
# change runs mid-queue. Quality runs only: no step time is read from them.
cd /work/main || exit 1
COMMIT=509e7b900d655f13cd4f83f45304db9da311f47d
CODE=/tmp/horizon_code/${COMMIT:0:7}
if [ ! -f "$CODE/pipemare/__init__.py" ]; then  # rebuild the frozen archive if /tmp was cleared
  mkdir -p "$CODE" && git archive "$COMMIT" | tar -x -C "$CODE"
  ln -sfn ../experiments "$CODE/pipemare/experiments"; ln -sfn ../callbacks "$CODE/pipemare/callbacks"
fi
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 WANDB_MODE=disabled PYTHONPATH=$CODE HORIZON_CODE_COMMIT=$COMMIT
OUT=${HORIZON_OUT:-experiments/results/horizon}  # a queue may train elsewhere (--out)
PY=".venv/bin/python -P experiments/studies/horizon.py"

name_of() {  # variant stages N seed steps lr -> the curve's file name (horizon.py's _name)
  local v=$1 p=$2 n=$3 s=$4 steps=$5 lr=$6
  if [ "$v" = gpipe ]; then p=2; n=1; elif [ "$n" = - ]; then n=$p; fi
  local rate=""; [ "$lr" != - ] && rate="-lr$lr"
  echo "gpt_c64s-$v-P$p-N$n-s$s-${steps}steps$rate"
}

run_one() {  # variant stages N seed steps lr: run it unless its curve exists; say how it ended
  local v=$1 p=$2 n=$3 s=$4 steps=$5 lr=$6 name args
  name=$(name_of "$v" "$p" "$n" "$s" "$steps" "$lr")
  [ -f "$OUT/$name.json" ] && return 0
  args="run --variant $v --stages $p --seed $s --steps $steps --out $OUT"
  [ "$n" != - ] && args="$args --microbatches $n"
  [ "$lr" != - ] && args="$args --lr $lr"
  export HORIZON_COMMAND="cd /work/main && OMP_NUM_THREADS=1 WANDB_MODE=disabled PYTHONPATH=$CODE nice -n 19 $PY $args"
  echo "$(date -u +%FT%TZ) start $name: $HORIZON_COMMAND"
  if nice -n 19 $PY $args > "$OUT/logs/$name.log" 2>&1; then
    echo "$(date -u +%FT%TZ) done  $name: $(tail -1 "$OUT/logs/$name.log")"
  else
    echo "$(date -u +%FT%TZ) FAILED $name: see $OUT/logs/$name.log"
    return 1
  fi
}
