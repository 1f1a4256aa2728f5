#!/bin/bash
# Issue 61: the 4x horizon (960 steps) at the task's rate (1e-3) with three seeds per cell:
# one device's second and third, P = 2's three, P = 4's and P = 8's second and third. Two lists
# so two runs go at once (a, b); the frozen code and each run: queue_lib.sh.
# Started with: nohup setsid experiments/results/horizon/queue_4x.sh a >> experiments/results/horizon/logs/queue-4x.log 2>&1 < /dev/null &
source "$(dirname "$0")/queue_lib.sh"
if [ "${1:-a}" = b ]; then SPECS=("pipemare 4 - 1 960 -" "pipemare 8 - 1 960 -" "pipemare 2 - 1 960 -" "pipemare 4 - 2 960 -")
else SPECS=("gpipe 2 - 1 960 -" "pipemare 2 - 0 960 -" "gpipe 2 - 2 960 -" "pipemare 8 - 2 960 -" "pipemare 2 - 2 960 -"); fi
for spec in "${SPECS[@]}"; do run_one $spec; done
