#!/bin/bash
# Issue 61: the seeds still missing at the re-tuned rate (2e-3), so every cell has three:
# one device's third, P = 2's second and third, P = 4's and P = 8's third. Two lists so two
# runs go at once (a, b); the frozen code and each run: queue_lib.sh.
# Started with: nohup setsid experiments/results/horizon/queue_seeds.sh a >> experiments/results/horizon/logs/queue-seeds.log 2>&1 < /dev/null &
source "$(dirname "$0")/queue_lib.sh"
if [ "${1:-a}" = b ]; then SPECS=("pipemare 8 - 2 2400 0.002" "pipemare 2 - 2 2400 0.002")
else SPECS=("gpipe 2 - 2 2400 0.002" "pipemare 2 - 1 2400 0.002" "pipemare 4 - 2 2400 0.002"); fi
for spec in "${SPECS[@]}"; do run_one $spec; done
