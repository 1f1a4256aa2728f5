#!/bin/bash
# Issue 61's horizon quality runs on gpt_c64s, one at a time per list, in priority order.
# Started with: nohup experiments/results/horizon/queue.sh long >> experiments/results/horizon/logs/queue.log 2>&1 &
#          and: nohup experiments/results/horizon/queue.sh mid >> experiments/results/horizon/logs/queue-mid.log 2>&1 &
# (two lists at once on two cores; the frozen code and each run: queue_lib.sh)
source "$(dirname "$0")/queue_lib.sh"
LIST=${1:-long}  # which list: long (2,400 steps and the rate re-tune) or mid (960 steps)
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
for pass in 1 2; do  # a second pass retries what failed
  for spec in "${RUNS[@]}"; do
    run_one $spec
    nice -n 19 $PY table >> "$OUT/logs/table.log" 2>&1
  done
done
echo "$(date -u +%FT%TZ) queue finished"
